"""On-device sampling of one step's rows, as its own jitted function.

The sampler is compiled per (row count, `SamplerFeatures`): every choice that depends on
the batch (any row sampling at random, which filters, penalties, logprobs) is made on
the host, where the batch is built, and selects a compiled variant. No per-step
executable branches on device data: on XLA:GPU a `lax.cond` copies its predicate to
the host and blocks until the stream reaches it, which would stall the engine loop.

Randomness is per request: the key of a row is fold_in(key(seed), output_index), so a
request's tokens depend only on its own seed and position, never on which other
requests share the batch, their order, or a preemption in between.

Per-request state that is as wide as the vocabulary (logit bias / allowed tokens,
prompt tokens and output counts for penalties, stop ids masked by min_tokens) lives on
the device in `SamplerState`, one row per persistent batch row: the host writes a row
once when a request is admitted (`write_state_row`) and the sampler counts each sampled
token, so no vocabulary-sized array crosses to the device per step.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jaxvllm.config import DEFAULT_MAX_LOGPROBS
from jaxvllm.request import Request

# Bad words, per request, after tokenization (each word with and without a leading space):
# at most this many sequences of at most this many tokens (the device keeps them per row).
MAX_BAD_WORDS = 32
MAX_BAD_WORD_TOKENS = 8


def _column(dtype, pad=0, row: str | None = None):
    """One sampling field: its host dtype (float32 and uint32 travel bitcast in the packed
    int32 batch, bools as 0/1), a padding row's value, and `row`: the attribute of a
    `Request` that the persistent batch copies once per request (None: filled per step)."""
    return field(metadata={"dtype": dtype, "pad": pad, "row": row})


@jax.tree_util.register_dataclass
@dataclass
class SamplingTensors:
    """Per-row parameters, [S] each: the one table of sampling fields, from which the
    persistent batch's columns (`InputBatch`) and the packed batch's layout
    (`BatchLayout`) are derived. Padding rows are greedy and use no state."""

    temperature: jax.Array = _column(np.float32, 0.0, "params.temperature")  # 0 = greedy
    top_k: jax.Array = _column(np.int32, 0, "top_k")  # 0 = off
    top_p: jax.Array = _column(np.float32, 1.0, "params.top_p")
    min_p: jax.Array = _column(np.float32, 0.0, "params.min_p")
    presence_penalty: jax.Array = _column(np.float32, 0.0, "params.presence_penalty")
    frequency_penalty: jax.Array = _column(np.float32, 0.0, "params.frequency_penalty")
    repetition_penalty: jax.Array = _column(np.float32, 1.0, "params.repetition_penalty")
    seeds: jax.Array = _column(np.uint32, 0, "seed")
    use_state: jax.Array = _column(bool, False, "uses_sampler_state")  # bias / penalties / min_tokens apply
    min_tokens: jax.Array = _column(np.int32, 0, "min_tokens")  # stop ids masked below this output index
    output_index: jax.Array = _column(np.int32)  # tokens generated before this one
    # The request's persistent row (its SamplerState and last_sampled row); a padding row's
    # is 0, with use_state and counts_sample off, so it reads and writes nothing there.
    slot: jax.Array = _column(np.int32)
    counts_sample: jax.Array = _column(bool)  # the sample is appended to the request (update its counts)
    want_logprobs: jax.Array = _column(bool)


# The table, in packing order: (name, host dtype, padding value, Request attribute or None).
SAMPLING_COLUMNS = tuple((f.name, f.metadata["dtype"], f.metadata["pad"], f.metadata["row"])
                         for f in fields(SamplingTensors))


@dataclass(frozen=True)
class SamplerFeatures:
    """What a batch's rows use; each flag compiles its stage in, or leaves it out."""

    random: bool = False  # some row samples (temperature > 0 and top_k != 1); else argmax only
    min_p: bool = False
    top_k: bool = False
    top_p: bool = False
    state: bool = False  # logit bias / allowed ids / min_tokens / penalties / bad words
    bad_words: bool = False  # some row bans bad words (needs state)
    logprobs: int = 0  # width of the top-logprobs arrays; 0: no logprobs
    grammar: bool = False  # some row has a structured-output bitmask

    @classmethod
    def of(cls, t: SamplingTensors, rows: np.ndarray, *, bad_words: np.ndarray | None = None,
           logprobs_width: int = DEFAULT_MAX_LOGPROBS, grammar: bool = False) -> "SamplerFeatures":
        """The features of host (numpy) tensors, over the rows that sample (`rows`, a bool
        mask); `bad_words`: which rows ban words; `logprobs_width`: top logprobs to compute
        when a row wants logprobs; `grammar`: a sampling row is constrained."""
        random = rows & is_random(t)
        any_random = bool(random.any())
        return cls(
            random=any_random,
            min_p=any_random and bool((random & (t.min_p > 0)).any()),
            top_k=any_random and bool((random & (t.top_k > 0)).any()),
            top_p=any_random and bool((random & (t.top_p < 1)).any()),
            state=bool((rows & t.use_state).any()),
            bad_words=bad_words is not None and bool((rows & bad_words).any()),
            logprobs=logprobs_width if (rows & t.want_logprobs).any() else 0,
            grammar=grammar,
        )

    @property
    def name(self) -> str:
        on = [f for f in ("random", "min_p", "top_k", "top_p", "state", "bad_words", "logprobs", "grammar")
              if getattr(self, f)]
        return "+".join(on) or "greedy"


# Compiled in the warm-up for every row count: what most batches use (top_p alone is the
# commonest setting given, and Llama 3's generation_config.json, the default params, sets it).
COMMON_FEATURES = (
    SamplerFeatures(),
    SamplerFeatures(random=True),
    SamplerFeatures(random=True, top_p=True),
    SamplerFeatures(random=True, top_k=True, top_p=True),
)


@jax.tree_util.register_dataclass
@dataclass
class SamplerState:
    """[rows, vocab] per-request sampling state (donated, updated in place)."""

    bias: jax.Array  # float32: logit_bias, and -inf outside allowed_token_ids
    prompt_mask: jax.Array  # bool: token occurs in the prompt (repetition penalty)
    output_counts: jax.Array  # int32: times generated so far (all penalties)
    stop_mask: jax.Array  # bool: EOS and stop ids, masked while below min_tokens
    # [rows, MAX_BAD_WORDS, MAX_BAD_WORD_TOKENS] int32: token sequences right-aligned, -1 before
    # them (a row of -1: no word).
    bad_words: jax.Array
    # [rows, MAX_BAD_WORD_TOKENS - 1] int32: the last output tokens (-1 where there are fewer).
    recent: jax.Array


@jax.tree_util.register_dataclass
@dataclass
class Logprobs:
    """Logprobs of chosen tokens (or logits, as the engine's logprobs mode says), plus the top
    `width` alternatives."""

    token_logprob: jax.Array  # [rows] float32
    token_rank: jax.Array  # [rows] int32, 1 = the most likely token
    top_ids: jax.Array  # [rows, width] int32
    top_logprobs: jax.Array  # [rows, width] float32


def init_state(num_rows: int, vocab_size: int) -> SamplerState:
    shape = (num_rows, vocab_size)
    return SamplerState(
        jnp.zeros(shape, jnp.float32), jnp.zeros(shape, bool), jnp.zeros(shape, jnp.int32), jnp.zeros(shape, bool),
        jnp.full((num_rows, MAX_BAD_WORDS, MAX_BAD_WORD_TOKENS), -1, jnp.int32),
        jnp.full((num_rows, MAX_BAD_WORD_TOKENS - 1), -1, jnp.int32),
    )


def state_row(request: Request, vocab_size: int) -> SamplerState:
    """A request's row of the state, on the host (numpy), written once when it gets its
    persistent row (`write_state_row`): the bias and allowed ids, its prompt and output so
    far (penalties), its stop ids (min_tokens) and bad words with the last outputs they
    are matched against."""
    params, outputs = request.params, request.output_token_ids
    bias = np.zeros(vocab_size, np.float32)
    if params.allowed_token_ids is not None:
        bias[:] = -np.inf
        bias[params.allowed_token_ids] = 0.0
    for token, value in (params.logit_bias or {}).items():
        bias[token] += value
    prompt_mask = np.zeros(vocab_size, bool)
    prompt_mask[request.prompt_token_ids] = True
    counts = np.bincount(np.asarray(outputs, np.int64), minlength=vocab_size).astype(np.int32)
    stop_mask = np.zeros(vocab_size, bool)
    # (a tokenizer's EOS may lie past the model's vocabulary: it can never be sampled)
    stop = [t for t in (*request.eos_token_ids, *params.stop_token_ids) if t < vocab_size]
    stop_mask[stop] = True
    bad_words = np.full((MAX_BAD_WORDS, MAX_BAD_WORD_TOKENS), -1, np.int32)
    for i, word in enumerate(request.bad_words_token_ids):
        bad_words[i, MAX_BAD_WORD_TOKENS - len(word):] = word
    recent = np.full(MAX_BAD_WORD_TOKENS - 1, -1, np.int32)
    tail = outputs[len(outputs) - min(len(outputs), MAX_BAD_WORD_TOKENS - 1):]
    recent[len(recent) - len(tail):] = tail
    return SamplerState(bias, prompt_mask, counts, stop_mask, bad_words, recent)


def write_state_row(state: SamplerState, slot, row: SamplerState) -> SamplerState:
    """Set one row from `row` (the fields of one row, unbatched; jit with the state donated)."""
    return jax.tree.map(lambda x, r: x.at[slot].set(r), state, row)


def ban_bad_words(logits, bad_words, recent):
    """vLLM's bad words: a word's last token gets -inf when the output so far ends with the
    rest of the word (always, for a one-token word). bad_words [S, W, L] right-aligned,
    -1 before a word (and -1 throughout for no word); recent [S, L - 1], the last outputs."""
    prefix, last = bad_words[:, :, :-1], bad_words[:, :, -1]
    match = jnp.all((prefix < 0) | (prefix == recent[:, None, :]), axis=-1) & (last >= 0)
    rows = jnp.broadcast_to(jnp.arange(logits.shape[0])[:, None], last.shape)
    ban = jnp.where(match, -jnp.inf, jnp.inf)  # min with +inf: no change
    return logits.at[rows, jnp.maximum(last, 0)].min(ban.astype(logits.dtype))


def apply_token_bitmask(logits, bitmask):
    """-inf where a row's bit is 0; bitmask int32 [S, ceil(vocab / 32)], token v at bit
    v % 32 of word v // 32 (llguidance's and xgrammar's packing)."""
    ids = jnp.arange(logits.shape[-1])
    allowed = (bitmask[:, ids // 32] >> (ids % 32)) & 1
    return jnp.where(allowed != 0, logits, -jnp.inf)


def apply_penalties(logits, prompt_mask, output_counts, presence, frequency, repetition):
    """vLLM's penalties: repetition (HF's formula) over prompt and output tokens, then
    frequency and presence over output tokens."""
    counts = output_counts.astype(logits.dtype)
    seen = prompt_mask | (output_counts > 0)
    rep = repetition[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    return logits - frequency[:, None] * counts - presence[:, None] * (output_counts > 0)


def _largest_true(pred, lo, hi, iters: int = 32):
    """Per row, bisect for the largest t in [lo, hi] with pred(t) (pred true below a threshold):
    over floats to within (hi - lo) / 2**iters, over unsigned ints exactly (32 steps span
    them all). Unrolled on accelerators: a loop would run from the host (XLA's GPU runtime
    launches each iteration), outside the step's CUDA graph; unrolled, its few fusions per
    iteration join the graph. A loop on CPU, where XLA runs loops itself and compiling 32
    copies of the body doubled the sampler's compile time."""
    exact = jnp.issubdtype(lo.dtype, jnp.unsignedinteger)

    def body(_, bounds):
        lo, hi = bounds
        if exact:  # (the upper middle: lo moves up whenever pred holds there)
            mid = lo + (hi - lo + 1) // 2
            ok = pred(mid)
            return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid - 1)
        mid = (lo + hi) / 2
        ok = pred(mid)
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)

    def bisect(lo, hi, unroll: bool):
        return jax.lax.fori_loop(0, iters, body, (lo, hi), unroll=unroll)[0]

    return jax.lax.platform_dependent(lo, hi, cpu=partial(bisect, unroll=False), default=partial(bisect, unroll=True))


def apply_top_k_top_p_min_p(logits, top_k, top_p, min_p, features: SamplerFeatures):
    """Mask (to -inf) what min_p, then top_k, then top_p exclude, as vLLM orders them.

    Each filter in `features` finds a per-row logit threshold (keep x >= threshold); one
    `where` then masks. min_p and top_k thresholds compose by max (top_k's k-th largest
    of the min_p survivors is the overall k-th, or min_p's own threshold when fewer than
    k survive); top_p reads the distribution left by both. Thresholds are found by
    bisection over values instead of a sort of the vocabulary (XLA's sort is the slow
    part otherwise) and snapped to an actual logit, so tokens tied with the last one
    kept are kept too. Rows with a filter off get a threshold of -inf from it.
    """
    threshold = jnp.full((logits.shape[0], 1), -jnp.inf, logits.dtype)
    if features.min_p:
        threshold = jnp.maximum(threshold, _min_p_threshold(logits, min_p))
    if features.top_k:
        threshold = jnp.maximum(threshold, _top_k_threshold(logits, top_k))
    if features.top_p:
        threshold = jnp.maximum(threshold, _top_p_threshold(logits, top_p, threshold))
    return jnp.where(logits < threshold, -jnp.inf, logits)


def _min_p_threshold(logits, min_p):
    """The smallest logit whose probability is >= min_p times the row's largest."""
    probs = jax.nn.softmax(logits, axis=-1)
    keep = probs >= min_p[:, None] * probs.max(-1, keepdims=True)
    return jnp.min(jnp.where(keep, logits, jnp.inf), axis=-1, keepdims=True)


def _top_k_threshold(logits, top_k):
    """The k-th largest value (k <= 0: all), exactly: bisected over the logits' float32 bits
    as order-preserving unsigned ints, so that a far outlier (a logit_bias of -1e9 that bans
    a token) cannot widen the steps past the gaps between the values that matter."""
    vocab = logits.shape[-1]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)[:, None]
    keys = _ordered_keys(logits.astype(jnp.float32))
    lo = jnp.min(jnp.where(jnp.isfinite(logits), keys, jnp.uint32(0xFFFFFFFF)), axis=-1, keepdims=True)
    hi = jnp.max(keys, axis=-1, keepdims=True)
    kth = _largest_true(lambda t: jnp.sum(keys >= t, axis=-1, keepdims=True) >= k, lo, hi)
    return jnp.min(jnp.where(keys >= kth, logits, jnp.inf), axis=-1, keepdims=True)


def _ordered_keys(x):
    """float32 -> uint32 in the same order: negative floats' bits flipped, positive ones'
    sign bit set."""
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    sign = jnp.uint32(0x80000000)
    return jnp.where(bits & sign, ~bits, bits | sign)


def _top_p_threshold(logits, top_p, below):
    """Keep a token when the mass of strictly more likely tokens is below p, in the
    distribution left after masking logits under `below` (the earlier filters)."""
    logits = jnp.where(logits < below, -jnp.inf, logits)
    probs = jax.nn.softmax(logits, axis=-1)
    p = top_p[:, None]
    mass_above = lambda t: jnp.sum(jnp.where(probs > t, probs, 0.0), axis=-1, keepdims=True)  # noqa: E731
    t = _largest_true(lambda t: mass_above(t) >= p, jnp.zeros_like(p), probs.max(-1, keepdims=True))
    cutoff = jnp.min(jnp.where(probs > t, logits, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(p >= 1.0, -jnp.inf, cutoff)


def compute_logprobs(logits: jax.Array, token_ids: jax.Array, width: int, normalize: bool = True) -> Logprobs:
    """Logprobs of `token_ids` [rows] under float32 `logits` [rows, vocab] (the logits
    themselves when not `normalize`), with ranks and the top `width` (at most the
    vocabulary; 0: no top-k, only the tokens' own logprobs and ranks). The whole
    log-softmax is never formed: each value is (logit - max) - log(sum(exp(logits - max))),
    `jax.nn.log_softmax`'s own arithmetic, for the few entries read."""
    top = jnp.max(logits, axis=-1, keepdims=True)
    lse = jnp.log(jnp.sum(jnp.exp(logits - top), axis=-1, keepdims=True)) if normalize else 0.0
    shift = top if normalize else 0.0
    token_logit = jnp.take_along_axis(logits, token_ids[:, None], axis=-1)
    token_lp = ((token_logit - shift) - lse)[:, 0]
    rank = jnp.sum(logits >= token_logit, axis=-1).astype(jnp.int32)  # (vLLM's: a tie counts as above)
    rows = logits.shape[0]
    if width == 0:
        return Logprobs(token_lp, rank, jnp.zeros((rows, 0), jnp.int32), jnp.zeros((rows, 0), jnp.float32))
    top_logits, top_ids = jax.lax.top_k(logits, min(width, logits.shape[-1]))
    return Logprobs(token_lp, rank, top_ids.astype(jnp.int32), (top_logits - shift) - lse)


def apply_state(logits, t: SamplingTensors, state: SamplerState, features: SamplerFeatures,
                counts: jax.Array | None = None, recent: jax.Array | None = None) -> jax.Array:
    """The transforms of rows that use the sampler state: logit bias and allowed ids, bad
    words, stop ids masked below min_tokens, penalties. `counts` [S, vocab] and `recent`
    [S, L - 1] replace the state's output counts and last outputs of each row (a verified
    position's, which count the drafts before it)."""
    use = t.use_state[:, None]
    x = logits + jnp.where(use, state.bias[t.slot], 0.0)
    if features.bad_words:  # (a row without state has none, whatever a request before it left in its slot)
        words = jnp.where(t.use_state[:, None, None], state.bad_words[t.slot], -1)
        x = ban_bad_words(x, words, state.recent[t.slot] if recent is None else recent)
    suppress = use & (t.output_index < t.min_tokens)[:, None] & state.stop_mask[t.slot]
    x = jnp.where(suppress, -jnp.inf, x)
    penalized = apply_penalties(
        x, state.prompt_mask[t.slot], state.output_counts[t.slot] if counts is None else counts,
        t.presence_penalty, t.frequency_penalty, t.repetition_penalty,
    )
    return jnp.where(use, penalized, x)


def is_random(t: SamplingTensors) -> jax.Array:
    """Rows that sample ([S] bool); top_k = 1 is greedy, ties included (thresholds by value
    would keep tied tokens)."""
    return (t.temperature > 0) & (t.top_k != 1)


def over_temperature(logits, t: SamplingTensors):
    """Each row's logits over its temperature (greedy rows: as they are)."""
    return logits / jnp.where(t.temperature > 0, t.temperature, 1.0)[:, None]


def random_logits(logits, t: SamplingTensors, features: SamplerFeatures):
    """The logits a random row draws from: temperature, then min-p, top-k and top-p."""
    return apply_top_k_top_p_min_p(over_temperature(logits, t), t.top_k, t.top_p, t.min_p, features)


def _first_reaching(cumulative: jax.Array, weights: jax.Array, target: jax.Array) -> jax.Array:
    """Along the last axis: the first entry of positive weight whose cumulative sum reaches
    `target`, or the last of positive weight when rounding leaves none (never an entry of
    weight 0: a token top-k, a grammar or a ban removed)."""
    positive = weights > 0
    reach = (cumulative >= target[..., None]) & positive
    last = weights.shape[-1] - 1 - jnp.argmax(positive[..., ::-1], axis=-1)
    return jnp.where(jnp.any(reach, axis=-1), jnp.argmax(reach, axis=-1), last).astype(jnp.int32)


def inverse_cdf_sample(x: jax.Array, u: jax.Array, block: int = 256) -> jax.Array:
    """A token of softmax(x) [S, vocab] per row, by inverse transform sampling: the first
    whose cumulative probability reaches u [S] in (0, 1] (id 0 where no token has any). The
    cumulative sum runs over block sums, then inside the one block it lands in: XLA makes a
    cumulative sum over the whole vocabulary a `reduce_window`, which XLA:CPU runs slowly."""
    rows, vocab = x.shape
    top = jnp.max(x, axis=-1, keepdims=True)
    weights = jnp.exp(x - jnp.where(jnp.isfinite(top), top, 0.0))
    blocks = jnp.pad(weights, ((0, 0), (0, -vocab % block))).reshape(rows, -1, block)
    sums = jnp.sum(blocks, axis=-1)
    cumulative = jnp.cumsum(sums, axis=-1)
    target = u * cumulative[:, -1]
    b = _first_reaching(cumulative, sums, target)
    before = jnp.where(b > 0, jnp.take_along_axis(cumulative, jnp.maximum(b - 1, 0)[:, None], axis=1)[:, 0], 0.0)
    inside = jnp.take_along_axis(blocks, b[:, None, None], axis=1)[:, 0]
    token = b * block + _first_reaching(before[:, None] + jnp.cumsum(inside, axis=-1), inside, target)
    return jnp.where(cumulative[:, -1] > 0, token, 0)  # (a row with every token masked: id 0, as vLLM's)


def draw(logits, t: SamplingTensors, features: SamplerFeatures):
    """(each row's token [S], the logits it was drawn from: the processed logprobs' source)
    from logits after the state's transforms: the argmax, or for random rows a draw keyed by
    (seed, output index).

    A random row's draw takes one uniform number (`inverse_cdf_sample`), where Gumbel-max
    takes one a token; and one number a position lets speculative decoding draw at each
    verified position what sampling without drafts would (`rejection_sampler`)."""
    sampled = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # ties -> lowest id, as torch.argmax
    # top_k = 1 under a temperature draws the argmax, but its processed logits are vLLM's
    # (which samples the row): the top token's over the temperature, the others -inf.
    top_1 = jnp.where(logits >= jnp.max(logits, axis=-1, keepdims=True), over_temperature(logits, t), -jnp.inf)
    processed = jnp.where(((t.temperature > 0) & (t.top_k == 1))[:, None], top_1, logits)
    if not features.random:
        return sampled, processed
    x = random_logits(logits, t, features)

    def row_uniform(seed, index):
        return jax.random.uniform(jax.random.fold_in(jax.random.key(seed), index), (), jnp.float32)

    u = 1.0 - jax.vmap(row_uniform)(t.seeds, t.output_index)  # (0, 1]
    rows = is_random(t)
    return jnp.where(rows, inverse_cdf_sample(x, u), sampled), jnp.where(rows[:, None], x, processed)


def record_outputs(state: SamplerState, t: SamplingTensors, tokens: jax.Array, num: jax.Array,
                   features: SamplerFeatures) -> SamplerState:
    """The state after each counted row (`counts_sample` and `use_state`) got the first
    num[i] of its `tokens` [S, n]: their output counts, and the last outputs bad words match."""
    counted = t.use_state & t.counts_sample
    new = (jnp.arange(tokens.shape[1]) < num[:, None]) & counted[:, None]
    rows = jnp.broadcast_to(t.slot[:, None], tokens.shape)
    counts = state.output_counts.at[rows, tokens].add(new.astype(jnp.int32), mode="drop")
    recent = state.recent
    if features.bad_words:
        width = recent.shape[1]
        history = jnp.concatenate([recent[t.slot], tokens], axis=1)  # the last outputs, then the new ones
        shifted = jnp.take_along_axis(history, num[:, None] + jnp.arange(width), axis=1)
        recent = recent.at[jnp.where(counted, t.slot, recent.shape[0])].set(shifted, mode="drop")  # others: dropped
    return SamplerState(state.bias, state.prompt_mask, counts, state.stop_mask, state.bad_words, recent)


def sample(
    logits: jax.Array, t: SamplingTensors, state: SamplerState | None, features: SamplerFeatures,
    logprobs_mode: str = "raw_logprobs", bitmask: jax.Array | None = None,
) -> tuple[jax.Array, Logprobs | None, SamplerState | None]:
    """Token ids [S] from float32 logits [S, vocab]; logprobs when `features.logprobs`, as
    `logprobs_mode` says; the new state when `features.state` (else `state` is unused).
    With `features.grammar`, the structured-output `bitmask` masks the logits first (as
    vLLM, before the sampler: raw logprobs are of the masked logits)."""
    if features.grammar:
        logits = apply_token_bitmask(logits, bitmask)
    raw = logits
    if features.state:
        logits = apply_state(logits, t, state, features)
    sampled, processed = draw(logits, t, features)
    if features.state:
        state = record_outputs(state, t, sampled[:, None], jnp.ones_like(sampled), features)
    logprobs = None
    if features.logprobs:
        source = raw if logprobs_mode.startswith("raw") else processed
        logprobs = compute_logprobs(source, sampled, features.logprobs, normalize=logprobs_mode.endswith("logprobs"))
    return sampled, logprobs, state

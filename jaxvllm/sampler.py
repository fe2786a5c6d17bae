"""On-device sampling for the whole batch inside the jitted step.

Randomness is per request: the key of a row is fold_in(key(seed), output_index), so a
request's tokens depend only on its own seed and position, never on which other
requests share the batch, their order, or a preemption in between.

Per-request state that is as wide as the vocabulary (logit bias / allowed tokens,
prompt tokens and output counts for penalties, stop ids masked by min_tokens) lives on
the device in `SamplerState`, one row per slot: the host writes a row once when a
request is admitted (`write_state_row`) and the step counts each sampled token, so no
vocabulary-sized array crosses to the device per step. Each optional stage sits under a
`lax.cond` on "does any row use it", so a plain batch pays for none of them.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jaxvllm.sampling_params import MAX_LOGPROBS


@jax.tree_util.register_dataclass
@dataclass
class SamplingTensors:
    """Per-row parameters, [S] each. Padding rows are greedy and use no state."""

    temperature: jax.Array  # float32; 0 = greedy
    top_k: jax.Array  # int32; <= 0 = off
    top_p: jax.Array  # float32
    min_p: jax.Array  # float32
    presence_penalty: jax.Array  # float32
    frequency_penalty: jax.Array  # float32
    repetition_penalty: jax.Array  # float32
    seeds: jax.Array  # uint32
    output_index: jax.Array  # int32: tokens generated so far
    slot: jax.Array  # int32: the request's SamplerState row
    use_state: jax.Array  # bool: bias / penalties / min_tokens apply
    suppress_stop: jax.Array  # bool: below min_tokens, stop ids are masked
    counts_sample: jax.Array  # bool: the sample is appended to the request (update its counts)
    want_logprobs: jax.Array  # bool


@jax.tree_util.register_dataclass
@dataclass
class SamplerState:
    """[slots, vocab] rows of per-request sampling state (donated, updated in place)."""

    bias: jax.Array  # float32: logit_bias, and -inf outside allowed_token_ids
    prompt_mask: jax.Array  # bool: token occurs in the prompt (repetition penalty)
    output_counts: jax.Array  # int32: times generated so far (all penalties)
    stop_mask: jax.Array  # bool: EOS and stop ids, masked while below min_tokens


@jax.tree_util.register_dataclass
@dataclass
class Logprobs:
    """Logprobs (of the raw logits) of chosen tokens, plus the top MAX_LOGPROBS alternatives."""

    token_logprob: jax.Array  # [rows] float32
    token_rank: jax.Array  # [rows] int32, 1 = the most likely token
    top_ids: jax.Array  # [rows, MAX_LOGPROBS] int32
    top_logprobs: jax.Array  # [rows, MAX_LOGPROBS] float32


def init_state(num_slots: int, vocab_size: int) -> SamplerState:
    shape = (num_slots, vocab_size)
    return SamplerState(
        jnp.zeros(shape, jnp.float32), jnp.zeros(shape, bool), jnp.zeros(shape, jnp.int32), jnp.zeros(shape, bool)
    )


def write_state_row(state: SamplerState, slot, bias, prompt_mask, output_counts, stop_mask) -> SamplerState:
    """Set one slot's rows (jit with the state donated)."""
    return SamplerState(
        state.bias.at[slot].set(bias),
        state.prompt_mask.at[slot].set(prompt_mask),
        state.output_counts.at[slot].set(output_counts),
        state.stop_mask.at[slot].set(stop_mask),
    )


def apply_penalties(logits, prompt_mask, output_counts, presence, frequency, repetition):
    """vLLM's penalties: repetition (HF's formula) over prompt and output tokens, then
    frequency and presence over output tokens."""
    counts = output_counts.astype(logits.dtype)
    seen = prompt_mask | (output_counts > 0)
    rep = repetition[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    return logits - frequency[:, None] * counts - presence[:, None] * (output_counts > 0)


def _largest_true(pred, lo, hi, iters: int = 32):
    """Per row, bisect for the largest t in [lo, hi] with pred(t) (pred true below a threshold)."""

    def body(_, bounds):
        lo, hi = bounds
        mid = (lo + hi) / 2
        ok = pred(mid)
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)

    return jax.lax.fori_loop(0, iters, body, (lo, hi))[0]


def apply_top_k_top_p_min_p(logits, top_k, top_p, min_p):
    """Mask (to -inf) what min_p, then top_k, then top_p exclude, as vLLM orders them.

    Each filter finds a per-row logit threshold (keep x >= threshold) under `lax.cond`,
    skipped when no row uses it; one `where` then masks. The skipped branch hands back a
    [rows, 1] -inf, not the logits: XLA copies whatever a cond branch passes through, and
    a [rows, vocab] copy per filter cost more than the mask. min_p and top_k thresholds
    compose by max (top_k's k-th largest of the min_p survivors is the overall k-th, or
    min_p's own threshold when fewer than k survive); top_p reads the distribution left
    by both. Thresholds are found by bisection over values instead of a sort of the
    vocabulary (XLA's sort is the slow part otherwise) and snapped to an actual logit,
    so tokens tied with the last one kept are kept too.
    """
    none = jnp.full((logits.shape[0], 1), -jnp.inf, logits.dtype)
    skip = lambda *_: none  # noqa: E731
    threshold = jax.lax.cond(jnp.any(min_p > 0), _min_p_threshold, skip, logits, min_p)
    threshold = jnp.maximum(threshold, jax.lax.cond(jnp.any(top_k > 0), _top_k_threshold, skip, logits, top_k))
    threshold = jnp.maximum(
        threshold, jax.lax.cond(jnp.any(top_p < 1), _top_p_threshold, skip, logits, top_p, threshold)
    )
    return jnp.where(logits < threshold, -jnp.inf, logits)


def _min_p_threshold(logits, min_p):
    """The smallest logit whose probability is >= min_p times the row's largest."""
    probs = jax.nn.softmax(logits, axis=-1)
    keep = probs >= min_p[:, None] * probs.max(-1, keepdims=True)
    return jnp.min(jnp.where(keep, logits, jnp.inf), axis=-1, keepdims=True)


def _top_k_threshold(logits, top_k):
    """The k-th largest value (k <= 0: all)."""
    vocab = logits.shape[-1]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)[:, None]
    lo = jnp.min(jnp.where(jnp.isfinite(logits), logits, jnp.inf), axis=-1, keepdims=True)
    hi = jnp.max(logits, axis=-1, keepdims=True)
    kth = _largest_true(lambda t: jnp.sum(logits >= t, axis=-1, keepdims=True) >= k, lo, hi)
    return jnp.min(jnp.where(logits >= kth, logits, jnp.inf), axis=-1, keepdims=True)


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


def compute_logprobs(logits: jax.Array, token_ids: jax.Array) -> Logprobs:
    """Logprobs of `token_ids` [rows] under float32 `logits` [rows, vocab], with ranks and the top ones."""
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    token_lp = jnp.take_along_axis(logprobs, token_ids[:, None], axis=-1)[:, 0]
    rank = jnp.sum(logprobs > token_lp[:, None], axis=-1).astype(jnp.int32) + 1
    top_lp, top_ids = jax.lax.top_k(logprobs, min(MAX_LOGPROBS, logits.shape[-1]))
    pad = MAX_LOGPROBS - top_ids.shape[-1]
    if pad:  # a vocabulary smaller than MAX_LOGPROBS (tiny test models)
        top_ids = jnp.pad(top_ids, ((0, 0), (0, pad)))
        top_lp = jnp.pad(top_lp, ((0, 0), (0, pad)), constant_values=-jnp.inf)
    return Logprobs(token_lp, rank, top_ids.astype(jnp.int32), top_lp)


def empty_logprobs(rows: int) -> Logprobs:
    return Logprobs(
        jnp.zeros(rows, jnp.float32), jnp.zeros(rows, jnp.int32),
        jnp.zeros((rows, MAX_LOGPROBS), jnp.int32), jnp.zeros((rows, MAX_LOGPROBS), jnp.float32),
    )


def sample(
    logits: jax.Array, t: SamplingTensors, state: SamplerState
) -> tuple[jax.Array, Logprobs, SamplerState]:
    """Token ids [S] from float32 logits [S, vocab]; logprobs of the raw logits; new state."""
    raw = logits
    use = t.use_state[:, None]

    def with_state(x):
        x = x + jnp.where(use, state.bias[t.slot], 0.0)
        x = jnp.where(use & t.suppress_stop[:, None] & state.stop_mask[t.slot], -jnp.inf, x)
        penalized = apply_penalties(
            x, state.prompt_mask[t.slot], state.output_counts[t.slot],
            t.presence_penalty, t.frequency_penalty, t.repetition_penalty,
        )
        return jnp.where(use, penalized, x)

    logits = jax.lax.cond(jnp.any(t.use_state), with_state, lambda x: x, logits)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # ties -> lowest id, as torch.argmax

    def random(x):
        temperature = jnp.where(t.temperature > 0, t.temperature, 1.0)[:, None]
        x = x / temperature
        x = apply_top_k_top_p_min_p(x, t.top_k, t.top_p, t.min_p)

        def row_gumbel(seed, index):
            key = jax.random.fold_in(jax.random.key(seed), index)
            return jax.random.gumbel(key, (x.shape[-1],), jnp.float32)

        gumbel = jax.vmap(row_gumbel)(t.seeds, t.output_index)
        # Gumbel-max: argmax(x + G) is a sample of softmax(x).
        sampled = jnp.argmax(x + gumbel, axis=-1).astype(jnp.int32)
        # top_k = 1 is greedy, ties included (thresholds by value would keep tied tokens).
        return jnp.where((t.temperature > 0) & (t.top_k != 1), sampled, greedy)

    sampled = jax.lax.cond(jnp.any(t.temperature > 0), random, lambda x: greedy, logits)

    counts = state.output_counts.at[t.slot, sampled].add((t.use_state & t.counts_sample).astype(jnp.int32))
    state = SamplerState(state.bias, state.prompt_mask, counts, state.stop_mask)
    logprobs = jax.lax.cond(
        jnp.any(t.want_logprobs), lambda: compute_logprobs(raw, sampled), lambda: empty_logprobs(raw.shape[0])
    )
    return sampled, logprobs, state

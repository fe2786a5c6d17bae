"""The device sampler on fixed logits: exact distributions, penalties vs transformers, masks, logprobs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxvllm.sampler import (
    SamplerFeatures,
    SamplerState,
    SamplingTensors,
    apply_penalties,
    init_state,
    inverse_cdf_sample,
    sample,
    write_state_row,
)

V = 12
LOGITS = np.array([2.0, 1.5, 1.2, 1.0, 0.7, 0.5, 0.2, 0.0, -0.3, -0.8, -1.5, -3.0], np.float32)
N = 20_000


def tensors(n, *, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, presence=0.0, frequency=0.0, repetition=1.0,
            seeds=None, use_state=False, min_tokens=0, want_logprobs=False, output_index=0):
    full = lambda v, dt: np.full(n, v, dt)  # noqa: E731
    return SamplingTensors(
        temperature=full(temperature, np.float32), top_k=full(top_k, np.int32), top_p=full(top_p, np.float32),
        min_p=full(min_p, np.float32), presence_penalty=full(presence, np.float32),
        frequency_penalty=full(frequency, np.float32), repetition_penalty=full(repetition, np.float32),
        seeds=np.arange(n, dtype=np.uint32) if seeds is None else np.asarray(seeds, np.uint32),
        output_index=full(output_index, np.int32), slot=np.zeros(n, np.int32), use_state=full(use_state, bool),
        min_tokens=full(min_tokens, np.int32), counts_sample=full(True, bool), want_logprobs=full(want_logprobs, bool),
    )


_sample = jax.jit(sample, static_argnames="features")


def sample_jit(logits, t, state):
    """The sampler variant the runner would pick for these (all sampling) rows."""
    return _sample(logits, t, state, features=SamplerFeatures.of(t, np.ones(len(t.temperature), bool)))


def test_features_follow_the_rows_that_sample():
    t = tensors(3, temperature=0.0)
    rows = np.array([True, True, False])
    assert SamplerFeatures.of(t, rows) == SamplerFeatures()
    t.temperature[2], t.top_p[2], t.want_logprobs[2] = 1.0, 0.5, True  # a row that does not sample
    assert SamplerFeatures.of(t, rows) == SamplerFeatures()
    t.temperature[0], t.top_k[0] = 0.7, 1  # top_k = 1 is greedy
    assert SamplerFeatures.of(t, rows) == SamplerFeatures()
    t.top_k[0], t.min_p[1], t.use_state[1] = 5, 0.1, True  # min_p of a greedy row: not needed
    assert SamplerFeatures.of(t, rows) == SamplerFeatures(random=True, top_k=True, state=True)
    assert SamplerFeatures.of(t, rows).name == "random+top_k+state"


def test_compiled_variants_have_no_conditionals_and_static_loops():
    """Every choice is made on the host: no `conditional` (on XLA:GPU its predicate is
    copied to the host, stalling the stream) and only loops of known trip count (on CPU,
    jax.random's; the GPU compile has none, which `jaxvllm.benchmarks.aot_engine` checks:
    a loop there would run outside the step's CUDA graph)."""
    everything = SamplerFeatures(random=True, min_p=True, top_k=True, top_p=True, state=True, bad_words=True, logprobs=20)
    for features in (SamplerFeatures(), everything):
        hlo = _sample.lower(np.zeros((4, V), np.float32), tensors(4), init_state(4, V), features=features)
        text = hlo.compile().as_text()
        assert " conditional(" not in text
        for line in text.splitlines():
            if " while(" in line:
                assert "known_trip_count" in line, line


def exact(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    """The distribution the sampler must draw from: temperature, then min_p, top_k, top_p (vLLM's order)."""
    x = LOGITS.astype(np.float64) / temperature
    p = np.exp(x - x.max())
    p /= p.sum()
    keep = p >= min_p * p.max()
    if top_k > 0:
        keep &= x >= np.sort(x[keep])[::-1][min(top_k, keep.sum()) - 1]
    q = np.where(keep, p, 0) / np.where(keep, p, 0).sum()
    order = np.argsort(-q, kind="stable")
    mass_before = np.cumsum(q[order]) - q[order]
    kept = order[mass_before < top_p]
    out = np.zeros(V)
    out[kept] = q[kept]
    return out / out.sum()


@pytest.mark.parametrize(
    "settings",
    [dict(temperature=1.0), dict(temperature=0.5), dict(top_k=3), dict(top_p=0.6), dict(min_p=0.3),
     dict(temperature=1.7, top_k=6, top_p=0.8, min_p=0.05)],
)
def test_empirical_distribution_matches_exact(settings):
    """L1 distance bound by Bretagnolle-Huber-Carol: P(|p_hat - p|_1 >= eps) <= 2^V exp(-N eps^2 / 2).

    With V = 12 and N = 20000, eps = 0.047 gives a false-failure probability below 1e-6.
    """
    logits = np.broadcast_to(LOGITS, (N, V))
    state = init_state(1, V)
    sampled, _, _ = sample_jit(logits, tensors(N, **settings), state)
    counts = np.bincount(np.asarray(sampled), minlength=V)
    want = exact(**settings)
    eps = np.sqrt(2 * (V * np.log(2) + np.log(1e6)) / N)
    assert eps < 0.048
    assert np.abs(counts / N - want).sum() < eps, (counts / N, want)
    assert np.all(counts[want == 0] == 0), "a filtered-out token was sampled"


@pytest.mark.parametrize("vocab,block", [(1000, 256), (1000, 16), (64, 256)])
def test_inverse_cdf_sample_over_blocks(vocab, block):
    """The two-level draw (block sums, then inside one block) is softmax's inverse CDF over a
    vocabulary of several blocks, the last one partial: N evenly spaced u give each token
    its probability's share of them, to 1 / N; and it never draws a masked token, not where
    a whole block is masked, nor at the ends (u = 1, u near 0)."""
    rng = np.random.default_rng(0)
    x = rng.normal(0, 2, vocab).astype(np.float32)
    x[rng.random(vocab) < 0.3] = -np.inf
    x[: block if vocab > 2 * block else 3] = -np.inf  # the first block (or tokens), all masked
    x[-1] = -np.inf
    p = np.where(np.isfinite(x), np.exp(x.astype(np.float64) - x[np.isfinite(x)].max()), 0.0)
    p /= p.sum()
    u = (np.arange(N) + 0.5) / N
    tokens = np.asarray(jax.jit(inverse_cdf_sample, static_argnames="block")(
        jnp.broadcast_to(x, (N, vocab)), jnp.asarray(u, jnp.float32), block=block))
    assert np.all(p[tokens] > 0), "a masked token was drawn"
    assert np.abs(np.bincount(tokens, minlength=vocab) / N - p).max() <= 2 / N
    ends = np.asarray(inverse_cdf_sample(jnp.asarray(np.stack([x, x])), jnp.asarray([1.0, 1e-30]), block=block))
    assert ends.tolist() == [np.flatnonzero(p)[-1], np.flatnonzero(p)[0]]
    # A row with every token masked (bans that cover each other): id 0, as vLLM's, never one
    # past the vocabulary (the padding of a partial last block).
    masked = np.full((2, vocab), -np.inf, np.float32)
    assert np.asarray(inverse_cdf_sample(jnp.asarray(masked), jnp.asarray([1.0, 0.5]), block=block)).tolist() == [0, 0]


def test_greedy_top_k_1_and_seeds():
    logits = np.broadcast_to(LOGITS, (64, V)).copy()
    logits[:, 5] = LOGITS[0]  # a tie with token 0: argmax takes the lowest id, as torch does
    state = init_state(1, V)
    greedy, _, _ = sample_jit(logits, tensors(64, temperature=0.0), state)
    assert (np.asarray(greedy) == 0).all()
    topk1, _, _ = sample_jit(logits, tensors(64, temperature=1.3, top_k=1), state)
    assert (np.asarray(topk1) == 0).all()
    a, _, _ = sample_jit(logits, tensors(64, seeds=[7] * 64), state)
    assert len(set(np.asarray(a).tolist())) == 1  # the same seed and position -> the same token
    b, _, _ = sample_jit(logits, tensors(64, seeds=[7] * 64, output_index=1), state)
    mixed_seeds, _, _ = sample_jit(logits, tensors(64), state)
    assert len(set(np.asarray(mixed_seeds).tolist())) > 1
    assert int(a[0]) == int(sample_jit(logits[:1], tensors(1, seeds=[7]), state)[0][0])  # batch-independent
    del b


def test_penalties_match_transformers():
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2, V)).astype(np.float32) * 3
    prompt = [[1, 4, 4], [0, 2]]
    output = [[4, 7, 7, 7], [2, 9]]
    prompt_mask = np.zeros((2, V), bool)
    counts = np.zeros((2, V), np.int32)
    for r in range(2):
        prompt_mask[r, prompt[r]] = True
        np.add.at(counts[r], output[r], 1)
    rep = np.array([1.3, 0.8], np.float32)
    got = apply_penalties(jnp.asarray(logits), prompt_mask, counts, np.zeros(2, np.float32), np.zeros(2, np.float32), rep)
    for r in range(2):
        hf = RepetitionPenaltyLogitsProcessor(float(rep[r]))(torch.tensor([prompt[r] + output[r]]),
                                                             torch.tensor(logits[r : r + 1]))
        np.testing.assert_allclose(got[r], hf[0].numpy(), rtol=1e-6)
    presence, frequency = np.array([0.5, -1.0], np.float32), np.array([0.25, 1.5], np.float32)
    got = apply_penalties(jnp.asarray(logits), prompt_mask, counts, presence, frequency, np.ones(2, np.float32))
    want = logits - frequency[:, None] * counts - presence[:, None] * (counts > 0)  # vLLM's / OpenAI's formula
    np.testing.assert_allclose(got, want, rtol=1e-6)


def state_with_row(bias=None, prompt=(), outputs=(), stop=()):
    state = init_state(2, V)
    bias = np.zeros(V, np.float32) if bias is None else bias
    prompt_mask = np.zeros(V, bool)
    prompt_mask[list(prompt)] = True
    counts = np.bincount(np.asarray(outputs, np.int64), minlength=V).astype(np.int32)
    stop_mask = np.zeros(V, bool)
    stop_mask[list(stop)] = True
    row = jax.tree.map(lambda x: x[0], state)
    row = SamplerState(bias, prompt_mask, counts, stop_mask, row.bad_words, row.recent)
    return write_state_row(state, 1, row)


def test_state_rows_bias_allowed_min_tokens_and_counts():
    logits = np.broadcast_to(LOGITS, (2, V)).copy()
    t = tensors(2, temperature=0.0, use_state=True)
    t.slot[:] = 1
    bias = np.zeros(V, np.float32)
    bias[9] = 10.0
    sampled, _, state = sample_jit(logits, t, state_with_row(bias=bias))
    assert np.asarray(sampled).tolist() == [9, 9]
    assert int(state.output_counts[1, 9]) == 2  # the step counts what it sampled
    allowed = np.full(V, -np.inf, np.float32)
    allowed[[3, 6]] = 0.0
    assert np.asarray(sample_jit(logits, t, state_with_row(bias=allowed))[0]).tolist() == [3, 3]
    t.min_tokens[:] = 1  # below min_tokens: the stop ids (0 = EOS here) are masked
    assert np.asarray(sample_jit(logits, t, state_with_row(stop=[0, 1]))[0]).tolist() == [2, 2]
    t.min_tokens[:] = 0
    assert np.asarray(sample_jit(logits, t, state_with_row(stop=[0, 1]))[0]).tolist() == [0, 0]
    t.repetition_penalty[:] = 2.0  # token 0 seen in the prompt: 2.0 / 2 = 1.0 < 1.5
    assert np.asarray(sample_jit(logits, t, state_with_row(prompt=[0]))[0]).tolist() == [1, 1]
    t.use_state[0] = False  # a row without state is untouched
    assert np.asarray(sample_jit(logits, t, state_with_row(prompt=[0]))[0]).tolist() == [0, 1]


def test_logprobs_are_of_raw_logits_with_ranks():
    logits = np.broadcast_to(LOGITS, (3, V)).copy()
    t = tensors(3, temperature=0.0, want_logprobs=True, use_state=True)
    t.slot[:] = 1
    bias = np.zeros(V, np.float32)
    bias[4] = 100.0  # changes the choice, not the reported logprobs
    sampled, lp, _ = sample_jit(logits, t, state_with_row(bias=bias))
    raw = np.asarray(jax.nn.log_softmax(jnp.asarray(LOGITS)))
    assert np.asarray(sampled).tolist() == [4, 4, 4]
    np.testing.assert_allclose(lp.token_logprob, raw[4], rtol=1e-6)
    assert np.asarray(lp.token_rank).tolist() == [5, 5, 5]
    np.testing.assert_array_equal(lp.top_ids[0, :V], np.argsort(-LOGITS, kind="stable"))
    np.testing.assert_allclose(lp.top_logprobs[0, :V], np.sort(raw)[::-1], rtol=1e-6)
    _, none, _ = sample_jit(logits, tensors(3, temperature=0.0), state_with_row())
    assert none is None  # not computed when no row asks


def test_state_row_of_a_request_whose_eos_lies_past_the_vocabulary():
    """A tokenizer's EOS may lie past the model's vocabulary (it can never be sampled): a
    request's state row masks the stop ids the model has, and indexes nothing past it."""
    from jaxvllm.request import Request
    from jaxvllm.sampler import state_row
    from jaxvllm.sampling_params import SamplingParams

    params = SamplingParams(min_tokens=2, stop_token_ids=[5], logit_bias={1: 2.0})
    request = Request("r", [1, 2, 2], params, max_tokens=4, eos_token_ids=(3, 10), vocab_size=8)
    row = state_row(request, 8)
    np.testing.assert_array_equal(np.flatnonzero(row.stop_mask), [3, 5])
    np.testing.assert_array_equal(np.flatnonzero(row.prompt_mask), [1, 2])
    assert row.bias[1] == 2.0 and row.bias.shape == (8,)


@pytest.mark.parametrize("shift", [0.0, -1e6, -1e9, -1e12, -1e30, -3.4e38])
def test_top_k_keeps_exactly_k_beside_a_far_outlier(shift):
    """A logit_bias of -1e9 that bans a token once widened top_k's bisection steps past the
    gaps between the real logits, and kept 11 (or 999) tokens instead of 10."""
    from jaxvllm.sampler import apply_top_k_top_p_min_p

    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, 1000)).astype(np.float32)
    logits[:, 7] += shift
    logits[2, 100:] = -np.inf  # (a row with masked tokens too)
    top_k = np.array([10, 1, 999], np.int32)
    kept = apply_top_k_top_p_min_p(jnp.asarray(logits), jnp.asarray(top_k), jnp.ones(3, jnp.float32),
                                   jnp.zeros(3, jnp.float32), SamplerFeatures(random=True, top_k=True))
    kept = np.isfinite(np.asarray(kept))
    assert kept.sum(axis=1).tolist() == [10, 1, 100]
    for row, k in enumerate(top_k.tolist()):
        want = np.argsort(-logits[row], kind="stable")[: min(k, np.isfinite(logits[row]).sum())]
        assert set(np.flatnonzero(kept[row])) == set(want.tolist())


def test_ranks_count_ties_as_above_and_the_top_k_place_wins():
    """vLLM's rank is the count of logits >= the token's (a tie counts as above); in the
    logprob dict a chosen token among the top k takes its place's rank there."""
    from jaxvllm.output_processor import OutputProcessor, _as_lists
    from jaxvllm.sampler import compute_logprobs

    logits = jnp.asarray([[1.0, 3.0, 3.0, 2.0]])
    lp = compute_logprobs(logits, jnp.asarray([2]), width=2)
    assert int(lp.token_rank[0]) == 2 and np.asarray(lp.top_ids)[0].tolist() == [1, 2]
    host = _as_lists(jax.tree.map(np.asarray, lp))  # (as a step's result holds them)
    entry = OutputProcessor(None)._logprob_dict(2, host, 0, 2, detokenize=False)
    assert list(entry) == [2, 1] and entry[2].rank == 2 and entry[1].rank == 1
    assert all(type(t) is int and type(e.logprob) is float for t, e in entry.items())
    entry = OutputProcessor(None)._logprob_dict(2, host, 0, 0, detokenize=False)
    assert entry[2].rank == 2
    assert int(compute_logprobs(logits, jnp.asarray([3]), width=0).token_rank[0]) == 3


def test_a_row_without_state_ignores_bad_words_its_slot_held_before():
    """A request without sampler state is not written to its slot on admission: the bad
    words a finished or preempted request left there once banned its tokens too."""
    state = state_with_row()
    words = np.full(state.bad_words.shape[1:], -1, np.int32)
    words[0, -1] = 0  # the old request banned token 0, the argmax
    row = jax.tree.map(lambda x: np.asarray(x[1]), state)
    state = write_state_row(state, 1, SamplerState(row.bias, row.prompt_mask, row.output_counts, row.stop_mask,
                                                   words, row.recent))
    logits = np.broadcast_to(LOGITS, (2, V)).copy()
    t = tensors(2, temperature=0.0)
    t.slot[:] = 1
    t.use_state[0] = True  # row 0 is the old request's kind, row 1 a request without state in the same slot
    features = SamplerFeatures(state=True, bad_words=True)
    sampled, _, _ = _sample(logits, t, state, features=features)
    assert np.asarray(sampled).tolist() == [1, 0]

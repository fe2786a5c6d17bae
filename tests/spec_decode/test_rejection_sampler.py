"""The rejection sampler keeps the target's distribution, as vLLM's tests check it: over
many seeded draws on fixed target logits and a fixed (one-hot, n-gram) draft, the emitted
tokens follow the target's distribution after its transforms, at the verified position and
at the bonus one. A recovery that forgot to mask the rejected draft fails the bound."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxvllm.sampler import SamplerFeatures, SamplingTensors, sample
from jaxvllm.spec_decode.rejection_sampler import num_accepted, sample_with_drafts

DRAWS = 20_000
VOCAB = 8


def tensors(rows: int, temperature: float = 1.0, top_k: int = 0, seed0: int = 0) -> SamplingTensors:
    full = lambda value, dtype: jnp.full(rows, value, dtype)  # noqa: E731
    return SamplingTensors(
        temperature=full(temperature, jnp.float32), top_k=full(top_k, jnp.int32), top_p=full(1.0, jnp.float32),
        min_p=full(0.0, jnp.float32), presence_penalty=full(0.0, jnp.float32),
        frequency_penalty=full(0.0, jnp.float32), repetition_penalty=full(1.0, jnp.float32),
        seeds=jnp.arange(seed0, seed0 + rows, dtype=jnp.uint32), use_state=full(False, bool),
        output_index=full(5, jnp.int32), slot=full(0, jnp.int32), suppress_stop=full(False, bool),
        counts_sample=full(True, bool), want_logprobs=full(False, bool),
    )


def target(temperature: float = 1.0, top_k: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Logits at two positions and the distribution each gives after the transforms."""
    logits = np.log(np.array([[0.4, 0.2, 0.15, 0.1, 0.08, 0.04, 0.02, 0.01],
                              [0.05, 0.05, 0.1, 0.3, 0.3, 0.1, 0.05, 0.05]], np.float32))
    probs = []
    for row in logits / temperature:
        keep = row >= np.sort(row)[-top_k] if top_k else np.ones_like(row, bool)
        p = np.where(keep, np.exp(row - row.max()), 0.0)
        probs.append(p / p.sum())
    return logits, probs[0], probs[1]


def frequencies(tokens: np.ndarray) -> np.ndarray:
    return np.bincount(tokens, minlength=VOCAB) / max(1, len(tokens))


@pytest.mark.parametrize("draft,temperature,top_k", [(0, 1.0, 0), (3, 1.0, 0), (1, 0.7, 4), (6, 1.0, 4)])
def test_emitted_tokens_follow_the_target(draft, temperature, top_k):
    logits, p0, p1 = target(temperature, top_k)
    features = SamplerFeatures(random=True, top_k=bool(top_k))
    rows = jnp.asarray(np.broadcast_to(logits, (DRAWS, 2, VOCAB)).reshape(-1, VOCAB))
    drafts, counts = jnp.full((DRAWS, 1), draft, jnp.int32), jnp.ones(DRAWS, jnp.int32)
    starts = 2 * jnp.arange(DRAWS, dtype=jnp.int32)
    sampled, accepted, _, _ = sample_with_drafts(rows, tensors(DRAWS, temperature, top_k), None, features, drafts,
                                                 counts, starts)
    sampled, accepted = np.asarray(sampled), np.asarray(accepted)
    first = np.where(accepted == 1, draft, sampled)  # the token emitted at the verified position
    assert np.abs(frequencies(first) - p0).sum() / 2 < 0.02  # total variation
    assert abs(accepted.mean() - p0[draft]) < 0.02  # accepted with probability p(draft)
    if accepted.sum() > 500:  # the bonus token, after an accepted draft: from position 1
        assert np.abs(frequencies(sampled[accepted == 1]) - p1).sum() / 2 < 0.05
    # Recovery without masking the rejected draft would emit it too often.
    unmasked = np.asarray(sample(rows.reshape(DRAWS, 2, VOCAB)[:, 0], tensors(DRAWS, temperature, top_k), None,
                                 features)[0])
    wrong = np.where(accepted == 1, draft, unmasked)
    if p0[draft] > 0.05:
        assert np.abs(frequencies(wrong) - p0).sum() / 2 > 0.03


def test_greedy_rows_accept_the_argmax_prefix():
    """Greedy rows accept drafts while each is the argmax, then sample the argmax after
    them; padding drafts past a row's count are never accepted. Each row's logits rows
    follow one another (4, 4 and 2 of them here), as the batch builder lays them out."""
    argmax = np.array([2, 5, 1, 7, 2, 5, 1, 7, 4, 6])
    logits = np.full((len(argmax), VOCAB), -1.0, np.float32)
    logits[np.arange(len(argmax)), argmax] = 3.0
    drafts = jnp.asarray([[2, 5, 0], [2, 5, 1], [4, 4, 4]], jnp.int32)
    counts, starts = jnp.asarray([3, 3, 1], jnp.int32), jnp.asarray([0, 4, 8], jnp.int32)
    t = tensors(3, temperature=0.0)
    got = num_accepted(jnp.asarray(logits), t, drafts, counts, starts, SamplerFeatures())
    assert np.asarray(got).tolist() == [2, 3, 1]
    sampled, accepted, _, _ = sample_with_drafts(jnp.asarray(logits), t, None, SamplerFeatures(), drafts, counts,
                                                 starts)
    assert np.asarray(accepted).tolist() == [2, 3, 1]
    assert np.asarray(sampled).tolist() == [1, 7, 6]


def test_seeded_draws_repeat():
    logits, _, _ = target()
    rows = jnp.asarray(np.broadcast_to(logits, (64, 2, VOCAB)).reshape(-1, VOCAB))
    drafts, counts, starts = jnp.full((64, 1), 1, jnp.int32), jnp.ones(64, jnp.int32), 2 * jnp.arange(64)
    runs = [sample_with_drafts(rows, tensors(64, seed0=9), None, SamplerFeatures(random=True), drafts, counts,
                               starts)[:2] for _ in range(2)]
    for a, b in zip(*runs):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

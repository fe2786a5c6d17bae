"""The rejection sampler keeps the target's distribution, as vLLM's tests check it: over
many seeded draws on fixed target logits and a fixed (one-hot, n-gram) draft, the emitted
tokens follow the target's distribution after its transforms, at the verified position and
at the bonus one. A sampler that accepts by a draw of its own and then forgets to mask the
rejected draft fails the bound."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxvllm.sampler import (MAX_BAD_WORD_TOKENS, MAX_BAD_WORDS, SamplerFeatures, SamplerState, SamplingTensors,
                             init_state, sample, write_state_row)
from jaxvllm.spec_decode.rejection_sampler import sample_with_drafts

DRAWS = 20_000
VOCAB = 8


def tensors(rows: int, temperature: float = 1.0, top_k: int = 0, seed0: int = 0) -> SamplingTensors:
    full = lambda value, dtype: jnp.full(rows, value, dtype)  # noqa: E731
    return SamplingTensors(
        temperature=full(temperature, jnp.float32), top_k=full(top_k, jnp.int32), top_p=full(1.0, jnp.float32),
        min_p=full(0.0, jnp.float32), presence_penalty=full(0.0, jnp.float32),
        frequency_penalty=full(0.0, jnp.float32), repetition_penalty=full(1.0, jnp.float32),
        seeds=jnp.arange(seed0, seed0 + rows, dtype=jnp.uint32), use_state=full(False, bool),
        output_index=full(5, jnp.int32), slot=full(0, jnp.int32), min_tokens=full(0, jnp.int32),
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
    # The bound has power: a sampler that accepts by a draw of its own and then samples
    # from p without masking the rejected draft emits the draft too often.
    unmasked = np.asarray(sample(rows.reshape(DRAWS, 2, VOCAB)[:, 0], tensors(DRAWS, temperature, top_k), None,
                                 features)[0])
    coin = np.random.default_rng(0).random(DRAWS) < p0[draft]
    wrong = np.where(coin, draft, unmasked)
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


def state_tensors(rows: int, **values) -> SamplingTensors:
    """Greedy rows that use the sampler state, row i at state slot i + 1."""
    t = tensors(rows, temperature=0.0)
    t = dataclasses.replace(t, use_state=jnp.ones(rows, bool), slot=jnp.arange(1, rows + 1, dtype=jnp.int32))
    return dataclasses.replace(t, **{k: jnp.asarray(v, getattr(t, k).dtype) for k, v in values.items()})


def sequential(logits, t, state, features, drafts, bitmask, logprobs_mode="raw_logprobs"):
    """The oracle: one row sampled position after position as `sample` would, each accepted
    draft counted into the state before the next; (accepted, sampled, state, the logprobs
    of each emitted token)."""
    emitted = []
    for j in range(len(drafts) + 1):
        tj = dataclasses.replace(t, output_index=t.output_index + j)
        token, logprobs, after = sample(logits[j : j + 1], tj, state, features, logprobs_mode, bitmask[j : j + 1])
        token = int(token[0])
        emitted.append(logprobs)
        if j == len(drafts) or token != drafts[j]:
            return j, token, after, emitted
        state = after


@pytest.mark.parametrize("logprobs_mode,temperature", [("raw_logprobs", 0.0), ("processed_logprobs", 0.0),
                                                       ("raw_logprobs", 0.9), ("processed_logprobs", 1.3)])
def test_state_and_grammar_see_the_drafts_before_each_position(logprobs_mode, temperature):
    """Penalties, bad words, min_tokens, bias and the grammar's per-position bitmask judge
    each verified position as if the drafts before it had been sampled: accepted counts,
    tokens, logprobs and the state after equal sampling the row one position at a time,
    greedy or seeded random (each position draws what sampling without drafts would)."""
    vocab, rows, k = 16, 4, 3
    rng = np.random.default_rng(0)
    features = SamplerFeatures(random=temperature > 0, top_k=temperature > 0, state=True, bad_words=True,
                               grammar=True, logprobs=2)
    t = state_tensors(rows, frequency_penalty=[0.0, 2.0, 0.5, 0.0], presence_penalty=[0.0, 1.0, 0.0, 0.5],
                      repetition_penalty=[1.0, 1.0, 1.5, 2.0], min_tokens=[0, 0, 7, 0], output_index=[3, 4, 5, 6],
                      temperature=[temperature] * rows, top_k=[0, 5, 0, 3], seeds=[11, 12, 13, 14])
    state = init_state(rows + 1, vocab)
    for slot in range(1, rows + 1):
        bias = np.where(rng.random(vocab) < 0.1, -np.inf, rng.normal(0, 0.5, vocab)).astype(np.float32)
        bad = np.full((MAX_BAD_WORDS, MAX_BAD_WORD_TOKENS), -1, np.int32)
        bad[0, -2:], bad[1, -1] = rng.integers(0, vocab, 2), rng.integers(0, vocab)  # a two-token word, a one-token word
        row = SamplerState(bias, rng.random(vocab) < 0.2, rng.integers(0, 3, vocab).astype(np.int32),
                           rng.random(vocab) < 0.1, bad, rng.integers(0, vocab, MAX_BAD_WORD_TOKENS - 1).astype(np.int32))
        state = write_state_row(state, slot, row)
    num_drafts = np.array([3, 2, 3, 0])
    starts = np.concatenate([[0], np.cumsum(1 + num_drafts)[:-1]])
    logits = rng.normal(0, 1, (int((1 + num_drafts).sum()), vocab)).astype(np.float32)
    bitmask = rng.integers(-2**31, 2**31, (len(logits), 1), dtype=np.int64).astype(np.int32)
    single = lambda x, i: jax.tree.map(lambda a: a[i : i + 1], x)  # noqa: E731
    path = np.zeros((rows, k), np.int32)  # the oracle's own tokens
    for i in range(rows):
        span = slice(starts[i], starts[i] + 1 + num_drafts[i])
        for j in range(num_drafts[i]):
            path[i, j] = sequential(logits[span], single(t, i), state, features, path[i, :j].tolist() + [-1],
                                    bitmask[span])[1]
    for case in range(2):
        # Drafts: the oracle's path (all accepted), then that path changed at one position.
        drafts = path.copy()
        if case == 1:
            drafts[0, 1] = (drafts[0, 1] + 1) % vocab
            drafts[2, 0] = (drafts[2, 0] + 1) % vocab
        sampled, accepted, logprobs, after = sample_with_drafts(
            jnp.asarray(logits), t, state, features, jnp.asarray(drafts), jnp.asarray(num_drafts, jnp.int32),
            jnp.asarray(starts, jnp.int32), logprobs_mode, jnp.asarray(bitmask))
        for i in range(rows):
            span = slice(starts[i], starts[i] + 1 + num_drafts[i])
            want = sequential(logits[span], single(t, i), state, features, drafts[i, : num_drafts[i]].tolist(),
                              bitmask[span], logprobs_mode)
            assert (int(accepted[i]), int(sampled[i])) == want[:2], (case, i)
            np.testing.assert_array_equal(after.output_counts[i + 1], want[2].output_counts[i + 1])
            np.testing.assert_array_equal(after.recent[i + 1], want[2].recent[i + 1])
            for j, expected in enumerate(want[3]):  # the logprobs of each emitted token
                got = jax.tree.map(lambda x: np.asarray(x[starts[i] + j]), logprobs)
                np.testing.assert_allclose(got.token_logprob, expected.token_logprob[0], rtol=1e-5)
                np.testing.assert_array_equal(got.top_ids, expected.top_ids[0])
                np.testing.assert_allclose(got.top_logprobs, expected.top_logprobs[0], rtol=1e-5)
        if case == 0:
            assert np.asarray(accepted).tolist() == num_drafts.tolist()
        else:
            assert np.asarray(accepted).tolist() == [1, 2, 0, 0]


def test_penalized_positions_follow_the_penalized_target():
    """A random row with a frequency penalty drafting one token twice: the second draft is
    judged, and the token after it drawn, from the distribution penalized by the first."""
    logits, p0, p1 = target()
    draft, penalty = 3, 1.5
    features = SamplerFeatures(random=True, state=True)
    rows = jnp.asarray(np.broadcast_to(np.stack([logits[1], logits[1], logits[0]]), (DRAWS, 3, VOCAB)).reshape(-1, VOCAB))
    t = dataclasses.replace(tensors(DRAWS), use_state=jnp.ones(DRAWS, bool), slot=jnp.arange(DRAWS, dtype=jnp.int32),
                            frequency_penalty=jnp.full(DRAWS, penalty, jnp.float32))
    drafts = jnp.full((DRAWS, 2), draft, jnp.int32)
    sampled, accepted, _, state = sample_with_drafts(rows, t, init_state(DRAWS, VOCAB), features, drafts,
                                                     jnp.full(DRAWS, 2, jnp.int32), 3 * jnp.arange(DRAWS, dtype=jnp.int32))
    sampled, accepted = np.asarray(sampled), np.asarray(accepted)
    penalized = np.exp(logits[1] - penalty * (np.arange(VOCAB) == draft))
    penalized /= penalized.sum()
    assert abs((accepted >= 1).mean() - p1[draft]) < 0.02
    first = accepted >= 1
    assert abs((accepted[first] == 2).mean() - penalized[draft]) < 0.03  # judged after the first was counted
    second = np.where(accepted[first] == 2, draft, sampled[first])  # the token emitted at position 1
    assert np.abs(frequencies(second) - penalized).sum() / 2 < 0.04
    counts = np.asarray(state.output_counts)  # every emitted token counted
    assert (counts.sum(axis=1) == accepted + 1).all()
    assert (counts[:, draft] >= np.minimum(accepted, 2)).all()


def test_a_draft_that_starts_a_bad_word_bans_its_end_next():
    """Bad word [5, 5]: the first draft 5 passes, and makes 5 banned at the next position."""
    logits = np.zeros((3, VOCAB), np.float32)
    logits[:, 5], logits[:, 6] = 2.0, 1.0
    bad = np.full((MAX_BAD_WORDS, MAX_BAD_WORD_TOKENS), -1, np.int32)
    bad[0, -2:] = 5
    state = init_state(2, VOCAB)
    row = jax.tree.map(lambda x: x[0], state)
    state = write_state_row(state, 1, dataclasses.replace(row, bad_words=jnp.asarray(bad)))
    sampled, accepted, _, after = sample_with_drafts(
        jnp.asarray(logits), state_tensors(1), state, SamplerFeatures(state=True, bad_words=True),
        jnp.asarray([[5, 5]], jnp.int32), jnp.asarray([2], jnp.int32), jnp.asarray([0], jnp.int32))
    assert (int(accepted[0]), int(sampled[0])) == (1, 6)
    assert np.asarray(after.recent[1]).tolist()[-2:] == [5, 6]

"""The n-gram proposer: vLLM's cases (tests/v1/spec_decode/test_ngram.py, with jaxvllm's
config), the batched entry point's caps, the fast matcher against a brute force, and the
CPU's pause after missed drafts."""

import itertools

import numpy as np
import pytest

from jaxvllm.config import EngineConfig, SpeculativeConfig
from jaxvllm.spec_decode.ngram_proposer import (
    MissBackoff,
    NgramProposer,
    _find_longest_matched_ngram_and_propose_tokens,
)


def match(tokens, min_ngram, max_ngram, k, max_model_len=1024):
    return _find_longest_matched_ngram_and_propose_tokens(
        origin_tokens=np.array(tokens), min_ngram=min_ngram, max_ngram=max_ngram, max_model_len=max_model_len, k=k)


def get_ngram_proposer(min_n: int, max_n: int, k: int, max_model_len: int | None = 2048) -> NgramProposer:
    # As vLLM's test: a model length of 2048 (facebook/opt-125m's), the window and k.
    spec = SpeculativeConfig(prompt_lookup_min=min_n, prompt_lookup_max=max_n, num_speculative_tokens=k, method="ngram")
    return NgramProposer(vllm_config=EngineConfig(model="x", max_model_len=max_model_len, speculative_config=spec))


def test_find_longest_matched_ngram_and_propose_tokens():
    assert len(match([1, 2, 3, 4, 1, 2, 3, 5, 6], 2, 2, k=2)) == 0
    tokens = [1, 2, 3, 4, 1, 2, 3]
    np.testing.assert_array_equal(match(tokens, 2, 2, k=3), [4, 1, 2])
    np.testing.assert_array_equal(match(tokens, 2, 2, k=2), [4, 1])
    np.testing.assert_array_equal(match(tokens, 1, 1, k=3), [4, 1, 2])
    np.testing.assert_array_equal(match(tokens, 1, 1, k=2), [4, 1])
    tokens = [1, 3, 6, 2, 3, 4, 1, 2, 3]
    np.testing.assert_array_equal(match(tokens, 2, 2, k=3), [4, 1, 2])
    np.testing.assert_array_equal(match(tokens, 1, 1, k=2), [6, 2])  # the first match


@pytest.mark.parametrize("min_n, max_n, k, context, expected", [
    (2, 2, 2, [1, 2, 3, 4, 5], []),  # no match
    (4, 4, 2, [1, 2, 3, 4, 1, 2, 3], []),  # no 4-gram
    (3, 4, 2, [1, 2, 3, 4, 1, 2, 3], [4, 1]),  # no 4-gram, but a 3-gram
    (3, 4, 2, [2, 3, 4, 5, 1, 2, 3, 4, 1, 2, 3, 4], [1, 2]),  # the 4-gram, not the 3-gram's [5, 1]
    (2, 4, 2, [3, 4, 5, 2, 3, 4, 1, 2, 3, 4], [1, 2]),  # the 3-gram, not the 2-gram's [5, 2]
    (3, 3, 2, [1, 2, 3, 100, 1, 2, 3, 200, 1, 2, 3, 300, 1, 2, 3], [100, 1]),  # always the first
    (2, 2, 2, [], []),  # empty input
])
def test_ngram_proposer(min_n, max_n, k, context, expected):
    proposer = get_ngram_proposer(min_n, max_n, k)
    result = proposer.propose(context_token_ids=np.array(context, dtype=np.int64))
    assert isinstance(result, np.ndarray) and result.tolist() == expected
    assert proposer.propose_batch([np.array(context, dtype=np.int64)]) == [expected]


def test_ngram_proposer_multibatch():
    # vLLM's padded rows: request 0 has 5 tokens and a match, request 1 has 3 and none.
    token_ids_cpu = np.array([[1, 2, 3, 1, 2], [4, 5, 6, -1, -1]])
    rows = [row[:n] for row, n in zip(token_ids_cpu, [5, 3], strict=True)]
    assert get_ngram_proposer(2, 2, 2).propose_batch(rows) == [[3, 1], []]


def test_ngram_proposer_skipped_request_in_the_middle():
    # vLLM's non-contiguous case: request 1 is in prefill (here: may emit no draft).
    token_ids_cpu = np.zeros((3, 20), dtype=np.int32)
    token_ids_cpu[0, :5] = [1, 2, 3, 1, 2]
    token_ids_cpu[1, :3] = [4, 5, 6]
    token_ids_cpu[2, :5] = [7, 8, 9, 7, 8]
    rows = [row[:n] for row, n in zip(token_ids_cpu, [5, 3, 5], strict=True)]
    assert get_ngram_proposer(2, 2, 2).propose_batch(rows, max_drafts=[2, 0, 2]) == [[3, 1], [], [9, 7]]


def test_ngram_proposer_long_context():
    # vLLM's multithreading case: the match is 8192 tokens back; max_model_len 2 * 8192.
    threshold = 8192
    middle = threshold // 2
    long_row = np.array(list(range(threshold)) + [middle, middle + 1])
    proposer = get_ngram_proposer(2, 2, 2, max_model_len=2 * threshold)
    assert proposer.propose_batch([long_row, np.array([4, 5, 6])]) == [[middle + 2, middle + 3], []]


def test_max_model_len_caps_drafts():
    tokens = [1, 2, 3, 4, 1, 2, 3]  # drafts [4, 1, 2] with room for them
    assert match(tokens, 2, 2, k=3, max_model_len=9).tolist() == [4, 1]
    assert match(tokens, 2, 2, k=3, max_model_len=7).tolist() == []
    assert match(tokens, 2, 2, k=3, max_model_len=None).tolist() == [4, 1, 2]
    # The explicit length wins over the config's; with neither, no cap.
    assert get_ngram_proposer(2, 2, 3, max_model_len=None).propose(np.array(tokens)).tolist() == [4, 1, 2]
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_min=2, prompt_lookup_max=2)
    proposer = NgramProposer(EngineConfig(model="x", max_model_len=100, speculative_config=spec), max_model_len=8)
    assert proposer.max_model_len == 8 and proposer.propose(np.array(tokens)).tolist() == [4]


def test_propose_batch_caps_and_empty_contexts():
    proposer = get_ngram_proposer(1, 3, 4)
    rows = [[1, 2, 3, 4, 5, 1, 2, 3], [], [7], [1, 2, 3, 4, 5, 1, 2, 3], [5, 6, 7], np.array([9, 8, 9, 8, 9])]
    assert proposer.propose_batch(rows) == [[4, 5, 1, 2], [], [], [4, 5, 1, 2], [], [8, 9]]
    caps = np.array([2, 3, 3, 0, 4, 9])  # 0: nothing; above k: k
    assert proposer.propose_batch(rows, max_drafts=caps) == [[4, 5], [], [], [], [], [8, 9]]
    assert proposer.propose_batch([]) == []
    assert all(type(t) is int for t in proposer.propose_batch(rows)[0])


def test_proposer_needs_an_ngram_config():
    with pytest.raises(ValueError, match="ngram"):
        NgramProposer(EngineConfig(model="x"))


def brute_force(tokens: list[int], min_ngram: int, max_ngram: int, max_model_len: int, k: int) -> list[int]:
    """vLLM's rule spelled out: for n from the longest down, the first earlier occurrence
    of the last n tokens (one token at least following it) gives the drafts."""
    k = min(k, max_model_len - len(tokens))
    for n in range(max_ngram, min_ngram - 1, -1):
        for start in range(len(tokens) - n):
            if k > 0 and tokens[start:start + n] == tokens[len(tokens) - n:]:
                return tokens[start + n:start + n + k]
    return []


@pytest.mark.parametrize("min_ngram, max_ngram, k", [(1, 1, 1), (1, 3, 2), (2, 2, 4), (1, 5, 4), (3, 5, 3), (2, 7, 5)])
def test_matcher_against_brute_force(min_ngram, max_ngram, k):
    rng = np.random.default_rng(max_ngram * 100 + min_ngram * 10 + k)
    found = 0
    for vocab, _ in itertools.product((2, 3, 5), range(400)):
        tokens = rng.integers(0, vocab, int(rng.integers(0, 40))).tolist()
        max_model_len = len(tokens) + int(rng.integers(-1, k + 2))
        expected = brute_force(tokens, min_ngram, max_ngram, max_model_len, k)
        got = match(tokens, min_ngram, max_ngram, k, max_model_len)
        assert got.tolist() == expected, (tokens, min_ngram, max_ngram, max_model_len, k)
        found += bool(expected)
    assert found > 100  # matches are common with so few symbols


def test_context_arrays_follow_growing_lists():
    from jaxvllm.spec_decode.ngram_proposer import ContextArrays

    contexts, tokens = ContextArrays(), []
    for step in range(300):
        tokens += [step % 7] * (1 + step % 3)
        np.testing.assert_array_equal(contexts.get("a", tokens), tokens)
    np.testing.assert_array_equal(contexts.get("a", [1, 2]), [1, 2])  # (shorter: made anew)
    contexts.get("b", [3])
    contexts.keep({"b"})
    assert list(contexts._arrays) == ["b"]


def test_miss_backoff_pauses_drafts_after_misses_and_resumes_after_a_hit():
    """A verify that accepted fewer than half its drafts pauses the request 1, 2, 4, ...
    steps (at most MAX_SKIP); one that accepted at least half ends the pause and the count."""
    backoff = MissBackoff()

    def allowed(steps: int) -> list[bool]:
        return [backoff.allow("a") for _ in range(steps)]

    assert allowed(3) == [True] * 3  # a new request drafts
    backoff.record("a", drafted=0, accepted=0)  # a step without drafts changes nothing
    assert allowed(1) == [True]
    pauses = []
    for _ in range(7):
        backoff.record("a", drafted=8, accepted=3)  # 3 of 8: a miss
        steps = allowed(MissBackoff.MAX_SKIP + 1)
        pauses.append(steps.index(True))
        assert all(steps[pauses[-1]:])
    assert pauses == [1, 2, 4, 8, 16, 16, 16]
    backoff.record("a", drafted=8, accepted=4)  # half: a hit, the count starts again
    backoff.record("a", drafted=4, accepted=0)
    assert allowed(2) == [False, True]
    backoff.record("b", drafted=2, accepted=0)
    backoff.keep({"a"})  # "b" left the running set: forgotten, it drafts at once if it comes back
    assert backoff.allow("b")

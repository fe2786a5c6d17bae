"""The n-gram (prompt lookup) proposer of draft tokens, vLLM's `ngram` method.

Prompt lookup needs no draft model: text that repeats its context (code edits, quotes,
summaries, structured output) is guessed by copying. vLLM's rule: take the longest
suffix n-gram of the request's tokens, prompt_lookup_min <= n <= prompt_lookup_max,
that occurs earlier in them; at its FIRST occurrence, the (up to) k tokens that
followed it are the drafts. Runs on the host, on every decoding request every step,
so the search is vectorized: numpy compares the last token once over the context and
then only extends the surviving candidates backwards, one n at a time.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from jaxvllm.config import EngineConfig


def _find_longest_matched_ngram_and_propose_tokens(
    origin_tokens: np.ndarray, min_ngram: int, max_ngram: int, max_model_len: int | None, k: int
) -> np.ndarray:
    """vLLM's matcher: the up to k tokens after the first occurrence of the longest suffix
    n-gram (min_ngram <= n <= max_ngram) seen earlier; empty when none (or no room left:
    k is first capped at max_model_len - len(origin_tokens); None is unbounded)."""
    tokens = np.asarray(origin_tokens)
    n = tokens.shape[0]
    if max_model_len is not None:
        k = min(k, max_model_len - n)
    if n < min_ngram or k <= 0 or n < 2:
        return tokens[:0]
    # ends: where an earlier occurrence of the suffix n-gram could end (not the last token,
    # so that one token at least follows it), kept while it matches the last `length` tokens.
    ends = np.flatnonzero(tokens[: n - 1] == tokens[n - 1])
    length, first_end = 0, -1
    while ends.size:
        length, first_end = length + 1, int(ends[0])  # ends stay sorted: [0] is the first occurrence
        if length == max_ngram:
            break
        if first_end < length:  # only the first can be too close to the start to extend
            ends = ends[1:]
        ends = ends[tokens[ends - length] == tokens[n - 1 - length]]
    if length < min_ngram:
        return tokens[:0]
    return tokens[first_end + 1 : first_end + 1 + k]


class NgramProposer:
    """Proposes draft tokens by prompt lookup, with the window and k of the engine's
    `speculative_config`; stateless between calls, so requests may come in any order."""

    def __init__(self, vllm_config: EngineConfig, max_model_len: int | None = None) -> None:
        spec = vllm_config.speculative_config
        if spec is None or spec.method != "ngram":
            raise ValueError("NgramProposer needs a speculative_config with method 'ngram'")
        self.min_n: int = spec.prompt_lookup_min
        self.max_n: int = spec.prompt_lookup_max
        self.k: int = spec.num_speculative_tokens
        # None until the model's length is known; an explicit argument wins.
        self.max_model_len: int | None = max_model_len if max_model_len is not None else vllm_config.max_model_len

    def propose(self, context_token_ids: np.ndarray, k: int | None = None) -> np.ndarray:
        """One request's drafts (at most `k`, default the config's); empty when no n-gram
        matches, as vLLM's matcher returns."""
        k = self.k if k is None else min(k, self.k)
        return _find_longest_matched_ngram_and_propose_tokens(
            context_token_ids, self.min_n, self.max_n, self.max_model_len, k)

    def propose_batch(self, token_id_lists: Sequence[np.ndarray | Sequence[int]],
                      max_drafts: Sequence[int] | np.ndarray | None = None) -> list[list[int]]:
        """Each request's drafts as a list of ids ([] when none). `max_drafts[i]` caps
        request i's count: what it may still emit (0: no drafts)."""
        drafts = []
        for i, token_ids in enumerate(token_id_lists):
            k = self.k if max_drafts is None else min(self.k, int(max_drafts[i]))
            drafts.append(self.propose(np.asarray(token_ids), k).tolist() if k > 0 else [])
        return drafts


class ContextArrays:
    """Each running request's tokens as a numpy array, kept from step to step and extended by
    its new tokens only: converting a whole list every step would cost more than the lookup
    (about 24 us for 1,024 tokens, against 2-10 us for the proposal)."""

    def __init__(self) -> None:
        self._arrays: dict[str, tuple[np.ndarray, int]] = {}

    def get(self, key: str, tokens: Sequence[int]) -> np.ndarray:
        """The tokens of request `key` (a list that only grows while it runs) as an array."""
        array, known = self._arrays.get(key, (None, 0))
        n = len(tokens)
        if array is None or known > n:
            array, known = np.empty(max(64, 2 * n), np.int64), 0
        elif n > array.shape[0]:
            grown = np.empty(2 * n, np.int64)
            grown[:known] = array[:known]
            array = grown
        array[known:n] = tokens[known:]
        self._arrays[key] = (array, n)
        return array[:n]

    def keep(self, keys: set[str]) -> None:
        """Forget the requests not in `keys` (those that left the running set)."""
        for key in self._arrays.keys() - keys:
            del self._arrays[key]


class MissBackoff:
    """Per request, a pause in drafting after drafts that mostly failed. On a CPU a step that
    verifies 1 + K tokens costs several decode steps (each padded token is computed), so a
    request whose lookups keep missing is slower with drafts than without. After a verify
    that accepted fewer than half its drafts the request skips 1, 2, 4, ... (at most
    `MAX_SKIP`) steps before it drafts again, doubling with each miss in a row; a verify that
    accepted at least half ends the pause. It reads the request's own history only, so a
    seeded request's drafts, and hence its output, do not depend on the batch around it."""

    MAX_SKIP = 16

    def __init__(self) -> None:
        self._misses: dict[str, int] = {}  # request -> misses in a row
        self._skip: dict[str, int] = {}  # request -> steps left without drafts

    def allow(self, key: str) -> bool:
        """Whether request `key` may draft for its next step (a step it skips counts down)."""
        skip = self._skip.get(key, 0)
        if skip:
            self._skip[key] = skip - 1
        return not skip

    def record(self, key: str, drafted: int, accepted: int) -> None:
        """A verified step of request `key`: `accepted` of its `drafted` drafts passed."""
        if not drafted:
            return
        if 2 * accepted >= drafted:
            self._misses.pop(key, None)
            return
        misses = self._misses.get(key, 0) + 1
        self._misses[key], self._skip[key] = misses, min(1 << (misses - 1), self.MAX_SKIP)

    def keep(self, keys: set[str]) -> None:
        """Forget the requests not in `keys` (those that left the running set)."""
        for table in (self._misses, self._skip):
            for key in table.keys() - keys:
                del table[key]

"""A request as the scheduler sees it (tokens so far and how many are in the KV cache), and
the user's request it belongs to (`ParentRequest`: its n completions)."""

from __future__ import annotations

import enum
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from jaxvllm.outputs import RequestMetrics
from jaxvllm.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


class Request:
    """Prompt plus generated tokens; `num_computed_tokens` of them have K/V in the cache.

    A request is prefilling while num_computed_tokens < num_tokens - 1 and decoding
    after; there is no phase flag (vLLM V1): each step computes some of the missing tokens.
    """

    __slots__ = (
        "request_id", "parent_id", "prompt", "prompt_token_ids", "token_ids", "params", "priority", "max_tokens",
        "max_num_tokens", "top_k", "min_tokens", "eos_token_ids", "has_stop_strings", "stop_ids", "arrival_index", "seed",
        "num_computed_tokens", "num_pending", "num_cached_tokens", "cache_salt", "read_prefix_cache", "num_logprobs",
        "num_prompt_logprobs", "bad_words_token_ids", "block_hashes", "uses_sampler_state", "logprobs",
        "cumulative_logprob", "prompt_logprobs", "prompt_logprobs_start", "grammar", "detokenizer", "num_detokenized",
        "num_preemptions", "status", "finish_reason", "stop_reason", "metrics", "spec_token_ids", "lora_id", "lora_version",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        prompt: str | None = None,
        priority: int = 0,
        max_tokens: int,
        eos_token_ids: tuple[int, ...] = (),
        arrival_index: int = 0,
        seed: int = 0,
        cache_salt: str | None = None,
        vocab_size: int = 0,
        bad_words_token_ids: list[list[int]] = (),
        lora_id: int = 0,
    ) -> None:
        self.request_id = request_id
        self.parent_id = request_id  # the user's request id (differs for n > 1)
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.token_ids = list(prompt_token_ids)  # prompt + output, grows each decode step
        self.params = params
        self.priority = priority
        self.max_tokens = max_tokens
        self.max_num_tokens = len(self.prompt_token_ids) + max_tokens  # prompt + outputs at most
        # As the sampler's int32 columns hold them: top_k of the vocabulary or more is off (vLLM's
        # input batch reads it so), and min_tokens past max_tokens means no more than max_tokens.
        self.top_k = 0 if params.top_k <= 0 or params.top_k >= (vocab_size or 2**31) else params.top_k
        self.min_tokens = min(params.min_tokens, max_tokens)
        # The model's EOS first (stop_reason None), then its other end ids (stop_reason the id).
        # min_tokens masks them even under ignore_eos, as vLLM's (`_all_stop_token_ids`).
        self.eos_token_ids = eos_token_ids
        self.has_stop_strings = bool(params.stop_strings)
        self.stop_ids = frozenset(() if params.ignore_eos else eos_token_ids) | frozenset(params.stop_token_ids)
        self.arrival_index = arrival_index  # FCFS order and priority tie-break
        self.seed = seed  # the engine derives it from params.seed (+ completion index) or its own seed
        self.num_computed_tokens = 0
        # Tokens sampled on the device but not yet appended here (async scheduling: 1, or 1 + d
        # while d drafts are verified: `ScheduledRequest.num_in_flight`).
        self.num_pending = 0
        self.num_cached_tokens: int | None = None  # prefix-cache hit on first admission
        self.cache_salt = cache_salt  # requests with different salts never share cached blocks
        self.lora_id = lora_id  # the LoRA adapter's lora_int_id (0: the base model)
        # Which reading of that adapter (`LoRAManager.versions`; the engine that queues the request
        # sets it): blocks cached under another never serve it.
        self.lora_version = 0
        # Off for prompt logprobs by default: they need every prompt token computed (as vLLM).
        self.read_prefix_cache = params.reads_prefix_cache
        # Top logprobs per token, -1 (the whole vocabulary) resolved; None: not asked for.
        self.num_logprobs = params.num_logprobs(vocab_size)
        self.num_prompt_logprobs = params.num_prompt_logprobs(vocab_size)
        # The first prompt position scored, when not every one is (None: from 1, position 0
        # has none); the cache may serve the blocks before it (`KVCacheManager.get_computed_blocks`).
        self.prompt_logprobs_start = params.prompt_logprobs_start
        self.bad_words_token_ids = [list(w) for w in bad_words_token_ids]
        self.block_hashes: list[bytes] = []  # of full blocks, filled by the KV cache manager
        self.uses_sampler_state = bool(
            params.uses_penalties or params.logit_bias or params.allowed_token_ids is not None or params.min_tokens
            or self.bad_words_token_ids
        )
        # Outputs beyond token ids, filled by the engine.
        self.logprobs: list[dict] | None = [] if params.logprobs is not None else None
        self.cumulative_logprob: float | None = 0.0 if params.logprobs is not None else None
        self.prompt_logprobs: list[dict | None] | None = (
            [None] * len(self.prompt_token_ids) if params.prompt_logprobs is not None else None
        )
        # Structured outputs: the request's grammar (jaxvllm.structured_output.Grammar), set by
        # the engine; it advances on each appended token.
        self.grammar = None
        self.detokenizer = None  # an IncrementalDetokenizer when params.detokenize
        self.num_detokenized = 0  # output tokens the detokenizer has seen
        self.num_preemptions = 0
        # Speculative decoding: draft tokens proposed for the next step to verify (not tokens
        # of the request until accepted).
        self.spec_token_ids: list[int] = []
        self.status = RequestStatus.WAITING
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.metrics = RequestMetrics(arrival_time=time.time())

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    def output_token_ids_from(self, start: int) -> list[int]:
        """`output_token_ids[start:]`, without copying the ones before (a step reads its new ones)."""
        return self.token_ids[self.num_prompt_tokens + start :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    def roll_back(self, num_tokens: int) -> None:
        """Take back the tokens past the first `num_tokens`, and what they ended or recorded:
        a failed step's, whose bookkeeping may have stopped anywhere (recomputed, they come
        out the same). The detokenizer and the grammar replay the tokens kept.
        The engine records a step's metrics only once it is committed."""
        del self.token_ids[num_tokens:]
        kept = self.output_token_ids
        if self.logprobs is not None:
            del self.logprobs[len(kept):]
            self.cumulative_logprob = 0.0
            for token, entry in zip(kept, self.logprobs):  # (summed in the order they were)
                self.cumulative_logprob += entry[token].logprob
        if self.status is RequestStatus.FINISHED:
            self.status = RequestStatus.PREEMPTED
        self.finish_reason = self.stop_reason = None
        if not kept:  # (its first token comes again: timed then)
            self.metrics.first_token_time = None
        if self.detokenizer is not None and self.num_detokenized:
            self.detokenizer = self.detokenizer.restarted(self.prompt_token_ids)
            self.num_detokenized = 0
        if self.grammar is not None:
            self.grammar.replay(kept)

    @property
    def stopped_on_token(self) -> bool:
        """Ended by its last token, an EOS or stop token id (not a stop string or grammar)."""
        return (self.finish_reason == "stop" and not isinstance(self.stop_reason, str)
                and self.token_ids[-1] in self.stop_ids)

    def append_token(self, token_id: int) -> None:
        """Add a sampled token and set finish_reason when it ends the completion. As vLLM's
        `check_stop`, the length cap comes first: a stop token that is also the last allowed
        one ends it as "length", its text kept. A complete structured output goes on to the
        EOS its mask leaves (vLLM's), unless min_tokens or allowed_token_ids mask that EOS: it
        ends as "stop" then (vLLM samples a masked row's id 0 there)."""
        self.token_ids.append(token_id)
        complete = False
        if self.grammar is not None:
            if not self.grammar.accept(token_id):  # (the mask allows only what it accepts)
                logger.error("request %s: the grammar refused token %d: %s", self.request_id, token_id,
                             self.grammar.error)
                self.finish_reason = "abort"
                return
            complete = self.grammar.stopped and not self._eos_may_follow()
        if len(self.token_ids) >= self.max_num_tokens:
            self.finish_reason = "length"
        elif token_id in self.stop_ids:
            self.finish_reason = "stop"
            # (the EOS is reported as None, vLLM's; under ignore_eos only a stop id can match it)
            eos = not self.params.ignore_eos and self.eos_token_ids and token_id == self.eos_token_ids[0]
            self.stop_reason = None if eos else token_id
        elif complete:
            self.finish_reason = "stop"

    def _eos_may_follow(self) -> bool:
        """Whether the sampler may draw the EOS next: min_tokens and allowed_token_ids may mask it."""
        if self.num_output_tokens < self.params.min_tokens:
            return False
        allowed = self.params.allowed_token_ids
        return allowed is None or not self.eos_token_ids or self.eos_token_ids[0] in allowed


@dataclass(slots=True)
class ScheduledRequest:
    """One request's share of a step: `num_new_tokens` tokens from position `start` on.

    The last of them may be a token still on the device (sampled by the step before,
    `request.num_pending`): the runner takes it from there.
    """

    request: Request
    start: int  # num_computed_tokens before this step
    num_new_tokens: int
    block_ids: list[int]  # the request's physical blocks, in logical order
    # Whether this chunk reaches the request's last token, so its logits give a new
    # token (fixed when scheduled, before the token is counted as pending).
    samples: bool | None = None
    # Of `num_new_tokens`, the request's draft tokens (`spec_token_ids`) verified this step.
    num_drafts: int = 0

    def __post_init__(self) -> None:
        if self.samples is None:
            r = self.request
            self.samples = self.start + self.num_new_tokens == r.num_tokens + r.num_pending

    @property
    def num_in_flight(self) -> int:
        """What this step adds to `request.num_pending`: the token it samples and, counting on
        each one passing, the drafts it verifies."""
        return int(self.samples) * (1 + self.num_drafts)


class ScheduledBatch:
    """A step's scheduled chunks as columns, in schedule order (running requests first,
    then admitted ones): what the batch builder and `update_from_output` read with numpy.

    Indexing or iterating gives `ScheduledRequest`s (made once, on first use) for code
    that reads one request at a time.
    """

    __slots__ = ("requests", "starts", "num_new_tokens", "samples", "block_ids", "host_ends", "num_blocks",
                 "start_tokens", "num_drafts", "_items")

    def __init__(self, requests: list[Request], starts, num_new_tokens, samples, block_ids: list[list[int]],
                 host_ends=None, num_blocks=None, start_tokens=None, num_drafts=None) -> None:
        self.requests = requests
        self.starts = np.asarray(starts, np.int64)
        self.num_new_tokens = np.asarray(num_new_tokens, np.int64)
        self.samples = np.asarray(samples, bool)  # the chunk reaches the request's last token
        self.block_ids = block_ids  # each request's physical blocks, in logical order
        # Where the tokens known on the host end, when scheduled: a chunk ending past it ends
        # with the token the step before sampled, still on the device.
        if host_ends is None:
            host_ends = np.minimum(self.starts + self.num_new_tokens, np.array([len(r.token_ids) for r in requests],
                                                                                np.int64))
        self.host_ends = host_ends
        self.num_blocks = np.array([len(b) for b in block_ids], np.int64) if num_blocks is None else num_blocks
        # A chunk of one host token: that token (a decoding step's input, mostly); else -1.
        if start_tokens is None:
            one = (self.host_ends - self.starts == 1).tolist()
            start_tokens = [r.token_ids[s] if o else -1 for r, s, o in zip(requests, self.starts.tolist(), one)]
        self.start_tokens = np.asarray(start_tokens, np.int64)
        # Draft tokens each chunk verifies: the last ones of the chunk, after its host tokens.
        self.num_drafts = np.zeros(len(requests), np.int64) if num_drafts is None else np.asarray(num_drafts, np.int64)
        self._items: list[ScheduledRequest] | None = None

    @classmethod
    def of(cls, scheduled: list[ScheduledRequest]) -> "ScheduledBatch":
        batch = cls([s.request for s in scheduled], [s.start for s in scheduled],
                    [s.num_new_tokens for s in scheduled], [s.samples for s in scheduled],
                    [s.block_ids for s in scheduled], num_drafts=[s.num_drafts for s in scheduled])
        batch._items = list(scheduled)
        return batch

    def extend(self, more: list[ScheduledRequest]) -> "ScheduledBatch":
        """This batch followed by `more` (a new batch; this one when `more` is empty)."""
        if not more:
            return self
        tail = ScheduledBatch.of(more)
        return ScheduledBatch(self.requests + tail.requests, np.concatenate((self.starts, tail.starts)),
                              np.concatenate((self.num_new_tokens, tail.num_new_tokens)),
                              np.concatenate((self.samples, tail.samples)), self.block_ids + tail.block_ids,
                              np.concatenate((self.host_ends, tail.host_ends)),
                              np.concatenate((self.num_blocks, tail.num_blocks)),
                              np.concatenate((self.start_tokens, tail.start_tokens)),
                              np.concatenate((self.num_drafts, tail.num_drafts)))

    @property
    def num_tokens(self) -> int:
        return int(self.num_new_tokens.sum())

    def items(self) -> list[ScheduledRequest]:
        if self._items is None:
            self._items = [ScheduledRequest(*x) for x in zip(self.requests, self.starts.tolist(),
                                                               self.num_new_tokens.tolist(), self.block_ids,
                                                               self.samples.tolist(), self.num_drafts.tolist())]
        return self._items

    def __len__(self) -> int:
        return len(self.requests)

    def __iter__(self):
        return iter(self.items())

    def __getitem__(self, i):
        return self.items()[i]


@dataclass
class ParentRequest:
    """A user's request: n > 1 completions are n scheduler requests sharing the prompt
    (and, through the prefix cache, its KV blocks)."""

    request_id: str
    children: list[Request]
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # Per child, (tokens, characters of text) already returned: DELTA outputs start there.
    sent: list[tuple[int, int]] = field(default_factory=list)
    finals_sent: set[int] = field(default_factory=set)  # children whose final output was returned
    digest: bytes = b""  # across processes: what every process must agree on (`LLMEngine._check_same_requests`)
    lora_request: Any = None  # reported on its outputs, as vLLM's
    queued_by_llm: bool = False  # by an `LLM`, which collects its outputs (not by hand, through its llm_engine)

    def __post_init__(self) -> None:
        for child in self.children:
            child.parent_id = self.request_id
        self.sent = [(0, 0)] * len(self.children)

    @property
    def finished(self) -> bool:
        return all(c.is_finished for c in self.children)

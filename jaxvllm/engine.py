"""LLMEngine: requests in, one scheduler + model step at a time, RequestOutputs out.

With async scheduling (the default, vLLM's `async_scheduling`) a step schedules and
dispatches step N+1 before it reads step N's tokens, so that the host's scheduling,
batch building and output processing run while the device computes: decoding requests
take their next input id from step N's sampled ids on the device, and a token computed
for a request that stopped meanwhile is dropped.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import numpy as np

from jaxvllm.config import EngineConfig
from jaxvllm.detokenizer import IncrementalDetokenizer
from jaxvllm.interrupts import defer_interrupts
from jaxvllm.kv_cache_manager import KVCacheManager
from jaxvllm.loader import resolve_model_dir
from jaxvllm.model_runner import ModelRunner, PendingStep, RunnerOutput
from jaxvllm.outputs import CompletionOutput, Logprob, RequestOutput
from jaxvllm.request import Request, RequestStatus
from jaxvllm.sampling_params import RequestOutputKind, SamplingParams
from jaxvllm.scheduler import Scheduler, SchedulerConfig, SchedulerOutput

logger = logging.getLogger(__name__)

_PROMPT_KEYS = {"prompt", "prompt_token_ids", "cache_salt"}


@dataclass
class ParentRequest:
    """A user's request: n > 1 completions are n scheduler requests sharing the prompt
    (and, through the prefix cache, its KV blocks)."""

    request_id: str
    children: list[Request]
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # Per child, (tokens, characters of text) already returned: DELTA outputs start there.
    sent: list[tuple[int, int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        for child in self.children:
            child.parent_id = self.request_id
        self.sent = [(0, 0)] * len(self.children)

    @property
    def finished(self) -> bool:
        return all(c.is_finished for c in self.children)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        from transformers import AutoTokenizer

        # A missing folder fails first; dummy:NAME becomes a temporary folder that lives as long as the engine.
        config, self._dummy_dir = resolve_model_dir(config)
        self.config = config
        tokenizer_path = config.tokenizer or config.model
        if config.skip_tokenizer_init:
            self.tokenizer = None  # token-id prompts only; outputs have empty text
        elif not Path(tokenizer_path).is_dir():
            raise FileNotFoundError(f"tokenizer directory {tokenizer_path!r} does not exist")
        else:
            try:
                self.tokenizer = AutoTokenizer.from_pretrained(
                    tokenizer_path, local_files_only=True, use_fast=config.tokenizer_mode != "slow"
                )
            except (OSError, ValueError) as e:
                raise ValueError(
                    f"cannot load a tokenizer from {tokenizer_path!r} (pass tokenizer=PATH to use another folder, "
                    f"or skip_tokenizer_init=True for token-id prompts only): {e}"
                ) from e
        self.runner = ModelRunner(config)
        self.model_config = self.runner.cfg
        eos = set(self.model_config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = tuple(sorted(eos))
        self.kv_cache_manager = KVCacheManager(
            self.runner.num_blocks, config.block_size, enable_prefix_caching=config.enable_prefix_caching
        )
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_model_len=self.runner.max_model_len,
                enable_chunked_prefill=config.enable_chunked_prefill,
                policy=config.scheduling_policy,
            ),
            self.kv_cache_manager,
        )
        self._in_flight: tuple[SchedulerOutput, PendingStep] | None = None  # async: the step not yet read
        self._arrivals = itertools.count()
        self._parents: dict[str, ParentRequest] = {}
        self._token_texts: dict[int, str] = {}

    # -- requests ----------------------------------------------------------------------

    def tokenize_prompt(self, prompt: Any, add_special_tokens: bool = True) -> tuple[str | None, list[int], str | None]:
        """A str, or a dict with "prompt" (str) or "prompt_token_ids" (list of ints) and an
        optional "cache_salt" -> (text, token ids, salt); raises on bad input."""
        if isinstance(prompt, dict):
            unknown = set(prompt) - _PROMPT_KEYS
            if unknown:
                raise ValueError(f"unknown prompt key(s) {sorted(unknown)}; allowed: {sorted(_PROMPT_KEYS)}")
            if ("prompt" in prompt) == ("prompt_token_ids" in prompt):
                raise ValueError("a prompt dict needs exactly one of 'prompt' or 'prompt_token_ids'")
            salt = prompt.get("cache_salt")
            if salt is not None and not isinstance(salt, str):
                raise TypeError(f"cache_salt must be a str, got {type(salt).__name__}")
            if "prompt" in prompt:
                return (*self.tokenize_prompt(prompt["prompt"], add_special_tokens)[:2], salt)
            return None, self._check_token_ids(prompt["prompt_token_ids"]), salt
        if not isinstance(prompt, str):
            raise TypeError(f"a prompt must be a str or a dict, got {type(prompt).__name__}")
        if not prompt:
            raise ValueError("the prompt is empty")
        if self.tokenizer is None:
            raise ValueError("skip_tokenizer_init=True: pass prompt_token_ids, not text")
        token_ids = self.tokenizer(prompt, add_special_tokens=add_special_tokens).input_ids
        if not token_ids:
            raise ValueError(f"the prompt {prompt!r} encodes to no tokens")
        return prompt, token_ids, None

    def _check_token_ids(self, token_ids: Any) -> list[int]:
        if not isinstance(token_ids, (list, tuple, np.ndarray)):
            raise TypeError(f"prompt_token_ids must be a list of ints, got {type(token_ids).__name__}")
        token_ids = list(token_ids)
        if not token_ids:
            raise ValueError("prompt_token_ids is empty")
        vocab = self.model_config.vocab_size
        for t in token_ids:
            if not isinstance(t, (int, np.integer)) or isinstance(t, bool) or not 0 <= t < vocab:
                raise ValueError(f"prompt token id {t!r} is not an int in [0, {vocab})")
        return [int(t) for t in token_ids]

    def make_requests(
        self, request_id: str, prompt: Any, params: SamplingParams | None, priority: int = 0,
        *, add_special_tokens: bool = True,
    ) -> ParentRequest:
        """Validate everything about a request (its n completions) without queueing it."""
        if self.runner.closed:
            raise RuntimeError("this engine was shut down; create a new LLM")
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling params must be SamplingParams, got {type(params).__name__}")
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise TypeError(f"priority must be an int, got {type(priority).__name__}")
        params.check_vocab(self.model_config.vocab_size)
        params.check_satisfiable(self.eos_token_ids)
        if self.tokenizer is None and params.stop_strings:
            raise ValueError("skip_tokenizer_init=True: stop strings need a tokenizer; use stop_token_ids")
        text, token_ids, cache_salt = self.tokenize_prompt(prompt, add_special_tokens)
        room = self.runner.max_model_len - len(token_ids)
        if room < 1:
            raise ValueError(
                f"prompt ({len(token_ids)} tokens) leaves no room to generate within max_model_len "
                f"({self.runner.max_model_len})"
            )
        # As vLLM: generation stops at max_model_len (finish reason "length"), whatever max_tokens asks.
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        self.scheduler.check_fits(len(token_ids), max_tokens)
        request_id = str(request_id)
        children = []
        for index in range(params.n):
            arrival = next(self._arrivals)
            # Each completion has its own randomness: seed + index, or a seed drawn from the engine's.
            seed = (params.seed + index) % 2**32 if params.seed is not None else (self.config.seed * 1_000_003 + arrival) % 2**32
            child_id = request_id if params.n == 1 else f"{index}_{request_id}"
            child = Request(
                child_id, token_ids, params, prompt=text, priority=priority, max_tokens=max_tokens,
                eos_token_ids=self.eos_token_ids, arrival_index=arrival, seed=seed, cache_salt=cache_salt,
            )
            if params.detokenize and self.tokenizer is not None:  # (no tokenizer: empty text)
                child.detokenizer = IncrementalDetokenizer(
                    self.tokenizer, skip_special_tokens=params.skip_special_tokens, stop=params.stop_strings,
                    include_stop_str_in_output=params.include_stop_str_in_output,
                )
            children.append(child)
        return ParentRequest(request_id, children, params.output_kind)

    def add_request(self, request_id: str, prompt: Any, params: SamplingParams | None = None, priority: int = 0) -> None:
        self.add_parent(self.make_requests(request_id, prompt, params, priority))

    def add_parent(self, parent: ParentRequest) -> None:
        """Queue all of a request's completions, or (on any error) none of them."""
        for rid in (parent.request_id, *(c.request_id for c in parent.children)):
            if rid in self._parents or rid in self.scheduler.requests:
                raise ValueError(f"request id {rid!r} is already in use")
        with defer_interrupts():
            added = []
            try:
                for child in parent.children:
                    self.scheduler.add_request(child)
                    added.append(child)
            except BaseException:
                for child in added:
                    self.scheduler.finish(child, "abort")
                raise
            self._parents[parent.request_id] = parent

    def abort_request(self, request_ids: str | Iterable[str]) -> list[RequestOutput]:
        """Stop requests now and free their blocks; unknown or finished ids are ignored."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        with defer_interrupts():
            return self._abort(ids)

    def _abort(self, ids: list[str]) -> list[RequestOutput]:
        outputs = []
        for rid in ids:
            parent = self._parents.pop(rid, None)
            if parent is None:
                continue
            for child in parent.children:
                if not child.is_finished:
                    self.scheduler.finish(child, "abort")
            self.runner.release(c.request_id for c in parent.children)
            outputs.append(self._output(parent))
        if not self.scheduler.has_unfinished_requests():
            self._in_flight = None  # its tokens are for aborted requests only: never read
        return outputs

    @classmethod
    def from_engine_args(cls, engine_args: EngineConfig) -> "LLMEngine":
        """vLLM's constructor from `EngineArgs` (an `EngineConfig`)."""
        return cls(engine_args)

    def get_num_unfinished_requests(self) -> int:
        """Requests added and not yet finished (a request with n > 1 counts once)."""
        return len(self._parents)

    def has_unfinished_requests(self) -> bool:
        """Requests to finish, or a dispatched step still to read."""
        return self.scheduler.has_unfinished_requests() or self._in_flight is not None

    # -- one step ----------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule and dispatch a step, read the tokens of the step before (async) or of
        this one, and return outputs of the requests that got new tokens, as their
        `output_kind` asks (FINAL_ONLY: only when finished).

        A failed or interrupted step changes nothing a later step could notice: the
        bookkeeping runs with Ctrl-C held back (`defer_interrupts`), so an interrupt lands
        only while the host waits for the device; after any exception, `_recover` puts
        every running request back to be recomputed, then the exception propagates.
        """
        if self.runner.closed:
            raise RuntimeError("this engine was shut down; create a new LLM")
        try:
            with defer_interrupts():
                out = self.scheduler.schedule()
                self.runner.release(r.request_id for r in out.preempted)
                launched = (out, self.runner.execute(out.scheduled)) if out.scheduled else None
                self.kv_cache_manager.commit()  # dispatched: the blocks it registered will be written
                if self.config.async_scheduling:
                    launched, self._in_flight = self._in_flight, launched
            if launched is None:
                return []
            result = launched[1].result()  # waits for the device
            with defer_interrupts():
                return self._process(launched[0], result)
        except BaseException:
            with defer_interrupts():
                self._recover()
            raise

    def _recover(self) -> None:
        """Bring the engine back to a state every later step can trust: the step in flight
        is dropped, blocks registered for a step that never ran are forgotten, running
        requests are recomputed from their tokens on the host, and donated buffers a
        failed call consumed are made anew (the prefix cache too, if the KV cache was)."""
        self._in_flight = None
        self.kv_cache_manager.rollback()
        self.scheduler.recompute_all()
        if self.runner.recover():
            self.kv_cache_manager.reset_prefix_cache()

    def _process(self, out: SchedulerOutput, result: RunnerOutput) -> list[RequestOutput]:
        """Append a step's tokens and apply the stop checks; the outputs to return."""
        updated = self.scheduler.update_from_output(out, result.sampled)
        if result.logprobs is not None or result.prompt_logprobs is not None:
            self._record_logprobs(out.scheduled, result, set(map(id, updated)))
        finished = []
        for request in updated:
            if request.has_stop_strings:
                self._detokenize(request)
            if request.status is RequestStatus.FINISHED:
                finished.append(request.request_id)
        self.runner.release(finished)

        outputs, seen, final_only = [], set(), RequestOutputKind.FINAL_ONLY
        for request in updated:
            parent = self._parents.get(request.parent_id)
            if parent is None or parent.request_id in seen:
                continue
            if parent.output_kind is final_only and request.status is not RequestStatus.FINISHED:
                continue  # its parent is not finished either
            seen.add(parent.request_id)
            if parent.finished:
                del self._parents[parent.request_id]
                outputs.append(self._output(parent))
            elif parent.output_kind is not final_only:
                outputs.append(self._output(parent))
        return outputs

    def _detokenize(self, request: Request) -> None:
        """Bring the text up to date with the tokens; a stop string ends the completion.

        Requests with stop strings are detokenized every step (to stop in time); others
        only when their text is read, so `generate` decodes each completion once.
        """
        new = request.output_token_ids[request.num_detokenized :]
        if request.detokenizer is None or not new:
            return
        request.num_detokenized += len(new)
        # vLLM looks for stop strings only once more than min_tokens tokens exist.
        stop = request.detokenizer.update(new, check_stop=request.num_output_tokens > request.params.min_tokens)
        if stop is None:
            return
        if not request.is_finished:
            self.scheduler.finish(request, "stop")
        request.finish_reason, request.stop_reason = "stop", stop

    def _record_logprobs(self, scheduled, result, updated_ids: set[int]) -> None:
        if result.logprobs is not None:
            lp = result.logprobs
            for i, s in enumerate(scheduled):
                request = s.request
                if request.logprobs is None or id(request) not in updated_ids:
                    continue
                token = request.token_ids[-1]
                request.logprobs.append(self._logprob_dict(
                    token, lp.token_logprob[i], lp.token_rank[i], lp.top_ids[i], lp.top_logprobs[i],
                    request.params.logprobs, request.params.detokenize,
                ))
                request.cumulative_logprob += float(lp.token_logprob[i])
        if result.prompt_logprobs is not None:
            lp = result.prompt_logprobs
            for row, (i, pos) in enumerate(result.prompt_positions):
                request = scheduled[i].request
                request.prompt_logprobs[pos] = self._logprob_dict(
                    request.prompt_token_ids[pos], lp.token_logprob[row], lp.token_rank[row], lp.top_ids[row],
                    lp.top_logprobs[row], request.params.prompt_logprobs, request.params.detokenize,
                )

    def _logprob_dict(self, token, logprob, rank, top_ids, top_logprobs, k, detokenize: bool) -> dict[int, Logprob]:
        """vLLM's format: the chosen token first, then the top k (rank order); each token's
        text only when the request detokenizes (else None, as vLLM)."""
        decode = self._token_text if detokenize and self.tokenizer is not None else lambda _: None
        entry = {int(token): Logprob(float(logprob), int(rank), decode(int(token)))}
        for j in range(k):
            t = int(top_ids[j])
            if t not in entry:
                entry[t] = Logprob(float(top_logprobs[j]), j + 1, decode(t))
        return entry

    def _token_text(self, token_id: int) -> str:
        """A token's text alone, cached: logprobs name up to 21 tokens per row per step."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.tokenizer.decode([token_id])
        return text

    def _output(self, parent: ParentRequest) -> RequestOutput:
        """The parent's RequestOutput: everything so far, or (DELTA) what is new since the
        last one. Until a completion finishes its text holds back a trailing U+FFFD (the
        start of a character the next token may complete), as vLLM's does."""
        delta = parent.output_kind == RequestOutputKind.DELTA
        completions = []
        for i, child in enumerate(parent.children):
            self._detokenize(child)
            text = child.detokenizer.text if child.detokenizer is not None else ""
            if not child.is_finished:
                text = text.rstrip("\ufffd")
            tokens, logprobs = child.output_token_ids, child.logprobs
            if delta:
                sent_tokens, sent_chars = parent.sent[i]
                tokens = tokens[sent_tokens:]
                logprobs = logprobs[sent_tokens:] if logprobs is not None else None
                parent.sent[i] = (sent_tokens + len(tokens), len(text))
                text = text[sent_chars:]
            completions.append(CompletionOutput(
                index=i,
                text=text,
                token_ids=tokens,
                cumulative_logprob=child.cumulative_logprob,
                logprobs=logprobs,
                finish_reason=child.finish_reason if child.is_finished else None,
                stop_reason=child.stop_reason,
            ))
        first = parent.children[0]
        return RequestOutput(
            request_id=parent.request_id,
            prompt=first.prompt,
            prompt_token_ids=first.prompt_token_ids,
            outputs=completions,
            finished=parent.finished,
            num_cached_tokens=first.num_cached_tokens or 0,
            metrics=first.metrics,
            prompt_logprobs=first.prompt_logprobs,
        )

    def stats(self) -> dict:
        return {
            "num_gpu_blocks": self.runner.num_blocks,
            "num_free_blocks": self.kv_cache_manager.num_free_blocks,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_compiled_buckets": self.runner.num_compiled_buckets(),
            "num_compiled_sampler_variants": self.runner.num_compiled_sampler_variants(),
            "block_table_widths": list(self.runner.widths),
            "async_scheduling": self.config.async_scheduling,
            "token_buckets": list(self.runner.buckets),
            "warmup_seconds": self.runner.warmup_seconds,
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "prefix_cache_queries": self.kv_cache_manager.stats.queries,
            "prefix_cache_hits": self.kv_cache_manager.stats.hits,
            "prefix_cache_hit_rate": self.kv_cache_manager.stats.hit_rate,
        }

    def reset_prefix_cache(self) -> bool:
        self.kv_cache_manager.reset_prefix_cache()
        return True

    def shutdown(self) -> None:
        """Abort every request and free the device memory (weights, KV cache, sampler state)."""
        self.abort_request(list(self._parents))
        self.runner.close()

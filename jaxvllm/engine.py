"""LLMEngine: requests in, one scheduler + model step at a time, RequestOutputs out.

With async scheduling (the default, vLLM's `async_scheduling`) a step schedules and
dispatches step N+1 before it reads step N's tokens, so that the host's scheduling,
batch building and output processing run while the device computes: decoding requests
take their next input id from step N's sampled ids on the device, and a token computed
for a request that stopped meanwhile is dropped.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import jax
import numpy as np

from jaxvllm.config import EngineConfig
from jaxvllm.detokenizer import IncrementalDetokenizer
from jaxvllm.interrupts import defer_interrupts
from jaxvllm.kv_cache_manager import KVCacheManager
from jaxvllm.loader import resolve_model_dir
from jaxvllm.metrics import Metric, MetricsCollector
from jaxvllm.model_runner import ModelRunner, PendingStep, RunnerOutput
from jaxvllm.outputs import CompletionOutput, Logprob, RequestOutput
from jaxvllm.request import Request, RequestStatus
from jaxvllm.sampler import MAX_BAD_WORD_TOKENS, MAX_BAD_WORDS
from jaxvllm.sampling_params import RequestOutputKind, SamplingParams
from jaxvllm.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from jaxvllm.sharding import gather_over_processes
from jaxvllm.structured_output import StructuredOutputManager

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
    digest: bytes = b""  # across processes: what every process must agree on (see `_check_same_requests`)

    def __post_init__(self) -> None:
        for child in self.children:
            child.parent_id = self.request_id
        self.sent = [(0, 0)] * len(self.children)

    @property
    def finished(self) -> bool:
        return all(c.is_finished for c in self.children)


# Where compiled steps are cached between runs, unless the user set jax_compilation_cache_dir.
DEFAULT_COMPILATION_CACHE = os.path.join("~", ".cache", "jaxvllm", "jax")


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        from transformers import AutoTokenizer

        if jax.config.jax_compilation_cache_dir is None:  # the user's own setting wins
            jax.config.update("jax_compilation_cache_dir", os.path.expanduser(DEFAULT_COMPILATION_CACHE))
            # Small models compile in under JAX's default 1 s threshold; cache them too.
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)

        names = config.served_model_name
        model_name = (names if isinstance(names, str) else names[0]) if names else config.model  # as vLLM's
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
        # for get_metrics(); vLLM labels each data-parallel replica
        self.metrics = MetricsCollector(model_name, self.runner.max_model_len, engine=str(config.data_parallel_rank))
        self._in_flight: tuple[SchedulerOutput, PendingStep] | None = None  # async: the step not yet read
        self._arrivals = itertools.count()
        self._parents: dict[str, ParentRequest] = {}
        self._token_texts: dict[int, str] = {}
        # Across processes (jax.distributed) each one schedules for itself: the requests are
        # compared once they change, before the next step.
        self._multiprocess = jax.process_count() > 1
        self._requests_changed = False
        self.structured_outputs = None if self.tokenizer is None else StructuredOutputManager(
            self.tokenizer, self.model_config.vocab_size, config.structured_outputs_config, wait=self._multiprocess)

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
            raise ValueError("The decoder prompt cannot be empty")  # vLLM's words, here and below
        if self.tokenizer is None:
            raise ValueError("skip_tokenizer_init=True: pass prompt_token_ids, not text")
        token_ids = self.tokenizer(prompt, add_special_tokens=add_special_tokens).input_ids
        if not token_ids:
            raise ValueError(f"The decoder prompt cannot be empty (the text {prompt!r} encodes to no tokens)")
        return prompt, token_ids, None

    def _check_token_ids(self, token_ids: Any) -> list[int]:
        if not isinstance(token_ids, (list, tuple, np.ndarray)):
            raise TypeError(f"prompt_token_ids must be a list of ints, got {type(token_ids).__name__}")
        token_ids = list(token_ids)
        if not token_ids:
            raise ValueError("The decoder prompt cannot be empty (prompt_token_ids is [])")
        vocab = self.model_config.vocab_size
        for t in token_ids:
            if not isinstance(t, (int, np.integer)) or isinstance(t, bool):
                raise ValueError(f"prompt token ids must be ints, got {t!r}")
            if not 0 <= t < vocab:
                raise ValueError(f"Token id {t} is out of vocabulary (the model's ids are 0 to {vocab - 1})")
        return [int(t) for t in token_ids]

    def check_prompt_length(self, num_tokens: int) -> None:
        """A prompt must leave room for one generated token (vLLM's words, its server's)."""
        max_model_len = self.runner.max_model_len
        if num_tokens >= max_model_len:
            raise ValueError(
                f"You passed {num_tokens} input tokens and requested 1 output tokens. However, the model's "
                f"context length is only {max_model_len} tokens, resulting in a maximum input length of "
                f"{max_model_len - 1} tokens. Please reduce the length of the input prompt."
            )

    def bad_words_token_ids(self, words: list[str]) -> list[list[int]]:
        """vLLM's tokenization of bad words: each word alone and after a space (when the
        space makes a different first token of the same length), without special tokens."""
        if self.tokenizer is None:
            raise ValueError("skip_tokenizer_init=True: bad_words need a tokenizer")
        sequences: list[list[int]] = []
        for word in words:
            plain = self.tokenizer.encode(word.lstrip(), add_special_tokens=False)
            if not plain:
                raise ValueError("bad_words entries must tokenize to at least one token.")
            sequences.append(plain)
            spaced = self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
                sequences.append(spaced)
        if len(sequences) > MAX_BAD_WORDS:
            raise ValueError(f"Too many bad words after tokenization: {len(sequences)}. The max number is {MAX_BAD_WORDS}.")
        longest = max(sequences, key=len)
        if len(longest) > MAX_BAD_WORD_TOKENS:
            raise ValueError(
                f"bad word {self.tokenizer.decode(longest)!r} is {len(longest)} tokens; at most "
                f"{MAX_BAD_WORD_TOKENS} are supported"
            )
        return sequences

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
        vocab, max_model_len = self.model_config.vocab_size, self.runner.max_model_len
        params.check_supported(self.config.max_logprobs, vocab)
        params.check_vocab(vocab)
        params.check_satisfiable(self.eos_token_ids)
        if self.tokenizer is None and params.stop_strings:
            raise ValueError("skip_tokenizer_init=True: stop strings need a tokenizer; use stop_token_ids")
        if self.tokenizer is None and params.structured_outputs is not None:
            raise ValueError("Structured outputs requires a tokenizer so it can't be used with 'skip_tokenizer_init'")
        bad_words = self.bad_words_token_ids(params.bad_words) if params.bad_words else []
        text, token_ids, cache_salt = self.tokenize_prompt(prompt, add_special_tokens)
        keep = params.truncate_prompt_tokens
        if keep is not None:  # vLLM truncates on the left: the last tokens stay
            keep = max_model_len - 1 if keep == -1 else keep
            if keep > max_model_len:
                raise ValueError(
                    f"truncate_prompt_tokens value ({keep}) is greater than max_model_len ({max_model_len}). "
                    "Please, select a smaller truncation size."
                )
            token_ids = token_ids[-keep:]
        self.check_prompt_length(len(token_ids))
        room = max_model_len - len(token_ids)
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
                vocab_size=vocab, bad_words_token_ids=bad_words,
            )
            if params.detokenize and self.tokenizer is not None:  # (no tokenizer: empty text)
                child.detokenizer = IncrementalDetokenizer(
                    self.tokenizer, skip_special_tokens=params.skip_special_tokens, stop=params.stop_strings,
                    include_stop_str_in_output=params.include_stop_str_in_output,
                    spaces_between_special_tokens=params.spaces_between_special_tokens,
                )
            if params.structured_outputs is not None:  # (checked, and compiled once per spec)
                child.grammar = self.structured_outputs.grammar(params.structured_outputs)
            children.append(child)
        parent = ParentRequest(request_id, children, params.output_kind)
        if self._multiprocess:
            parent.digest = hashlib.blake2b(repr((request_id, token_ids, priority, params, [c.seed for c in children]))
                                            .encode(), digest_size=8).digest()
        return parent

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
            self._requests_changed = True

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
                    self.metrics.record_finished(child)
            self.metrics.record_parent_finished(parent.children)
            self.runner.release(c.request_id for c in parent.children)
            outputs.append(self._output(parent))
            self._requests_changed = True
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
        if self._requests_changed:
            self._check_same_requests()
        try:
            with defer_interrupts():
                out = self.scheduler.schedule()
                self.runner.release(r.request_id for r in out.preempted)
                launched = (out, self.runner.execute(out.scheduled)) if out.scheduled else None
                self.kv_cache_manager.commit()  # dispatched: the blocks it registered will be written
                if self.config.async_scheduling:
                    launched, self._in_flight = self._in_flight, launched
                    if launched is None:  # nothing to read first: the step in flight samples now
                        self._sample_constrained()
                else:
                    self._sample_constrained(launched)
            if launched is None:
                return []
            result = launched[1].result()  # waits for the device
            with defer_interrupts():
                outputs = self._process(launched[0], result, launched[1].batch.grammar_rows)
                self._sample_constrained()
                return outputs
        except BaseException:
            with defer_interrupts():
                self._recover()
            raise

    def _sample_constrained(self, launched: tuple[SchedulerOutput, PendingStep] | None = None) -> None:
        """Sample a step with structured-output rows (default: the one in flight), whose
        forward is already dispatched: their bitmasks need every token before, so under
        async scheduling the sampler waits until the step before was read (vLLM's order:
        the forward still overlaps the host's work, the sampling does not)."""
        launched = launched or self._in_flight
        if launched is None or not launched[1].awaits_bitmask:
            return
        step = launched[1]
        mask = self.structured_outputs.bitmask(step.batch.grammar_rows, step.batch.layout.num_rows)
        self.runner.sample(step, mask)

    def _check_same_requests(self) -> None:
        """Across processes every process runs this same engine and the steps are collective:
        processes holding different requests would dispatch different steps, so they are
        compared here (one host collective, only after requests were added or aborted)."""
        self._requests_changed = False
        if not self._multiprocess:
            return
        digest = hashlib.blake2b(b"".join(p.digest for p in self._parents.values()), digest_size=8).digest()
        digests = gather_over_processes(int.from_bytes(digest, "little", signed=True))
        if len(set(digests)) > 1:
            raise RuntimeError(
                f"the {len(digests)} processes hold different requests: under jax.distributed every process "
                "must add the same requests (same prompts, parameters and order); nothing was run"
            )

    def _recover(self) -> None:
        """Bring the engine back to a state every later step can trust: the step in flight
        is dropped, blocks registered for a step that never ran are forgotten, running
        requests are recomputed from their tokens on the host, and donated buffers a
        failed call consumed are made anew (the prefix cache too, if the KV cache was)."""
        self._in_flight = None
        self.kv_cache_manager.rollback()
        self.scheduler.recompute_all()
        if self.runner.recover():
            self.reset_prefix_cache()

    def _process(self, out: SchedulerOutput, result: RunnerOutput, grammar_rows=()) -> list[RequestOutput]:
        """Append a step's tokens and apply the stop checks; the outputs to return.
        `grammar_rows`: the step's (scheduled index, grammar) of structured-output rows."""
        now = time.time()  # when the host has this step's tokens (the scheduler stamps first tokens too)
        ended = self._end_dead_ends(out, grammar_rows)
        updated = self.scheduler.update_from_output(out, result.sampled)
        self.metrics.record_step(updated, now)
        if result.logprobs is not None or result.prompt_logprobs is not None:
            self._record_logprobs(out.scheduled, result, set(map(id, updated)))
        finished = []
        for request in updated:
            if request.has_stop_strings:
                self._detokenize(request)
            if request.status is RequestStatus.FINISHED:
                finished.append(request.request_id)
                self.metrics.record_finished(request)  # its finish reason is final: stop strings were checked
        self.runner.release(finished + [r.request_id for r in ended])

        outputs, seen, final_only = [], set(), RequestOutputKind.FINAL_ONLY
        for request in updated + ended:
            parent = self._parents.get(request.parent_id)
            if parent is None or parent.request_id in seen:
                continue
            if parent.output_kind is final_only and request.status is not RequestStatus.FINISHED:
                continue  # its parent is not finished either
            seen.add(parent.request_id)
            if parent.finished:
                del self._parents[parent.request_id]
                self.metrics.record_parent_finished(parent.children)
                outputs.append(self._output(parent))
            elif parent.output_kind is not final_only:
                outputs.append(self._output(parent))
        return outputs

    def _end_dead_ends(self, out: SchedulerOutput, grammar_rows) -> list[Request]:
        """Finish the requests of this step whose grammar the model's vocabulary cannot go on
        with (their mask allowed only ids the tokenizer alone has): before their tokens are
        appended, so the token each row sampled without a constraint is dropped."""
        ended = []
        for i, grammar in grammar_rows:
            request = out.scheduled[i].request
            if not grammar.dead_end or request.is_finished:
                continue
            reason = grammar.dead_end_reason
            if reason == "abort":
                logger.warning("request %s: its grammar allows only token ids past the model's vocabulary (%d) "
                               "next; ended", request.request_id, self.model_config.vocab_size)
            self.scheduler.finish(request, reason)
            self.metrics.record_finished(request)
            ended.append(request)
        return ended

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
                    request.num_logprobs, request.params.detokenize,
                ))
                request.cumulative_logprob += float(lp.token_logprob[i])
        if result.prompt_logprobs is not None:
            lp = result.prompt_logprobs
            for row, (i, pos) in enumerate(result.prompt_positions):
                request = scheduled[i].request
                request.prompt_logprobs[pos] = self._logprob_dict(
                    request.prompt_token_ids[pos], lp.token_logprob[row], lp.token_rank[row], lp.top_ids[row],
                    lp.top_logprobs[row], request.num_prompt_logprobs, request.params.detokenize,
                )

    def _logprob_dict(self, token, logprob, rank, top_ids, top_logprobs, k, detokenize: bool) -> dict[int, Logprob]:
        """vLLM's format: the chosen token first, then the top k (rank order); each token's
        text only when the request detokenizes (else None, as vLLM)."""
        decode = self._token_text if detokenize and self.tokenizer is not None else lambda _: None
        entry = {int(token): Logprob(float(logprob), int(rank), decode(int(token)))}
        for j in range(min(k, len(top_ids))):
            t = int(top_ids[j])
            if t not in entry:
                entry[t] = Logprob(float(top_logprobs[j]), j + 1, decode(t))
        return entry

    def _token_text(self, token_id: int) -> str:
        """A token's text alone, cached: logprobs name up to max_logprobs + 1 tokens per row per step."""
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
        so = self.structured_outputs
        return {
            "num_gpu_blocks": self.runner.num_blocks,
            "tensor_parallel_size": len(self.runner.devices),
            "kv_cache_per_device": self.runner.kv_cache_per_device(),  # blocks and bytes on each device
            "kv_cache_dtype": self.runner.kv_cache_dtype_name,  # e.g. "bfloat16", "float8_e4m3fn"
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
            # host time spent filling structured-output bitmasks, and the steps that needed one
            "structured_output_mask_seconds": so.mask_seconds if so else 0.0,
            "structured_output_mask_steps": so.mask_steps if so else 0,
        }

    def get_metrics(self) -> list[Metric]:
        """vLLM's `LLMEngine.get_metrics()`: every metric now, with vLLM's names and labels
        (see jaxvllm/metrics.py); gauges are the scheduler's state at this moment."""
        kv = self.kv_cache_manager
        return self.metrics.snapshot(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_cache_usage=1 - kv.num_free_blocks / kv.pool.num_blocks,
            num_preemptions=self.scheduler.num_preemptions,
            prefix_cache=kv.stats,
        )

    def reset_prefix_cache(self) -> bool:
        self.metrics.track_prefix_cache(self.kv_cache_manager.stats)  # (the reset starts new stats)
        self.kv_cache_manager.reset_prefix_cache()
        return True

    def shutdown(self) -> None:
        """Abort every request and free the device memory (weights, KV cache, sampler state)."""
        self.abort_request(list(self._parents))
        self.runner.close()
        if self.structured_outputs is not None:
            self.structured_outputs.shutdown()

"""LLMEngine: requests in, one scheduler + model step at a time, RequestOutputs out."""

from __future__ import annotations

import itertools
import logging
from typing import Any, Iterable

import numpy as np

from jaxvllm.config import EngineConfig
from jaxvllm.kv_cache_manager import KVCacheManager
from jaxvllm.model_runner import ModelRunner
from jaxvllm.outputs import CompletionOutput, RequestOutput
from jaxvllm.request import Request
from jaxvllm.sampling_params import SamplingParams
from jaxvllm.scheduler import Scheduler, SchedulerConfig

logger = logging.getLogger(__name__)

_PROMPT_KEYS = {"prompt", "prompt_token_ids", "cache_salt"}


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        from transformers import AutoTokenizer

        self.config = config
        tokenizer_path = config.tokenizer or config.model
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_path, local_files_only=True)
        except (OSError, ValueError) as e:
            raise ValueError(
                f"cannot load a tokenizer from {tokenizer_path!r} (pass tokenizer=PATH to use another folder): {e}"
            ) from e
        self.runner = ModelRunner(config)
        self.model_config = self.runner.cfg
        eos = set(self.model_config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
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
        self._arrivals = itertools.count()

    # -- requests ----------------------------------------------------------------------

    def tokenize_prompt(self, prompt: Any) -> tuple[str | None, list[int], str | None]:
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
                return (*self.tokenize_prompt(prompt["prompt"])[:2], salt)
            return None, self._check_token_ids(prompt["prompt_token_ids"]), salt
        if not isinstance(prompt, str):
            raise TypeError(f"a prompt must be a str or a dict, got {type(prompt).__name__}")
        if not prompt:
            raise ValueError("the prompt is empty")
        token_ids = self.tokenizer(prompt).input_ids
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

    def make_request(self, request_id: str, prompt: Any, params: SamplingParams | None, priority: int = 0) -> Request:
        """Validate everything about a request without queueing it."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling params must be SamplingParams, got {type(params).__name__}")
        if not isinstance(priority, int):
            raise TypeError(f"priority must be an int, got {type(priority).__name__}")
        text, token_ids, cache_salt = self.tokenize_prompt(prompt)
        max_tokens = params.max_tokens
        if max_tokens is None:
            max_tokens = self.runner.max_model_len - len(token_ids)
            if max_tokens < 1:
                raise ValueError(
                    f"prompt ({len(token_ids)} tokens) leaves no room to generate within max_model_len "
                    f"({self.runner.max_model_len})"
                )
        self.scheduler.check_fits(len(token_ids), max_tokens)
        arrival = next(self._arrivals)
        return Request(
            str(request_id), token_ids, params, prompt=text, priority=priority, max_tokens=max_tokens,
            eos_token_ids=self.eos_token_ids, arrival_index=arrival,
            seed=(self.config.seed * 1_000_003 + arrival) % 2**32, cache_salt=cache_salt,
        )

    def add_request(self, request_id: str, prompt: Any, params: SamplingParams | None = None, priority: int = 0) -> None:
        self.scheduler.add_request(self.make_request(request_id, prompt, params, priority))

    def add_requests(self, requests: Iterable[Request]) -> None:
        for request in requests:
            self.scheduler.add_request(request)

    def abort_request(self, request_ids: str | Iterable[str]) -> list[RequestOutput]:
        """Stop requests now and free their blocks; unknown or finished ids are ignored."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        outputs = []
        for rid in ids:
            request = self.scheduler.requests.get(rid)
            if request is not None:
                self.scheduler.finish(request, "abort")
                outputs.append(self._output(request))
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # -- one step ----------------------------------------------------------------------

    def step(self, final_only: bool = False) -> list[RequestOutput]:
        """Schedule, run the model once, and return the requests that got a new token.

        final_only: return only finished requests (what `LLM.generate` keeps), which
        skips detokenizing every running request at every step.
        """
        out = self.scheduler.schedule()
        sampled = self.runner.execute(out.scheduled)
        updated = self.scheduler.update_from_output(out, sampled)
        return [self._output(r) for r in updated if r.is_finished or not final_only]

    def _output(self, request: Request) -> RequestOutput:
        token_ids = request.output_token_ids
        completion = CompletionOutput(
            index=0,
            text=self.tokenizer.decode(token_ids, skip_special_tokens=True),
            token_ids=token_ids,
            finish_reason=request.finish_reason if request.is_finished else None,
            stop_reason=request.stop_reason,
        )
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=[completion],
            finished=request.is_finished,
            num_cached_tokens=request.num_cached_tokens or 0,
            metrics=request.metrics,
        )

    def stats(self) -> dict:
        return {
            "num_gpu_blocks": self.runner.num_blocks,
            "num_free_blocks": self.kv_cache_manager.num_free_blocks,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_compiled_buckets": self.runner.num_compiled_buckets(),
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

"""What the engine returns: vLLM's RequestOutput and CompletionOutput."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from jaxvllm.logprobs import Logprob


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None  # "stop", "length", "abort" or None while running
    stop_reason: int | str | None = None  # the stop token id or string, None for EOS
    lora_request: Any = None  # the request's LoRARequest (None: the base model)

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Wall-clock times (time.time()) of a request's milestones."""

    arrival_time: float
    queued_time: float | None = None  # when the engine queued it (an `arrival_time` given may be earlier)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None


@dataclass(eq=False)
class RequestOutput:
    """vLLM's, its fields in vLLM's order (positional construction means the same); the
    encoder and multi-modal ones are always empty here. Compared and hashed by identity,
    as vLLM's plain class is (sets and dict keys of outputs work)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[dict[int, Logprob] | None] | None = field(repr=False)
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    lora_request: Any = None  # the request's LoRARequest (None: the base model)
    encoder_prompt: str | None = None
    encoder_prompt_token_ids: list[int] | None = None
    num_cached_tokens: int | None = None
    multi_modal_placeholders: dict = field(default_factory=dict, kw_only=True, repr=False)
    kv_transfer_params: dict[str, Any] | None = field(default=None, kw_only=True, repr=False)

    def add(self, next_output: RequestOutput, aggregate: bool) -> None:
        """vLLM's: merge a later output of the same request into this one; `aggregate`
        appends DELTA completions to theirs, else each replaces its own."""
        self.finished |= next_output.finished
        self.kv_transfer_params = next_output.kv_transfer_params
        for new in next_output.outputs:
            for i, completion in enumerate(self.outputs):
                if completion.index != new.index:
                    continue
                if aggregate:
                    completion.text += new.text
                    if not isinstance(completion.token_ids, list):
                        completion.token_ids = list(completion.token_ids)
                    completion.token_ids.extend(new.token_ids)  # (in place, as vLLM's)
                    if new.logprobs:
                        completion.logprobs.extend(new.logprobs)
                    completion.cumulative_logprob = new.cumulative_logprob
                    completion.finish_reason, completion.stop_reason = new.finish_reason, new.stop_reason
                else:
                    self.outputs[i] = new
                break
            else:
                self.outputs.append(new)

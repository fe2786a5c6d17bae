"""SamplingParams: vLLM's names, defaults and ranges, validated when built."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

# Like vLLM's default `max_logprobs`: the top-k logprobs arrays have this fixed width on device.
MAX_LOGPROBS = 20


class RequestOutputKind(enum.Enum):
    """What `LLMEngine.step()` returns for a request (vLLM's names)."""

    CUMULATIVE = 0  # everything so far, at every step with a new token
    DELTA = 1  # only what is new since the last output
    FINAL_ONLY = 2  # one output, when the request finishes


@dataclass
class SamplingParams:
    """How to sample a request's completions (vLLM's `SamplingParams`).

    Processing order on device (as vLLM V1): logit_bias / allowed_token_ids / min_tokens
    masks, penalties, temperature, min_p, top_k, top_p; then sample (per-request seeded)
    or argmax when temperature is 0. Logprobs are of the raw model logits.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    detokenize: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    stop_strings: list[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        _check_int("n", self.n, low=1)
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ValueError(f"output_kind must be a RequestOutputKind, got {self.output_kind!r}")
        _check_number("temperature", self.temperature, low=0.0)
        _check_number("top_p", self.top_p, low=0.0, high=1.0, low_open=True)
        _check_int("top_k", self.top_k, low=-1)
        _check_number("min_p", self.min_p, low=0.0, high=1.0)
        _check_number("presence_penalty", self.presence_penalty, low=-2.0, high=2.0)
        _check_number("frequency_penalty", self.frequency_penalty, low=-2.0, high=2.0)
        _check_number("repetition_penalty", self.repetition_penalty, low=0.0, low_open=True)
        if self.seed is not None:
            _check_int("seed", self.seed, low=0, high=2**32 - 1)
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, low=1)
        _check_int("min_tokens", self.min_tokens, low=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _check_int(name, value, low=0, high=MAX_LOGPROBS)
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        if stop and not self.detokenize:
            raise ValueError("stop strings need detokenize=True")
        self.stop_strings = stop
        self.stop_token_ids = _token_ids("stop_token_ids", self.stop_token_ids or [])
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = _token_ids("allowed_token_ids", self.allowed_token_ids)
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must not be empty")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(f"logit_bias must be a dict of token id -> bias, got {type(self.logit_bias).__name__}")
            _token_ids("logit_bias keys", list(self.logit_bias))
            for bias in self.logit_bias.values():
                _check_number("logit_bias values", bias, low=-100.0, high=100.0)
            self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def uses_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    def check_vocab(self, vocab_size: int) -> None:
        """Token ids must exist in the model: checked when a request is added."""
        for name in ("stop_token_ids", "allowed_token_ids"):
            for t in getattr(self, name) or ():
                if t >= vocab_size:
                    raise ValueError(f"{name}: token id {t} is out of range [0, {vocab_size})")
        for t in self.logit_bias or {}:
            if t >= vocab_size:
                raise ValueError(f"logit_bias: token id {t} is out of range [0, {vocab_size})")


def _check_number(name, value, *, low=None, high=None, low_open=False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    below = value <= low if low_open else value < low if low is not None else False
    if below or (high is not None and value > high):
        lo = "-inf" if low is None else f"{low}"
        hi = "inf" if high is None else f"{high}"
        raise ValueError(f"{name} must be in {'(' if low_open else '['}{lo}, {hi}], got {value!r}")


def _check_int(name, value, *, low=None, high=None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {value!r}")
    _check_number(name, value, low=low, high=high)


def _token_ids(name: str, ids) -> list[int]:
    ids = list(ids)
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, int) or t < 0:
            raise ValueError(f"{name} must be non-negative token ids, got {t!r}")
    return ids

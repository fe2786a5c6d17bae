"""SamplingParams: vLLM's names, defaults and ranges, validated when built."""

from __future__ import annotations

import enum
import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass

# Like vLLM's default `max_logprobs`: the top-k logprobs arrays have this fixed width on device.
MAX_LOGPROBS = 20

# Sampling floats go to device as float32: a larger magnitude would become inf there.
_FLOAT32_MAX = 3.4028234663852886e38


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

    def __post_init__(self) -> None:
        # Numbers may be Python or numpy scalars (not bools); they are stored as Python int/float.
        self.n = _check_int("n", self.n, low=1)
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ValueError(f"output_kind must be a RequestOutputKind, got {self.output_kind!r}")
        self.temperature = _check_number("temperature", self.temperature, low=0.0)
        self.top_p = _check_number("top_p", self.top_p, low=0.0, high=1.0, low_open=True)
        self.top_k = _check_int("top_k", self.top_k, low=-1)
        self.min_p = _check_number("min_p", self.min_p, low=0.0, high=1.0)
        self.presence_penalty = _check_number("presence_penalty", self.presence_penalty, low=-2.0, high=2.0)
        self.frequency_penalty = _check_number("frequency_penalty", self.frequency_penalty, low=-2.0, high=2.0)
        self.repetition_penalty = _check_number("repetition_penalty", self.repetition_penalty, low=0.0, low_open=True)
        if self.seed is not None:
            self.seed = _check_int("seed", self.seed, low=0, high=2**32 - 1)
        if self.max_tokens is not None:
            self.max_tokens = _check_int("max_tokens", self.max_tokens, low=1)
        self.min_tokens = _check_int("min_tokens", self.min_tokens, low=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, _check_int(name, value, low=0, high=MAX_LOGPROBS))
        if self.stop is not None and not isinstance(self.stop, (str, list, tuple)):
            raise ValueError(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        stop = self.stop_strings
        if not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        if stop and not self.detokenize:
            raise ValueError("stop strings need detokenize=True")
        self.stop_token_ids = _token_ids("stop_token_ids", [] if self.stop_token_ids is None else self.stop_token_ids)
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = _token_ids("allowed_token_ids", self.allowed_token_ids)
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must not be empty")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(f"logit_bias must be a dict of token id -> bias, got {type(self.logit_bias).__name__}")
            keys = _token_ids("logit_bias keys", list(self.logit_bias))
            biases = [_check_number("logit_bias values", v, low=-100.0, high=100.0) for v in self.logit_bias.values()]
            self.logit_bias = dict(zip(keys, biases))

    @property
    def stop_strings(self) -> list[str]:
        """`stop` as a list. The engine reads it (like every field) when a request is added,
        so an assignment after construction counts, as in vLLM."""
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

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

    def check_satisfiable(self, eos_token_ids: Sequence[int]) -> None:
        """Refuse parameters that contradict each other for this model: checked when a request is added.

        While fewer than min_tokens are generated the sampler masks the stop token ids (EOS
        unless ignore_eos, and stop_token_ids); if allowed_token_ids holds nothing else, no
        token would be left to sample.
        """
        if self.min_tokens <= 0 or self.allowed_token_ids is None:
            return
        stops = set(self.stop_token_ids or ())
        if not self.ignore_eos:
            stops.update(int(t) for t in (() if eos_token_ids is None else eos_token_ids))
        if stops.issuperset(self.allowed_token_ids):
            raise ValueError(
                f"allowed_token_ids {self.allowed_token_ids} are all stop tokens, so "
                f"min_tokens={self.min_tokens} cannot be met (stop tokens are masked until then)"
            )


def _check_number(name, value, *, low=None, high=None, low_open=False) -> float:
    """A finite real number (a Python or numpy scalar, not a bool) within range, as a Python float."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number, got {value!r}")
    try:
        number = float(value)
    except OverflowError:  # a Python int too large for a float
        number = math.inf
    shown = value if isinstance(value, int) else number  # numpy scalars shown as plain floats
    if not math.isfinite(number):
        raise ValueError(f"{name} must be a finite number, got {shown!r}")
    if abs(number) > _FLOAT32_MAX:
        raise ValueError(f"{name} must be a finite number within float32 range, got {shown!r}")
    _check_range(name, number, low=low, high=high, low_open=low_open)
    return number


def _check_range(name, value, *, low=None, high=None, low_open=False) -> None:
    below = value <= low if low_open else value < low if low is not None else False
    if below or (high is not None and value > high):
        lo = "-inf" if low is None else f"{low}"
        hi = "inf" if high is None else f"{high}"
        raise ValueError(f"{name} must be in {'(' if low_open else '['}{lo}, {hi}], got {value!r}")


def _check_int(name, value, *, low=None, high=None) -> int:
    """An integer (a Python or numpy scalar, not a bool) within range, as a Python int."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an int, got {value!r}")
    value = int(value)
    _check_range(name, value, low=low, high=high)
    return value


def _token_ids(name: str, ids) -> list[int]:
    """Non-negative token ids (Python or numpy integers, not bools), as a list of Python ints."""
    ids = list(ids)
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, numbers.Integral) or t < 0:
            raise ValueError(f"{name} must be non-negative token ids, got {t!r}")
    return [int(t) for t in ids]

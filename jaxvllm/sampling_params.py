"""SamplingParams: vLLM's names and defaults, validated when built."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    """How to sample one request's completion (vLLM's `SamplingParams`).

    temperature: 0 = greedy (argmax, ties to the lowest id), else softmax(logits / T).
    max_tokens: most tokens to generate; None = up to `max_model_len`.
    ignore_eos: keep generating past the EOS token.
    stop_token_ids: extra token ids that end the completion (kept in the output).
    seed: per-request seed; the same seed gives the same tokens whatever else is batched.
    """

    temperature: float = 1.0
    max_tokens: int | None = 16
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            raise ValueError(f"temperature must be a number >= 0, got {self.temperature!r}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be an int >= 1 or None, got {self.max_tokens!r}")
        if not all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative ints, got {self.stop_token_ids!r}")
        self.stop_token_ids = list(self.stop_token_ids)
        if self.seed is not None and (not isinstance(self.seed, int) or not 0 <= self.seed < 2**32):
            raise ValueError(f"seed must be an int in [0, 2**32), got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

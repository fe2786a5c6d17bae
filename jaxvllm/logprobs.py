"""vLLM's `vllm.logprobs`: a token's logprob, and the per-position lists of them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Logprob:
    """vLLM's Logprob: a token's log-probability, its rank (1 = most likely) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# {token id: Logprob} per prompt position (None for the first, which has none)
PromptLogprobs = list[dict[int, Logprob] | None]
# {token id: Logprob} per generated token
SampleLogprobs = list[dict[int, Logprob]]

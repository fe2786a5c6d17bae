"""vLLM's metrics, as `LLM.get_metrics()` returns them.

vLLM keeps its metrics in prometheus_client and reads them back as the dataclasses of
`vllm/v1/metrics/reader.py`. jaxvllm keeps the same counters, gauges and histograms in
plain Python (no dependency, a few updates per step and per finished request) and
returns the same dataclasses, with vLLM's names, labels, meanings and histogram buckets.

Gauges and the preemption count are read from the scheduler when a snapshot is taken;
everything else is counted as requests get tokens and finish.
"""

from __future__ import annotations

import logging
import math
import time
from bisect import bisect_left
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from jaxvllm.kv_cache_manager import PrefixCacheStats
    from jaxvllm.request import Request

logger = logging.getLogger(__name__)


def spec_decode_rates(num_drafts: int, num_draft_tokens: int, num_accepted_tokens: int) -> dict[str, float]:
    """Speculative decoding's acceptance rate (accepted / proposed draft tokens) and mean
    accepted length (tokens a verifying row emits per step: 1 + accepted / rows), as vLLM
    logs them, from its three counters (over an engine's life, or between two readings)."""
    return {"acceptance_rate": num_accepted_tokens / max(1, num_draft_tokens),
            "mean_accepted_length": 1 + num_accepted_tokens / max(1, num_drafts)}


# -- vLLM's reader dataclasses --------------------------------------------------------


@dataclass
class Metric:
    """A metric's name and key=value labels; several metrics may share a name with
    different labels (e.g. `vllm:request_success`, one per finish reason)."""

    name: str
    labels: dict[str, str]


@dataclass
class Counter(Metric):
    """A monotonically increasing integer counter."""

    value: int


@dataclass
class Vector(Metric):
    """Integer counters in order: vLLM's type of `vllm:spec_decode_num_accepted_tokens_per_pos`
    alone (one counter per draft position)."""

    values: list[int]


@dataclass
class Gauge(Metric):
    """A numerical value that can go up or down."""

    value: float


@dataclass
class Histogram(Metric):
    """Observations in buckets. `buckets` maps each bucket's upper bound, written as
    Prometheus writes the `le` label ("0.5", "10.0", "+Inf"), to the number of
    observations <= it: cumulative, so the "+Inf" bucket equals `count`."""

    count: int
    sum: float
    buckets: dict[str, int]


# -- vLLM's bucket boundaries ---------------------------------------------------------

TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
    80.0, 160.0, 640.0, 2560.0,
)
# Inter-token latency and a request's mean time per output token.
TOKEN_LATENCY_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)
# End-to-end latency and the queue, prefill, decode and inference phases of a request.
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
    960.0, 1920.0, 7680.0,
)
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
N_BUCKETS = (1, 2, 5, 10, 20)

# vLLM's finish reasons that jaxvllm produces (it has no "error" or "repetition").
FINISH_REASONS = ("stop", "length", "abort")
# vLLM's prompt token sources; jaxvllm has no KV connector, so nothing is ever transferred.
PROMPT_TOKEN_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to `max_value` (vLLM's buckets for token counts)."""
    buckets: list[int] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return buckets
            buckets.append(mantissa * scale)
        scale *= 10


def bucket_label(bound: float) -> str:
    """A bucket bound as prometheus_client writes the `le` label: Python's repr of the
    float ("0.001", "10.0"), Go's exponent form from 1e6 on ("1e+06"), "+Inf"."""
    if bound == math.inf:
        return "+Inf"
    text = repr(float(bound))
    if bound < 1e6 or "e" in text:
        return text
    whole, frac = text.split(".")
    digits = (whole + frac).rstrip("0")
    mantissa = digits[0] + ("." + digits[1:] if len(digits) > 1 else "")
    return f"{mantissa}e+{len(whole) - 1:02d}"


class _Buckets:
    """A histogram being filled: per-bucket counts (not cumulative) and the sum."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: Iterable[float]) -> None:
        self.bounds = tuple(float(b) for b in bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # the last is +Inf
        self.sum = 0.0

    def observe(self, value: float, times: int = 1) -> None:
        self.counts[bisect_left(self.bounds, value)] += times  # the first bucket with value <= bound
        self.sum += value * times

    def snapshot(self, name: str, labels: dict[str, str]) -> Histogram:
        buckets, total = {}, 0
        for bound, n in zip((*self.bounds, math.inf), self.counts):
            total += n
            buckets[bucket_label(bound)] = total
        return Histogram(name, dict(labels), count=total, sum=self.sum, buckets=buckets)


# -- the engine's collector -----------------------------------------------------------


class MetricsCollector:
    """The engine's metrics, updated as each step's tokens arrive (`record_step`), as each
    request finishes (`record_finished`) and as each user request (all of its n
    completions) finishes (`record_parent_finished`).

    The work per step is a few dict operations per request that got a token, plus one
    histogram update per distinct inter-token gap (one, when all requests decode).

    Meanings are vLLM's: a request's prompt tokens are counted when its first token
    arrives; `vllm:iteration_tokens_total` observes, per step, those prompt tokens plus
    the step's new tokens; the time of a token is when the host reads it.
    """

    def __init__(self, model_name: str, max_model_len: int, engine: str = "0") -> None:
        self.labels = {"model_name": model_name, "engine": engine}
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.prompt_tokens_computed = 0  # prompt tokens prefilled here (not found in the prefix cache)
        self.prompt_tokens_cached = 0  # prompt tokens found in the prefix cache
        # vLLM's count of cached prompts whose last token was computed anyway (a step needs one input).
        self.prompt_tokens_recomputed = 0
        self.request_success = dict.fromkeys(FINISH_REASONS, 0)
        length_buckets = build_1_2_5_buckets(max_model_len)
        self.request_prompt_tokens = _Buckets(length_buckets)
        self.request_generation_tokens = _Buckets(length_buckets)
        self.iteration_tokens = _Buckets(ITERATION_TOKENS_BUCKETS)
        self.request_max_num_generation_tokens = _Buckets(length_buckets)
        self.request_params_n = _Buckets(N_BUCKETS)
        self.request_params_max_tokens = _Buckets(length_buckets)
        self.time_to_first_token = _Buckets(TTFT_BUCKETS)
        self.inter_token_latency = _Buckets(TOKEN_LATENCY_BUCKETS)
        self.request_time_per_output_token = _Buckets(TOKEN_LATENCY_BUCKETS)
        self.e2e_request_latency = _Buckets(REQUEST_LATENCY_BUCKETS)
        self.request_queue_time = _Buckets(REQUEST_LATENCY_BUCKETS)
        self.request_inference_time = _Buckets(REQUEST_LATENCY_BUCKETS)
        self.request_prefill_time = _Buckets(REQUEST_LATENCY_BUCKETS)
        self.request_decode_time = _Buckets(REQUEST_LATENCY_BUCKETS)
        self.request_prefill_kv_computed_tokens = _Buckets(length_buckets)
        self._last_token_time: dict[Request, float] = {}  # running requests that have a token
        # The KV cache manager starts a new stats object on reset_prefix_cache: the
        # counters add up every object seen (`track_prefix_cache`) so they never go back.
        self._prefix_stats: PrefixCacheStats | None = None
        self._prefix_queries_before = 0
        self._prefix_hits_before = 0
        # Speculative decoding (vLLM's counters, present only when it is on): rows that
        # verified drafts, their drafts, the accepted ones, and accepted ones per position.
        self.spec_num_drafts = self.spec_num_draft_tokens = self.spec_num_accepted_tokens = 0
        self.spec_accepted_per_pos: list[int] | None = None

    def enable_spec_decode(self, num_speculative_tokens: int) -> None:
        self.spec_accepted_per_pos = [0] * num_speculative_tokens

    # -- updates ------------------------------------------------------------------------

    def record_spec_decode(self, num_drafts: Sequence[int], num_accepted: Sequence[int]) -> None:
        """A step's verified drafts and how many of each row's were accepted."""
        for drafts, accepted in zip(num_drafts, num_accepted):
            if drafts:
                self.spec_num_drafts += 1
                self.spec_num_draft_tokens += int(drafts)
                self.spec_num_accepted_tokens += int(accepted)
                for position in range(int(accepted)):
                    self.spec_accepted_per_pos[position] += 1

    def record_step(self, updated: Sequence[Request], now: float | None = None, num_tokens: int | None = None) -> None:
        """A step's new tokens: every request in `updated` got one at `now` (when the host
        read them), or more with speculative decoding (`num_tokens`: how many in all). For a
        request now holding one output token it is the first, stamped
        `metrics.first_token_time` by the scheduler."""
        now = time.time() if now is None else now
        last = self._last_token_time
        step_prompt_tokens = 0
        # Requests decoding together had their previous token at the same time: one
        # histogram update per distinct gap rather than per request.
        gaps: dict[float, int] = {}  # previous token's time -> how many requests
        for request in updated:
            previous = last.get(request)
            if previous is not None:
                gaps[previous] = gaps.get(previous, 0) + 1
                last[request] = now
            elif request.num_output_tokens == 1:  # (checked only for requests without a token yet)
                step_prompt_tokens += self._first_token(request)
                last[request] = request.metrics.first_token_time
            else:  # (a request whose earlier tokens were not seen: timed from now on)
                last[request] = now
        for previous, n in gaps.items():
            self.inter_token_latency.observe(now - previous, n)
        num_tokens = len(updated) if num_tokens is None else num_tokens
        self.prompt_tokens += step_prompt_tokens
        self.generation_tokens += num_tokens
        self.iteration_tokens.observe(step_prompt_tokens + num_tokens)

    def _first_token(self, request: Request) -> int:
        """Count a request's prompt once its first token is here; returns its length."""
        m = request.metrics
        prompt_len = request.num_prompt_tokens
        cached = request.num_cached_tokens or 0
        self.prompt_tokens_computed += prompt_len - cached
        self.prompt_tokens_cached += cached
        self.prompt_tokens_recomputed += int(cached + 1 == prompt_len)
        self.time_to_first_token.observe(m.first_token_time - m.arrival_time)
        return prompt_len

    def record_finished(self, request: Request) -> None:
        """A completion finished (stopped, at its length, or aborted), its finish reason
        and `metrics.finished_time` set. The phase histograms observe only the phases
        the request reached: queue time once it was scheduled, prefill, decode and
        inference time once it had a token, time per output token from two tokens on."""
        m = request.metrics
        reason = request.finish_reason
        self.request_success[reason] = self.request_success.get(reason, 0) + 1
        num_generated = request.num_output_tokens
        self.e2e_request_latency.observe(m.finished_time - m.arrival_time)
        self.request_prompt_tokens.observe(request.num_prompt_tokens)
        self.request_generation_tokens.observe(num_generated)
        max_tokens = request.params.max_tokens
        self.request_params_max_tokens.observe(request.max_tokens if max_tokens is None else max_tokens)
        last_token_time = self._last_token_time.pop(request, None)
        if m.first_scheduled_time is None:
            return
        self.request_queue_time.observe(m.first_scheduled_time - m.queued_time)  # (vLLM's: not from arrival)
        if m.first_token_time is None or last_token_time is None:
            return
        decode_time = last_token_time - m.first_token_time
        self.request_prefill_time.observe(m.first_token_time - m.first_scheduled_time)
        self.request_decode_time.observe(decode_time)
        self.request_inference_time.observe(last_token_time - m.first_scheduled_time)
        self.request_prefill_kv_computed_tokens.observe(request.num_prompt_tokens - (request.num_cached_tokens or 0))
        # (the first token is the prefill's; vLLM observes 0 for a request of one token)
        self.request_time_per_output_token.observe(decode_time / (num_generated - 1) if num_generated > 1 else 0.0)

    def forget(self, request: Request) -> None:
        """A completion the user aborted: as vLLM's, it is no finished request (no
        `request_success`, no per-request histogram); its tokens stay counted."""
        self._last_token_time.pop(request, None)

    def record_parent_finished(self, children: Sequence[Request]) -> None:
        """A user request finished, all n of its completions: its n and the most tokens
        one of them generated."""
        self.request_params_n.observe(len(children))
        self.request_max_num_generation_tokens.observe(max(c.num_output_tokens for c in children))

    def track_prefix_cache(self, stats: PrefixCacheStats) -> None:
        """Follow the KV cache manager's prefix cache stats; call it before they may be
        replaced (reset_prefix_cache) so that what the old object counted is kept."""
        if stats is self._prefix_stats:
            return
        if self._prefix_stats is not None:
            self._prefix_queries_before += self._prefix_stats.queries
            self._prefix_hits_before += self._prefix_stats.hits
        self._prefix_stats = stats

    # -- reading --------------------------------------------------------------------------

    def snapshot(
        self, *, num_running: int, num_waiting: int, kv_cache_usage: float, num_preemptions: int,
        prefix_cache: PrefixCacheStats, cache_config: dict[str, str] | None = None,
    ) -> list[Metric]:
        """Every metric now, in vLLM's order: gauges (from the scheduler's state passed
        in), counters, histograms, then vLLM's `vllm:cache_config_info` (a gauge of 1 whose
        labels are `cache_config`'s fields, as strings, and the engine's index)."""
        self.track_prefix_cache(prefix_cache)
        labels = self.labels

        def gauge(name: str, value: float) -> Gauge:
            return Gauge(name, dict(labels), float(value))

        def counter(name: str, value: int, **extra: str) -> Counter:
            return Counter(name, {**labels, **extra}, int(value))

        by_source = {
            "local_compute": self.prompt_tokens_computed,
            "local_cache_hit": self.prompt_tokens_cached + self.prompt_tokens_recomputed,
            "external_kv_transfer": 0,
        }
        metrics: list[Metric] = [
            gauge("vllm:num_requests_running", num_running),
            gauge("vllm:num_requests_waiting", num_waiting),
            gauge("vllm:kv_cache_usage_perc", kv_cache_usage),
            counter("vllm:prefix_cache_queries", self._prefix_queries_before + prefix_cache.queries),
            counter("vllm:prefix_cache_hits", self._prefix_hits_before + prefix_cache.hits),
            counter("vllm:num_preemptions", num_preemptions),
            counter("vllm:prompt_tokens", self.prompt_tokens),
            *(counter("vllm:prompt_tokens_by_source", by_source[s], source=s) for s in PROMPT_TOKEN_SOURCES),
            counter("vllm:prompt_tokens_cached", self.prompt_tokens_cached),
            counter("vllm:prompt_tokens_recomputed", self.prompt_tokens_recomputed),
            counter("vllm:generation_tokens", self.generation_tokens),
            *(counter("vllm:request_success", n, finished_reason=r) for r, n in self.request_success.items()),
        ]
        if self.spec_accepted_per_pos is not None:
            metrics += [
                counter("vllm:spec_decode_num_drafts", self.spec_num_drafts),
                counter("vllm:spec_decode_num_draft_tokens", self.spec_num_draft_tokens),
                counter("vllm:spec_decode_num_accepted_tokens", self.spec_num_accepted_tokens),
                Vector("vllm:spec_decode_num_accepted_tokens_per_pos", dict(labels), list(self.spec_accepted_per_pos)),
            ]
        histograms = (
            ("vllm:request_prompt_tokens", self.request_prompt_tokens),
            ("vllm:request_generation_tokens", self.request_generation_tokens),
            ("vllm:iteration_tokens_total", self.iteration_tokens),
            ("vllm:request_max_num_generation_tokens", self.request_max_num_generation_tokens),
            ("vllm:request_params_n", self.request_params_n),
            ("vllm:request_params_max_tokens", self.request_params_max_tokens),
            ("vllm:time_to_first_token_seconds", self.time_to_first_token),
            # (vLLM 0.11's deprecated name of the inter-token latency, still registered)
            ("vllm:time_per_output_token_seconds", self.inter_token_latency),
            ("vllm:inter_token_latency_seconds", self.inter_token_latency),
            ("vllm:request_time_per_output_token_seconds", self.request_time_per_output_token),
            ("vllm:e2e_request_latency_seconds", self.e2e_request_latency),
            ("vllm:request_queue_time_seconds", self.request_queue_time),
            ("vllm:request_inference_time_seconds", self.request_inference_time),
            ("vllm:request_prefill_time_seconds", self.request_prefill_time),
            ("vllm:request_decode_time_seconds", self.request_decode_time),
            ("vllm:request_prefill_kv_computed_tokens", self.request_prefill_kv_computed_tokens),
        )
        metrics.extend(h.snapshot(name, labels) for name, h in histograms)
        if cache_config is not None:
            metrics.append(Gauge("vllm:cache_config_info", {**cache_config, "engine": labels["engine"]}, 1.0))
        return metrics


# vLLM's VLLM_LOG_STATS_INTERVAL default: seconds between two periodic stats lines.
LOG_STATS_INTERVAL = 10.0


class StatLogger:
    """vLLM's `LoggingStatLogger`: one line of the prompt and generation throughput since
    the line before, the queues, the KV cache usage and the prefix-cache hit rate. An
    engine with stats logging on (`disable_log_stats=False`, as vLLM's engines by default
    and not `LLM`) logs one every `LOG_STATS_INTERVAL` seconds of steps; `do_log_stats()` logs one now."""

    def __init__(self, metrics: MetricsCollector, engine_index: int) -> None:
        self.metrics, self.engine_index = metrics, engine_index
        self._last = (time.monotonic(), metrics.prompt_tokens, metrics.generation_tokens)
        self._last_rates = (0.0, 0.0)
        self._last_spec: tuple[int, ...] = ()  # the speculative decoding counts at the line before

    def due(self) -> bool:
        return time.monotonic() - self._last[0] >= LOG_STATS_INTERVAL

    def log(self, num_running: int, num_waiting: int, kv_cache_usage: float, prefix_cache_hit_rate: float) -> None:
        now, m = time.monotonic(), self.metrics
        then, prompt, generation = self._last
        seconds = now - then
        rates = ((m.prompt_tokens - prompt) / seconds, (m.generation_tokens - generation) / seconds) if seconds > 0 \
            else (0.0, 0.0)
        # (vLLM's: an idle engine's line, after an idle one, only at debug level)
        log = logger.info if any(rates + self._last_rates) else logger.debug
        self._last, self._last_rates = (now, m.prompt_tokens, m.generation_tokens), rates
        log("Engine %03d: Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
            "Running: %d reqs, Waiting: %d reqs, GPU KV cache usage: %.1f%%, Prefix cache hit rate: %.1f%%",
            self.engine_index, *rates, num_running, num_waiting, 100 * kv_cache_usage, 100 * prefix_cache_hit_rate)
        if m.spec_accepted_per_pos is not None:
            self._log_spec_decoding(log, seconds)

    def _log_spec_decoding(self, log, seconds: float) -> None:
        """vLLM's `SpecDecodingLogging` line, of the drafts since the line before (none: no line)."""
        m = self.metrics
        counts = (m.spec_num_drafts, m.spec_num_draft_tokens, m.spec_num_accepted_tokens, *m.spec_accepted_per_pos)
        drafts, drafted, accepted, *per_pos = (now - before for now, before in
                                               zip(counts, self._last_spec or (0,) * len(counts)))
        self._last_spec = counts
        if not drafts:
            return
        log("SpecDecoding metrics: Mean acceptance length: %.2f, Accepted throughput: %.2f tokens/s, Drafted "
            "throughput: %.2f tokens/s, Accepted: %d tokens, Drafted: %d tokens, Per-position acceptance rate: %s, "
            "Avg Draft acceptance rate: %.1f%%", 1 + accepted / drafts, accepted / seconds if seconds > 0 else 0,
            drafted / seconds if seconds > 0 else 0, accepted, drafted, ", ".join(f"{n / drafts:.3f}" for n in per_pos),
            100 * accepted / drafted if drafted else math.nan)

"""`LLM.get_metrics()`: vLLM's metric names, types, labels and buckets, and exact counts
after a known workload (compared as differences, so the tests' order does not matter)."""

import pytest

from jaxvllm import LLM, SamplingParams
from jaxvllm.metrics import (
    REQUEST_LATENCY_BUCKETS,
    TOKEN_LATENCY_BUCKETS,
    TTFT_BUCKETS,
    Counter,
    Gauge,
    Histogram,
    bucket_label,
    build_1_2_5_buckets,
)

ENGINE = dict(max_model_len=64, max_num_seqs=8, max_num_batched_tokens=64, token_buckets=[64])

GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")
COUNTERS = (
    "vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:num_preemptions", "vllm:prompt_tokens",
    "vllm:prompt_tokens_by_source", "vllm:prompt_tokens_cached", "vllm:prompt_tokens_recomputed",
    "vllm:generation_tokens", "vllm:request_success",
)
HISTOGRAMS = (
    "vllm:request_prompt_tokens", "vllm:request_generation_tokens", "vllm:iteration_tokens_total",
    "vllm:request_max_num_generation_tokens", "vllm:request_params_n", "vllm:request_params_max_tokens",
    "vllm:time_to_first_token_seconds", "vllm:time_per_output_token_seconds", "vllm:inter_token_latency_seconds",
    "vllm:request_time_per_output_token_seconds", "vllm:e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds", "vllm:request_inference_time_seconds", "vllm:request_prefill_time_seconds",
    "vllm:request_decode_time_seconds", "vllm:request_prefill_kv_computed_tokens",
)


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    llm = LLM(tiny_checkpoint("qwen3"), **ENGINE)
    yield llm
    llm.shutdown()


def greedy(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def tokens(first: int, n: int) -> dict:
    return {"prompt_token_ids": list(range(first, first + n))}


def read(llm) -> dict:
    """The metrics keyed by name, or (name, the extra label's value) for labelled series."""
    out = {}
    for m in llm.get_metrics():
        extra = {k: v for k, v in m.labels.items() if k not in ("model_name", "engine")}
        key = (m.name, *extra.values()) if extra else m.name
        assert key not in out, key
        out[key] = m
    return out


def changed(before: dict, after: dict, key):
    """A counter's increase, or a histogram's (count, sum, per-bucket increase)."""
    a, b = after[key], before[key]
    if isinstance(a, Counter):
        return a.value - b.value
    return a.count - b.count, a.sum - b.sum, {le: n - b.buckets[le] for le, n in a.buckets.items()}


def test_names_types_labels_and_buckets(llm):
    llm.generate(tokens(20, 5), greedy(3), use_tqdm=False)
    metrics = llm.get_metrics()
    types = {}
    # vLLM 0.11's info gauge, last: 1, labelled by the cache config's fields and the engine only
    info = metrics.pop()
    assert (info.name, type(info), info.value, info.labels["engine"]) == ("vllm:cache_config_info", Gauge, 1.0, "0")
    assert {k: info.labels[k] for k in ("block_size", "cache_dtype", "enable_prefix_caching", "num_gpu_blocks")} == {
        "block_size": str(llm.llm_engine.config.block_size), "cache_dtype": "auto", "enable_prefix_caching": "True",
        "num_gpu_blocks": str(llm.stats()["num_gpu_blocks"])}
    assert "model_name" not in info.labels and all(isinstance(v, str) for v in info.labels.values())
    for m in metrics:
        types.setdefault(m.name, set()).add(type(m))
        assert {k: m.labels[k] for k in ("model_name", "engine")} == {
            "model_name": llm.llm_engine.config.model, "engine": "0"
        }
    assert types == {
        **{n: {Gauge} for n in GAUGES}, **{n: {Counter} for n in COUNTERS}, **{n: {Histogram} for n in HISTOGRAMS}
    }
    assert [m.name for m in metrics[:3]] == list(GAUGES)
    success = {m.labels["finished_reason"] for m in metrics if m.name == "vllm:request_success"}
    assert success == {"stop", "length", "abort"}
    sources = {m.labels["source"] for m in metrics if m.name == "vllm:prompt_tokens_by_source"}
    assert sources == {"local_compute", "local_cache_hit", "external_kv_transfer"}
    labelled = ("vllm:request_success", "vllm:prompt_tokens_by_source")
    assert all(len(m.labels) == 2 for m in metrics if m.name not in labelled)

    m = read(llm)
    # vLLM's boundaries, keyed as Prometheus writes `le`.
    assert list(m["vllm:time_to_first_token_seconds"].buckets) == [*map(repr, TTFT_BUCKETS), "+Inf"]
    assert TTFT_BUCKETS[:3] == (0.001, 0.005, 0.01) and TTFT_BUCKETS[-1] == 2560.0
    assert list(m["vllm:inter_token_latency_seconds"].buckets) == [*map(repr, TOKEN_LATENCY_BUCKETS), "+Inf"]
    # (vLLM 0.11's deprecated name of the same histogram)
    assert m["vllm:time_per_output_token_seconds"].buckets == m["vllm:inter_token_latency_seconds"].buckets
    assert list(m["vllm:e2e_request_latency_seconds"].buckets)[:3] == ["0.3", "0.5", "0.8"]
    assert len(REQUEST_LATENCY_BUCKETS) == 21 and len(TOKEN_LATENCY_BUCKETS) == 19 and len(TTFT_BUCKETS) == 22
    assert list(m["vllm:request_prompt_tokens"].buckets) == ["1.0", "2.0", "5.0", "10.0", "20.0", "50.0", "+Inf"]
    assert list(m["vllm:request_params_n"].buckets) == ["1.0", "2.0", "5.0", "10.0", "20.0", "+Inf"]
    assert list(m["vllm:iteration_tokens_total"].buckets)[:3] == ["1.0", "8.0", "16.0"]
    assert list(m["vllm:iteration_tokens_total"].buckets)[-2:] == ["16384.0", "+Inf"]


def test_bucket_helpers():
    assert build_1_2_5_buckets(100) == [1, 2, 5, 10, 20, 50, 100]
    assert build_1_2_5_buckets(64) == [1, 2, 5, 10, 20, 50]
    assert build_1_2_5_buckets(0) == []
    assert [bucket_label(b) for b in (0.001, 1, 2560.0, 100000, 1_000_000, 2_000_000, 12_500_000, float("inf"))] == [
        "0.001", "1.0", "2560.0", "100000.0", "1e+06", "2e+06", "1.25e+07", "+Inf"
    ]


def test_counts_after_a_known_workload(llm):
    engine = llm.llm_engine
    stop_prompt = tokens(200, 10)
    [ref] = llm.generate(stop_prompt, greedy(8), use_tqdm=False)
    llm.reset_prefix_cache()
    before = read(llm)

    # Aborted while waiting: never scheduled, no token.
    engine.add_request("m-wait", tokens(400, 12), greedy(4))
    [waited] = engine.abort_request("m-wait")
    assert waited.outputs[0].finish_reason == "abort" and waited.outputs[0].token_ids == []

    # Aborted after some tokens; meanwhile the gauges show it running.
    engine.add_request("m-run", tokens(300, 20), greedy(30))
    got = 0
    for _ in range(50):
        for out in engine.step():
            got = len(out.outputs[0].token_ids)
        if got >= 3:
            break
    now = read(llm)
    assert now["vllm:num_requests_running"].value == 1 and now["vllm:num_requests_waiting"].value == 0
    assert 0 < now["vllm:kv_cache_usage_perc"].value <= 1
    [ran] = engine.abort_request("m-run")
    k = len(ran.outputs[0].token_ids)
    assert ran.outputs[0].finish_reason == "abort" and k >= 3

    # Two prompts sharing a 32-token prefix (two blocks), the second with n=2; then a stop.
    shared = list(range(100, 132))
    outs = llm.generate(
        [{"prompt_token_ids": shared + [5, 6, 7]}, {"prompt_token_ids": shared + [8, 9]}],
        [greedy(5), greedy(7, n=2)], use_tqdm=False,
    )
    [stopped] = llm.generate(stop_prompt, greedy(8, stop_token_ids=[ref.outputs[0].token_ids[0]]), use_tqdm=False)
    completions = [c for o in outs for c in o.outputs] + stopped.outputs
    assert [(c.finish_reason, len(c.token_ids)) for c in completions] == [
        ("length", 5), ("length", 7), ("length", 7), ("stop", 1)
    ]
    for o in [*outs, stopped]:
        m = o.metrics
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
    after = read(llm)

    # Counters: prompts count once their first token is here (not the one aborted while waiting).
    prompt_tokens = 20 + 35 + 34 + 34 + 10
    generation_tokens = k + 5 + 7 + 7 + 1
    assert changed(before, after, "vllm:prompt_tokens") == prompt_tokens
    assert changed(before, after, "vllm:generation_tokens") == generation_tokens
    assert changed(before, after, ("vllm:request_success", "length")) == 3
    assert changed(before, after, ("vllm:request_success", "stop")) == 1
    assert changed(before, after, ("vllm:request_success", "abort")) == 0  # (vLLM's: a user's abort is none)
    # Queries: every admitted request's tokens; hits: both completions of the second prompt
    # find the first prompt's two blocks.
    assert changed(before, after, "vllm:prefix_cache_queries") == prompt_tokens
    assert changed(before, after, "vllm:prefix_cache_hits") == 64
    assert changed(before, after, "vllm:prompt_tokens_cached") == 64
    assert changed(before, after, ("vllm:prompt_tokens_by_source", "local_compute")) == prompt_tokens - 64
    assert changed(before, after, ("vllm:prompt_tokens_by_source", "local_cache_hit")) == 64
    assert changed(before, after, ("vllm:prompt_tokens_by_source", "external_kv_transfer")) == 0
    assert changed(before, after, "vllm:prompt_tokens_recomputed") == 0
    assert changed(before, after, "vllm:num_preemptions") == 0
    assert after["vllm:num_requests_running"].value == 0 and after["vllm:num_requests_waiting"].value == 0
    assert after["vllm:kv_cache_usage_perc"].value == 0

    # Per finished completion: 4 (as vLLM's, the user's aborts are not finished requests).
    count, total, buckets = changed(before, after, "vllm:request_prompt_tokens")
    assert (count, total) == (4, prompt_tokens - 20)
    assert buckets == {"1.0": 0, "2.0": 0, "5.0": 0, "10.0": 1, "20.0": 1, "50.0": 4, "+Inf": 4}
    assert changed(before, after, "vllm:request_generation_tokens")[:2] == (4, generation_tokens - k)
    assert changed(before, after, "vllm:request_params_max_tokens")[:2] == (4, 5 + 7 + 7 + 8)
    assert changed(before, after, "vllm:e2e_request_latency_seconds")[0] == 4
    # Per user request, once all of its completions finished: 3.
    count, total, buckets = changed(before, after, "vllm:request_params_n")
    assert (count, total, buckets["1.0"], buckets["2.0"]) == (3, 4, 2, 3)
    assert changed(before, after, "vllm:request_max_num_generation_tokens")[:2] == (3, 5 + 7 + 1)
    # Time to first token: each first token (the aborted one's too); the phases: each finished
    # request (time per output token 0 for the stop after one, as vLLM's).
    assert changed(before, after, "vllm:time_to_first_token_seconds")[0] == 5
    for name in ("vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds",
                 "vllm:request_decode_time_seconds", "vllm:request_inference_time_seconds",
                 "vllm:request_time_per_output_token_seconds"):
        assert changed(before, after, name)[0] == 4, name
    assert changed(before, after, "vllm:request_prefill_kv_computed_tokens")[:2] == (4, 35 + 2 + 2 + 10)
    assert changed(before, after, "vllm:inter_token_latency_seconds")[0] == generation_tokens - 5
    count, total, _ = changed(before, after, "vllm:iteration_tokens_total")
    assert count >= 1 and total == prompt_tokens + generation_tokens


def test_histograms_are_cumulative_and_non_negative(llm):
    llm.generate([tokens(30, 6), tokens(40, 9)], greedy(4), use_tqdm=False)
    for m in llm.get_metrics():
        if isinstance(m, Histogram):
            bounds, counts = list(m.buckets), list(m.buckets.values())
            assert bounds[-1] == "+Inf" and [float(b) for b in bounds] == sorted(float(b) for b in bounds), m.name
            assert counts == sorted(counts) and counts[-1] == m.count, m.name
            assert m.sum >= 0 and (m.count > 0 or m.sum == 0), m.name
        else:
            assert m.value >= 0, m.name
    m = read(llm)
    assert m["vllm:time_to_first_token_seconds"].count > 0 and m["vllm:inter_token_latency_seconds"].count > 0


def test_prefix_cache_counters_survive_a_reset(llm):
    prompt = tokens(450, 40)  # two full blocks
    llm.reset_prefix_cache()
    before = read(llm)
    llm.generate(prompt, greedy(2), use_tqdm=False)
    llm.generate(prompt, greedy(2), use_tqdm=False)  # finds both blocks
    llm.reset_prefix_cache()
    assert llm.llm_engine.kv_cache_manager.stats.queries == 0  # the manager's own stats start over
    after = read(llm)
    assert changed(before, after, "vllm:prefix_cache_queries") == 80
    assert changed(before, after, "vllm:prefix_cache_hits") == 32
    # A request with prompt logprobs skips the lookup: as vLLM's, no query.
    llm.generate(prompt, greedy(2, prompt_logprobs=1), use_tqdm=False)
    assert changed(after, read(llm), "vllm:prefix_cache_queries") == 0


def test_vllm_reader_module_path():
    """vLLM's metrics example imports the reader classes from vllm.v1.metrics.reader."""
    import jaxvllm.metrics
    from jaxvllm.v1.metrics.reader import Counter, Gauge, Histogram, Vector

    assert (Counter, Gauge, Histogram, Vector) == (jaxvllm.metrics.Counter, jaxvllm.metrics.Gauge,
                                                   jaxvllm.metrics.Histogram, jaxvllm.metrics.Vector)


def test_queue_time_counts_from_when_the_engine_queued_the_request(llm):
    """vLLM's queue time runs from when the scheduler got the request (queued_ts), not from
    an `arrival_time` the caller gave: that one moves only end-to-end latency and TTFT."""
    import time

    engine = llm.llm_engine
    before = read(llm)
    engine.add_request("early", tokens(3, 5), greedy(2), arrival_time=time.time() - 100)
    while engine.has_unfinished_requests():
        engine.step()
    after = read(llm)
    assert changed(before, after, "vllm:e2e_request_latency_seconds")[1] >= 100
    assert changed(before, after, "vllm:time_to_first_token_seconds")[1] >= 100
    count, total, _ = changed(before, after, "vllm:request_queue_time_seconds")
    assert count == 1 and total < 50


def test_stats_line_is_logged_as_vllm_engines_log_it(tiny_checkpoint, monkeypatch, caplog):
    """vLLM's LoggingStatLogger line, every interval of steps on an engine with stats logging
    on (LLMEngine's default), never under LLM's default (disable_log_stats=True, vLLM's)."""
    import jaxvllm.metrics
    from jaxvllm import EngineArgs, LLMEngine

    monkeypatch.setattr(jaxvllm.metrics, "LOG_STATS_INTERVAL", 0.0)
    line = "Engine 000: Avg prompt throughput: "
    caplog.set_level("INFO", logger="jaxvllm")
    engine = LLMEngine.from_engine_args(EngineArgs(model=str(tiny_checkpoint("qwen3")), **ENGINE),
                                        usage_context=None, enable_multiprocessing=False)
    with caplog.at_level("INFO", logger="jaxvllm"):
        engine.add_request("a", tokens(3, 20), greedy(4))
        while engine.has_unfinished_requests():
            assert LLMEngine.validate_outputs(outputs := engine.step(), object) is outputs
    logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith(line)]
    assert logged and "Running: 1 reqs, Waiting: 0 reqs" in logged[0] and "GPU KV cache usage: " in logged[0]
    assert f"Engine 000: vllm cache_config_info with initialization after num_gpu_blocks is: " \
           f"{engine.stats()['num_gpu_blocks']}" in caplog.text
    assert "Running: 0 reqs" in logged[-1] and "Avg generation throughput: 0.0" not in logged[-1]
    engine.shutdown()
    caplog.clear()
    with LLM(tiny_checkpoint("qwen3"), **ENGINE) as quiet, caplog.at_level("INFO", logger="jaxvllm"):
        quiet.generate([tokens(3, 20)], greedy(4), use_tqdm=False)
        quiet.llm_engine.do_log_stats()  # (vLLM's: nothing with stats logging off)
    assert line not in caplog.text
    with pytest.raises(ValueError, match="stat_loggers are not supported"):
        LLMEngine.from_engine_args(EngineArgs(model=str(tiny_checkpoint("qwen3")), **ENGINE), stat_loggers=[object])


def test_spec_decoding_line_follows_the_stats_line(caplog):
    """vLLM's SpecDecodingLogging line, of the drafts since the line before: mean acceptance
    length (the bonus token included), counts, per-position and mean acceptance rates; no
    line when nothing was drafted since."""
    from jaxvllm.metrics import MetricsCollector, StatLogger

    metrics = MetricsCollector("m", 64)
    metrics.enable_spec_decode(3)
    stats = StatLogger(metrics, 0)
    metrics.spec_num_drafts, metrics.spec_num_draft_tokens, metrics.spec_num_accepted_tokens = 4, 12, 6
    metrics.spec_accepted_per_pos[:] = [4, 2, 0]
    metrics.generation_tokens = 10
    with caplog.at_level("INFO", logger="jaxvllm"):
        stats.log(1, 0, 0.5, 0.0)
        metrics.generation_tokens = 20
        stats.log(1, 0, 0.5, 0.0)  # (no drafts since)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("SpecDecoding metrics: ")]
    assert len(lines) == 1
    assert lines[0].startswith("SpecDecoding metrics: Mean acceptance length: 2.50, Accepted throughput: ")
    assert "Accepted: 6 tokens, Drafted: 12 tokens, Per-position acceptance rate: 1.000, 0.500, 0.000, " \
           "Avg Draft acceptance rate: 50.0%" in lines[0]

"""`jaxvllm bench throughput|latency` end to end on CPU, side by side with HF, and their workloads."""

import json
import subprocess
import sys

import numpy as np
import pytest

from jaxvllm.benchmarks import datasets as ds
from jaxvllm.benchmarks.throughput import auto_max_model_len
from jaxvllm.cli import main

# The shapes of test_cli.py: the token buckets compile once per session.
ENGINE = ["--max-model-len", "64", "--max-num-batched-tokens", "32", "--max-num-seqs", "8"]
RATES = ("requests_per_second", "tokens_per_second", "output_tokens_per_second")


def bench(kind: str, tmp_path, *args: str) -> dict:
    path = tmp_path / f"{kind}.json"
    assert main(["bench", kind, *ENGINE, "--disable-tqdm", "--output-json", str(path), *args]) == 0
    return json.loads(path.read_text())


# -- workloads ----------------------------------------------------------------------------------


def test_random_requests_lengths_and_ids():
    reqs = ds.random_requests(200, 100, 20, 384, range_ratio=0.5, seed=1)
    assert len(reqs) == 200
    assert all(50 <= r.prompt_len <= 150 and 10 <= r.output_len <= 30 for r in reqs)
    assert all(3 <= t < 384 for r in reqs for t in r.prompt_token_ids)
    assert len({r.prompt_len for r in reqs}) > 10  # lengths do vary
    fixed = ds.random_requests(4, 16, 8, 384)
    assert [(r.prompt_len, r.output_len) for r in fixed] == [(16, 8)] * 4
    assert ds.random_requests(4, 16, 8, 384, seed=3) == ds.random_requests(4, 16, 8, 384, seed=3)
    with pytest.raises(ValueError):
        ds.random_requests(4, 16, 8, 384, range_ratio=1.0)
    # vLLM's bounds, floor and ceil: 10 with r = 0.25 is 7 to 13 (13 was never drawn)
    assert {r.prompt_len for r in ds.random_requests(400, 10, 8, 384, range_ratio=0.25)} == set(range(7, 14))
    # and vLLM's --prefix-len for random prompts: that many tokens every prompt starts with
    shared = ds.random_requests(3, 8, 4, 384, prefix_len=100, seed=2)
    assert [r.prompt_len for r in shared] == [108] * 3
    assert shared[0].prompt_token_ids[:100] == shared[2].prompt_token_ids[:100]


def test_nanovllm_is_b1():
    reqs = ds.nanovllm_requests(151936)
    assert len(reqs) == 256
    prompt = np.array([r.prompt_len for r in reqs])
    output = np.array([r.output_len for r in reqs])
    assert prompt.min() >= 100 and prompt.max() <= 1024 and output.min() >= 100 and output.max() <= 1024
    assert 450 < prompt.mean() < 670 and 450 < output.mean() < 670  # uniform in [100, 1024]: mean 562
    assert reqs == ds.nanovllm_requests(151936)  # seed 0, every time
    assert auto_max_model_len("nanovllm", reqs, 40960) == 4096  # B1's max_model_len
    assert auto_max_model_len("nanovllm", reqs, 2048) == 2048  # what dummy:tiny allows, still enough


def test_shared_prefix_requests_share_their_prefix():
    reqs = ds.shared_prefix_requests(5, 32, 8, 4, 384, seed=0)
    prefix = reqs[0].prompt_token_ids[:32]
    assert all(r.prompt_token_ids[:32] == prefix and r.prompt_len == 40 and r.output_len == 4 for r in reqs)
    assert len({tuple(r.prompt_token_ids[32:]) for r in reqs}) == 5
    assert auto_max_model_len("shared-prefix", reqs, 2048) == 44


# -- throughput -----------------------------------------------------------------------------------


def test_throughput_both_backends(tmp_path, capsys):
    report = bench("throughput", tmp_path, "--model", "dummy:tiny", "--dataset", "random", "--num-prompts", "6",
                   "--input-len", "12", "--output-len", "5", "--backend", "both")
    out = capsys.readouterr().out
    assert "jaxvllm: Throughput:" in out and "hf (" in out and "jaxvllm / hf:" in out
    assert "host share of step time" in out

    jax_run, hf_run = report["results"]["jaxvllm"], report["results"]["hf"]
    for run in (jax_run, hf_run):
        assert run["num_requests"] == 6 and run["total_prompt_tokens"] == 72 and run["total_output_tokens"] == 30
        assert run["total_num_tokens"] == 102
        assert all(run[k] > 0 for k in (*RATES, "elapsed_time", "load_seconds", "warmup_seconds")), run
    assert hf_run["mode"] == "continuous batching"
    assert set(report["ratio"]) == set(RATES) and all(v > 0 for v in report["ratio"].values())
    timing = jax_run["step_timing"]
    assert timing["steps"] > 0 and 0 < timing["host_share"] < 1
    assert timing["host_seconds"] > 0 and timing["wait_seconds"] > 0
    # The jitted forward's and sampler's calls are parts of the launch.
    assert 0 < timing["forward_call_seconds"] and 0 < timing["sampler_call_seconds"]
    assert timing["forward_call_seconds"] + timing["sampler_call_seconds"] <= timing["launch_seconds"]
    assert "launch" in out and "(calls: forward" in out
    assert jax_run["engine_stats"]["num_compiled_buckets"] == 4  # [1, 4, 16, 32]: a CPU's buckets up to 32 tokens
    assert report["config"]["engine_args"]["max_model_len"] == 64  # the flag wins over the dataset's 17
    env = report["environment"]
    assert env["jax_version"] and env["platform"] == "cpu" and env["hf_device"] == "cpu"


def test_throughput_shared_prefix_hits_the_prefix_cache(tmp_path):
    report = bench("throughput", tmp_path, "--model", "dummy:tiny", "--dataset", "shared-prefix",
                   "--num-prompts", "4", "--prefix-len", "32", "--input-len", "4", "--output-len", "3")
    (run,) = report["results"].values()
    assert run["total_prompt_tokens"] == 4 * 36 and run["total_output_tokens"] == 12
    assert run["engine_stats"]["prefix_cache_hits"] > 0


def test_throughput_same_greedy_tokens_as_hf_on_a_checkpoint(tmp_path, tiny_checkpoint):
    """On real (tiny, float32) weights both engines complete the same prompts with the same tokens."""
    path = tiny_checkpoint("qwen3")
    report = bench("throughput", tmp_path, "--model", str(path), "--num-prompts", "4", "--input-len", "10",
                   "--output-len", "4", "--backend", "both", "--hf-mode", "padded", "--hf-batch-size", "3")
    assert report["results"]["hf"]["mode"] == "padded generate, batches of 3"
    assert report["identical_completions"] == 4


# -- latency ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("hf_mode", ["auto", "padded"])
def test_latency_both_backends(tmp_path, capsys, hf_mode):
    report = bench("latency", tmp_path, "--model", "dummy:tiny", "--batch-size", "2", "--input-len", "8",
                   "--output-len", "4", "--num-iters-warmup", "1", "--num-iters", "3", "--backend", "both",
                   "--hf-mode", hf_mode)
    out = capsys.readouterr().out
    assert "TTFT" in out and "TPOT" in out and "jaxvllm / hf" in out
    for run in report["results"].values():
        assert len(run["latencies"]) == 3
        for key in ("e2e_latency", "ttft", "tpot"):
            figures = run[key]
            assert all(figures[k] > 0 for k in ("mean", "p50", "p90", "p99")), (key, figures)
            assert figures["p50"] <= figures["p99"]
        assert run["ttft"]["mean"] < run["e2e_latency"]["mean"]
        assert run["load_seconds"] > 0 and run["warmup_seconds"] > 0
    assert set(report["ratio"]) == {"e2e_latency", "ttft", "tpot"}
    assert report["config"]["batch_size"] == 2 and report["environment"]["jax_version"]


def test_stop_at_eos_both_backends(tiny_checkpoint):
    """A request with stop_at_eos ends at its first EOS (kept), on jaxvllm and on HF in both
    modes; one without it runs to its length. The EOS is the token the model picks third
    for the first prompt, set as the checkpoint's eos_token_id (same weights)."""
    from jaxvllm.dummy import ModelSource
    from jaxvllm.benchmarks.hf_backend import HFBackend
    from jaxvllm.benchmarks.jaxvllm_backend import JaxvllmBackend

    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 300, 9).tolist() for _ in range(3)]

    def complete(path, stop, backend):
        requests = [ds.BenchRequest(p, 6, stop_at_eos=stop) for p in prompts]
        if backend == "jaxvllm":
            engine = JaxvllmBackend(str(path), max_model_len=32, dtype="float32")
        else:
            engine = HFBackend(ModelSource(str(path), str(path), False), dtype="float32", mode=backend, batch_size=2)
        try:
            return engine.run(requests, use_tqdm=False).output_token_ids
        finally:
            engine.close()

    full = complete(tiny_checkpoint("llama"), False, "jaxvllm")
    assert full == complete(tiny_checkpoint("llama"), False, "padded")
    eos = full[0][2]
    path = tiny_checkpoint("llama", eos_token_id=eos)
    want = [tokens[: tokens.index(eos) + 1] if eos in tokens else tokens for tokens in full]
    assert len(want[0]) <= 3
    for backend in ("jaxvllm", "padded", "cb"):
        assert complete(path, True, backend) == want, backend
    assert complete(path, False, "jaxvllm") == full


def test_hf_backend_without_torch_says_how_to_get_it(monkeypatch):
    from jaxvllm.benchmarks.hf_backend import import_torch

    monkeypatch.setitem(sys.modules, "torch", None)  # what `import torch` sees where it is not installed
    with pytest.raises(ImportError, match="pip install torch"):
        import_torch()


def test_throughput_compares_prefix_caching(tmp_path):
    """Shared-prefix workload with caching on, then off: most of the shared prefill is skipped."""
    report = bench("throughput", tmp_path, "--model", "dummy:tiny", "--dataset", "shared-prefix", "--prefix-len", "32",
                   "--input-len", "8", "--output-len", "4", "--num-prompts", "8", "--compare-prefix-caching")
    p = report["prefix_caching"]
    # The first request computes the 32 shared tokens; every request computes its own 8.
    assert p["computed_prefill_tokens_off"] == 8 * 40
    assert p["computed_prefill_tokens_on"] == 32 + 8 * 8
    assert p["prefill_skipped"] == pytest.approx(1 - 96 / 320)
    assert p["elapsed_on"] > 0 and p["elapsed_off"] > 0 and p["speedup"] > 0
    on, off = report["results"]["jaxvllm"], report["results"]["jaxvllm_no_prefix_caching"]
    assert on["engine_stats"]["prefix_cache_hits"] == 7 * 32 and off["engine_stats"]["prefix_cache_hits"] == 0


def test_throughput_compares_async_scheduling(tmp_path):
    """Async scheduling on, then off, in one run: the same greedy completions, and both rates."""
    report = bench("throughput", tmp_path, "--model", "dummy:tiny", "--dataset", "random", "--input-len", "16",
                   "--output-len", "8", "--num-prompts", "8", "--compare-async-scheduling")
    a = report["async_scheduling"]
    assert a["identical_completions"] == 8
    assert a["output_tokens_per_second_on"] > 0 and a["output_tokens_per_second_off"] > 0 and a["speedup"] > 0
    assert report["results"]["jaxvllm"]["engine_stats"]["async_scheduling"] is True
    assert report["results"]["jaxvllm_sync"]["engine_stats"]["async_scheduling"] is False


def test_throughput_compares_kv_cache_dtype(tmp_path, capsys):
    """An fp8 KV cache, then the model's dtype, in one run: both reported, with their KV blocks."""
    report = bench("throughput", tmp_path, "--model", "dummy:tiny", "--dataset", "random", "--input-len", "16",
                   "--output-len", "8", "--num-prompts", "8", "--dtype", "bfloat16", "--compare-kv-cache-dtype")
    k = report["kv_cache_dtype"]
    assert k["kv_cache_dtype"] == "float8_e4m3fn" and k["model_kv_cache_dtype"] == "bfloat16"
    assert k["output_tokens_per_second_fp8"] > 0 and k["output_tokens_per_second_model_dtype"] > 0
    assert k["speedup"] > 0 and 0 <= k["identical_completions"] <= 8
    assert k["num_gpu_blocks_fp8"] >= k["num_gpu_blocks_model_dtype"] > 0
    assert report["results"]["jaxvllm"]["engine_stats"]["kv_cache_dtype"] == "float8_e4m3fn"
    assert report["results"]["jaxvllm_kv_cache_auto"]["engine_stats"]["kv_cache_dtype"] == "bfloat16"
    assert report["config"]["engine_args"]["kv_cache_dtype"] == "fp8"
    out = capsys.readouterr().out
    assert "jaxvllm, model-dtype KV cache: Throughput" in out and "KV cache float8_e4m3fn vs bfloat16" in out
    # --kv-cache-dtype alone: one run with the fp8 cache.
    report = bench("throughput", tmp_path, "--model", "dummy:tiny", "--dataset", "random", "--input-len", "16",
                   "--output-len", "4", "--num-prompts", "4", "--kv-cache-dtype", "fp8")
    assert report["results"]["jaxvllm"]["engine_stats"]["kv_cache_dtype"] == "float8_e4m3fn"
    assert set(report["results"]) == {"jaxvllm"}


def test_throughput_json_schema_constrained_and_not(tmp_path, capsys):
    """Structured outputs: every constrained completion validates, and the unconstrained run
    makes exactly as many output tokens (timing ratios are not asserted: CPU noise)."""
    report = bench("throughput", tmp_path, "--model", "dummy:tiny", "--dataset", "json-schema", "--num-prompts", "8",
                   "--max-model-len", "1024")
    assert "structured outputs:" in capsys.readouterr().out
    s = report["structured_output"]
    assert s["valid_fraction"] == 1.0 and s["num_valid"] == s["num_completions"] == 8
    assert s["output_tokens_per_second_constrained"] > 0 and s["output_tokens_per_second_unconstrained"] > 0
    assert s["ratio"] > 0 and s["mask_steps"] > 0 and s["mask_seconds"] > 0 and s["mask_ms_per_step"] > 0
    constrained = report["results"]["jaxvllm"]
    assert s["unconstrained"]["total_output_tokens"] == constrained["total_output_tokens"] > 8
    assert constrained["structured_output"] == s and report["config"]["output_len"] == ds.JSON_SCHEMA_MAX_TOKENS


def test_json_schema_needs_the_jaxvllm_backend(capsys):
    assert main(["bench", "throughput", "--model", "dummy:tiny", "--dataset", "json-schema", "--backend", "both"]) == 2
    assert "needs --backend jaxvllm" in capsys.readouterr().err


def test_json_schema_requests_and_their_check():
    reqs = ds.json_schema_requests(3, 100, lambda text: list(text.encode()))
    assert len(reqs) == 3 and all(r.output_len == 100 and r.structured_outputs.json == ds.JSON_SCHEMA for r in reqs)
    assert reqs[0].prompt_token_ids != reqs[1].prompt_token_ids
    good = {"name": "Ann", "age": 30, "role": "user", "tags": ["a"], "address": {"city": "Oslo", "zip": 12345}}
    assert ds.is_valid_json(json.dumps(good))
    assert not ds.is_valid_json(json.dumps({**good, "age": 121}))
    assert not ds.is_valid_json(json.dumps(good)[:-1])


def test_vllm_spellings_and_what_would_time_other_work(tmp_path, capsys):
    """vLLM's names of the dataset flags; `python -m` runs the benchmark as the command does;
    a --max-model-len that would cut each request short is refused, as vLLM's latency does."""
    report = bench("throughput", tmp_path, "--model", "dummy:tiny", "--dataset-name", "random", "--num-prompts", "3",
                   "--input-len", "4", "--output-len", "2", "--random-range-ratio", "0.5", "--prefix-len", "8")
    assert report["config"]["range_ratio"] == 0.5 and report["config"]["prefix_len"] == 8
    assert main(["bench", "latency", "--model", "dummy:tiny", "--max-model-len", "20", "--input-len", "8",
                 "--output-len", "16"]) == 2
    assert "less than the longest prompt plus --output-len (8 + 16)" in capsys.readouterr().err
    for module in ("throughput", "latency"):
        done = subprocess.run([sys.executable, "-m", f"jaxvllm.benchmarks.{module}", "--help"], capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 0 and f"usage: python -m jaxvllm.benchmarks.{module}" in done.stdout

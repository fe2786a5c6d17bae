"""The GPU benchmarks' CPU rehearsals (`python -m pallas_kernels.bench --small`,
`python -m jaxvllm.benchmarks.engine_step --small`) and scripts/gpu_check.sh's plan."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from jaxvllm.benchmarks import engine_step
from pallas_kernels import bench

ROOT = Path(__file__).resolve().parents[2]
GPU_CHECK = ROOT / "scripts" / "gpu_check.sh"


def test_bench_small_runs_and_checks_the_kernels(tmp_path, monkeypatch):
    monkeypatch.delenv("OUT", raising=False)
    path = tmp_path / "bench.json"
    results = bench.main(["--small", "--iters", "1", "--json", str(path)])
    assert json.loads(path.read_text())["k1"] == json.loads(json.dumps(results["k1"], default=str))
    (k1,) = results["k1"]
    decode = k1["pallas_decode"]
    assert decode["max_abs_err_vs_reference"] < 0.05 and decode["best_tb_s"] > 0  # bf16
    assert {"xla_reference", "hbm_copy", "jax_pallas_paged_attention"} <= set(k1)
    fp8 = k1["pallas_decode_fp8_cache"]  # the same kernel over an fp8 copy of the cache
    assert fp8["max_abs_err_vs_reference"] < 0.05 and fp8["max_abs_err_vs_bf16_cache"] < 0.25
    assert fp8["kv_bytes"] * 2 == k1["kv_bytes"] and fp8["tb_s"] > 0 and fp8["speedup_vs_bf16"] > 0
    assert fp8["tokens_per_s"] > 0 and fp8["tokens_per_s_bf16"] == decode["tokens_per_s"]
    assert "error" not in k1["xla_reference"] and "error" not in k1["hbm_copy"]
    mixed = results["k1_mixed"]  # mixed context lengths, in three orders of the programs
    for cache in ("bf16", "fp8"):
        for order in ("longest_first", "arrival", "shortest_first"):
            assert mixed[f"{cache}_{order}"]["max_abs_err_vs_reference"] < 0.05, (cache, order)
        assert mixed[f"{cache}_longest_first_speedup"] > 0
    ragged = results["k2"]["pallas_ragged"]
    assert max(ragged["max_abs_err"].values()) < 0.05 and ragged["best_tflop_s"] > 0
    (kv,) = results["kv"]
    assert kv["xla_scatter"]["us"] > 0 and kv["xla_scatter"]["cache_copies_in_hlo"] == 0
    (k3,) = results["k3"]  # the grouped matmul (MoE experts) against ragged_dot
    gmm = k3["pallas_grouped_matmul"]
    assert max(gmm["max_abs_err_vs_ragged_dot"].values()) < 0.05 and gmm["best_tflop_s"] > 0
    assert "error" not in k3["xla_ragged_dot"] and "error" not in k3["dense_batched_einsum_balanced"]
    assert "step" not in results


def test_engine_step_small_runs_every_backend(tmp_path, monkeypatch):
    monkeypatch.setenv("OUT", str(tmp_path))  # the default JSON path
    results = engine_step.main(["--small", "--iters", "1"])
    step = json.loads((tmp_path / "engine_step.json").read_text())["step"]
    assert step == json.loads(json.dumps(results["step"], default=str))
    for backend in ("reference", "pallas", "pallas_fp8"):
        run = step[backend]
        assert run["step_ms"] > 0 and 0 < run["dispatch_ms"] <= run["step_ms"] and run["cache_copies_in_hlo"] == 0
        assert run["pipelined_step_ms"] > 0 and 0 < run["busy_dispatch_ms"] <= run["pipelined_step_ms"]
        assert 0 < run["device_put_busy_dispatch_ms"] <= run["device_put_pipelined_step_ms"]
    # fp8 reads half the bytes: its TB/s is half the bf16 cache's, times its speedup.
    assert step["pallas_fp8"]["kv_tb_s"] == pytest.approx(step["pallas"]["kv_tb_s"] / 2 * step["fp8_speedup_vs_pallas"])
    assert step["greedy_tokens_equal_head"]
    floor = results["floor_step"]
    assert (floor["num_seqs"], floor["context"]) == engine_step.SMALL["floor"] and floor["pallas"]["step_ms"] > 0


@pytest.mark.parametrize("main", [bench.main, engine_step.main])
def test_benchmarks_refuse_full_shapes_on_cpu(main, capsys):
    with pytest.raises(SystemExit):
        main([])
    assert "--small" in capsys.readouterr().err


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
def test_gpu_check_script_parses_and_plans(tmp_path):
    def plan(*args):
        return subprocess.run(["bash", str(GPU_CHECK), "--dry-run", *args], check=True, capture_output=True,
                              text=True).stdout

    subprocess.run(["bash", "-n", str(GPU_CHECK)], check=True)
    base = plan("--base")
    assert "tests/kernels/test_attention.py" in base and "tests/kernels/test_pallas_engine.py" in base
    assert "pallas_kernels.bench --json" in base
    assert "jaxvllm.benchmarks.engine_step --json" in base and "engine_step.json" in base
    assert "b1" not in base and "startup" not in base
    # With no extra named, every extra runs after the base steps, those never measured on a GPU first.
    everything = plan()
    steps = [line.split()[1] for line in everything.splitlines() if line.startswith("== ")]
    assert steps == ["env", "kernels", "engine", "bench", "engine_step", "spec_b1", "spec_b16", "quant_fp8",
                     "quant_int4", "b1", "lora", "weight_update", "startup_qwen3-0.6b", "startup_llama3-8b"]
    startup = plan("--startup")
    assert "startup --model dummy:qwen3-0.6b --runs cold warm --max-model-len 2048" in startup
    assert "startup --model dummy:llama3-8b --runs cold --max-model-len 2048" in startup
    assert "startup_llama3-8b.json" in startup and "b1" not in startup
    b1 = plan("--b1")
    assert "--dataset nanovllm --compare-kv-cache-dtype" in b1 and "b1.json" in b1
    assert "quant_" not in b1 and "startup" not in b1
    quant = plan("--quant")
    assert "--model dummy:llama3-8b --batch-size 1" in quant
    assert "--quantization gptq-dummy --compare-quantization" in quant
    live = plan("--live")
    assert "--num-loras 4 --max-lora-rank 16" in live and "lora.json" in live
    assert "weight_update --model dummy:qwen3-0.6b dummy:llama3-8b" in live and "weight_update.json" in live
    assert "lora" not in quant
    spec = plan("--spec")
    assert "--dataset repeat --batch-size 16" in spec and "--compare-speculative" in spec and "spec_b1.json" in spec
    assert "spec_b" not in live
    small = plan("--small")
    assert "pallas_kernels.bench --small" in small and "jaxvllm.benchmarks.engine_step --small" in small
    assert "startup --model dummy:tiny" in small
    bad = subprocess.run(["bash", str(GPU_CHECK), "--bogus"], capture_output=True, text=True)
    assert bad.returncode == 2
    # A spent budget skips the steps, each named in the summary.
    spent = subprocess.run(["bash", str(GPU_CHECK), "--small", "--base", "--budget", "1"], capture_output=True,
                           text=True, env=dict(os.environ, OUT=str(tmp_path)))
    assert spent.returncode == 0, spent.stdout + spent.stderr
    summary = (tmp_path / "summary.txt").read_text().splitlines()
    assert summary == [f"{name} skipped=budget" for name in ("env", "kernels", "engine", "bench", "engine_step")]

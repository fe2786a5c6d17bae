"""The kernel benchmark (`python -m pallas_kernels.bench --small`) and scripts/gpu_check.sh, on CPU."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from pallas_kernels import bench

ROOT = Path(__file__).resolve().parents[1]
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
    assert "error" not in k1["xla_reference"] and "error" not in k1["hbm_copy"]
    ragged = results["k2"]["pallas_ragged"]
    assert max(ragged["max_abs_err"].values()) < 0.05 and ragged["best_tflop_s"] > 0
    step = results["step"]
    assert step["reference"]["step_ms"] > 0 and step["pallas"]["step_ms"] > 0
    assert step["greedy_tokens_equal_head"]
    (kv,) = results["kv"]
    assert kv["xla_scatter"]["us"] > 0 and kv["xla_scatter"]["cache_copies_in_hlo"] == 0


def test_bench_refuses_full_shapes_on_cpu(capsys):
    with pytest.raises(SystemExit):
        bench.main([])
    assert "--small" in capsys.readouterr().err


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
def test_gpu_check_script_parses_and_plans():
    subprocess.run(["bash", "-n", str(GPU_CHECK)], check=True)
    out = subprocess.run(["bash", str(GPU_CHECK), "--dry-run"], check=True, capture_output=True, text=True).stdout
    assert "tests/test_kernels.py" in out and "tests/test_pallas_engine.py" in out
    assert "pallas_kernels.bench --json" in out
    small = subprocess.run(["bash", str(GPU_CHECK), "--small", "--dry-run"], check=True, capture_output=True,
                           text=True).stdout
    assert "pallas_kernels.bench --small" in small
    bad = subprocess.run(["bash", str(GPU_CHECK), "--bogus"], capture_output=True, text=True)
    assert bad.returncode == 2

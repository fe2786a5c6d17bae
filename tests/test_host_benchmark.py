"""The benchmark scripts run end to end at small sizes and write their figures."""

import json

from jaxvllm.benchmarks.host_step import PARTS, main


def test_host_step_benchmark_writes_json(tmp_path, capsys):
    path = tmp_path / "host.json"
    main(["--num-requests", "32", "--steps", "3", "--prompt-len", "64", "--output-len", "8", "--json", str(path)])
    assert "outputs" in capsys.readouterr().out
    (result,) = json.loads(path.read_text())
    assert result["num_requests"] == 32 and result["steps"] == 3 and result["prefill_steps"] >= 1
    for part in PARTS:
        figures = result["parts"][part]
        assert all(figures[k] > 0 for k in ("mean_ms", "p50_ms", "p90_ms", "us_per_request")), (part, figures)
    parts = result["parts"]
    assert parts["total"]["mean_ms"] >= parts["schedule"]["mean_ms"] + parts["prepare"]["mean_ms"] + parts["update"]["mean_ms"]


def test_generate_vs_hf_benchmark(tmp_path):
    from jaxvllm.benchmarks.generate_vs_hf import main as generate_vs_hf

    path = tmp_path / "vs.json"
    result = generate_vs_hf(["--num-prompts", "4", "--max-prompt-len", "20", "--max-tokens", "4",
                             "--max-num-batched-tokens", "64", "--json", str(path)])
    assert json.loads(path.read_text()) == result
    assert result["identical_completions"] == 4
    assert result["jaxvllm_generate_s"] > 0 and result["hf_sequential_s"] > 0 and result["speedup"] > 0

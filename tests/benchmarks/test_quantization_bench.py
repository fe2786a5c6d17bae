"""`--quantization fp8` on the command line and `bench latency|throughput --compare-quantization`,
on dummy:tiny (timing ratios are not asserted: CPU noise)."""

import contextlib
import io
import json

import pytest

from jaxvllm.cli import main

# test_bench.py's buckets (compiled once per session).
ENGINE = ["--max-model-len", "128", "--max-num-batched-tokens", "32", "--max-num-seqs", "8", "--disable-tqdm",
          "--quantization", "fp8"]
KEYS = {"output_tokens_per_second_quantized", "output_tokens_per_second_unquantized", "speedup",
        "identical_completions", "num_completions", "mean_share_before_first_difference"}


@pytest.mark.parametrize("kind, args", [
    ("latency", ["--batch-size", "2", "--input-len", "8", "--output-len", "8", "--num-iters-warmup", "1",
                 "--num-iters", "2"]),
    ("throughput", ["--num-prompts", "4", "--input-len", "8", "--output-len", "8"]),
])
def test_compare_quantization(tmp_path, kind, args):
    path = tmp_path / "report.json"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["bench", kind, "--model", "dummy:tiny", *ENGINE, "--output-json", str(path), *args,
                     "--compare-quantization"]) == 0
    report = json.loads(path.read_text())
    q = report["quantization"]
    assert KEYS <= set(q) and q["num_completions"] == 4
    assert 0 <= q["identical_completions"] <= q["num_completions"] and 0 <= q["mean_share_before_first_difference"] <= 1
    assert set(report["results"]) == {"jaxvllm", "jaxvllm_unquantized"}
    assert report["config"]["engine_args"]["quantization"] == "fp8"
    if kind == "throughput":  # the engine's figures: fp8 weights take less room
        assert sum(q["weight_bytes_quantized"]) < sum(q["weight_bytes_unquantized"])
        assert report["results"]["jaxvllm"]["engine_stats"]["quantization"] == "fp8"
        assert report["results"]["jaxvllm_unquantized"]["engine_stats"]["quantization"] is None
    assert "quantization: " in out.getvalue() and "unquantized" in out.getvalue()


@pytest.mark.parametrize("kind", ["latency", "throughput"])
def test_compare_quantization_needs_a_method_and_jaxvllm(capsys, kind):
    assert main(["bench", kind, "--model", "dummy:tiny", "--compare-quantization"]) == 2
    assert "--compare-quantization needs --quantization" in capsys.readouterr().err
    assert main(["bench", kind, "--model", "dummy:tiny", "--backend", "hf", "--compare-quantization",
                 "--quantization", "fp8"]) == 2
    assert "--compare-quantization needs the jaxvllm backend" in capsys.readouterr().err
    assert main(["generate", "--model", "dummy:tiny", "--prompt", "hi", "--quantization", "int3"]) == 2
    assert "quantization='int3' is not supported" in capsys.readouterr().err

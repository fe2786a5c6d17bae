"""The loglikelihood benchmark on a tiny checkpoint: both workloads through jaxvllm's
lm-eval backend, the whole-prompt path and lm-eval's `hf` backend, with equal scores."""

import json

import pytest

pytest.importorskip("lm_eval", reason="the eval extra is not installed: pip install -e '.[eval]'")
pytest.importorskip("accelerate", reason="lm-eval's hf backend (the reference) needs accelerate (test extra)")

from jaxvllm.benchmarks.loglikelihood import main, workload  # noqa: E402


def test_workload_shapes():
    mmlu = workload("mmlu", 8, vocab_size=512)
    assert len(mmlu) == 8 and all(len(doc) == 4 for doc in mmlu)
    assert all(len(t) == 1 and 560 <= len(c) <= 640 for doc in mmlu for _, c, t in doc)
    assert mmlu[0][0][1][:480] == mmlu[4][0][1][:480]  # one subject's few-shot prefix, shared
    hellaswag = workload("hellaswag", 3, vocab_size=512)
    assert all(70 <= len(c) <= 90 and 15 <= len(t) <= 25 for doc in hellaswag for _, c, t in doc)


@pytest.mark.slow
def test_scores_equal_hf(tiny_checkpoint, tmp_path, capsys):
    out = tmp_path / "ll.json"
    main(["--model", str(tiny_checkpoint("llama")), "--docs", "4", "--max-model-len", "1024",
          "--hf-batch-size", "4", "--hf-float64", "--json", str(out)])
    assert "docs/s" in capsys.readouterr().out
    report = json.loads(out.read_text())
    for name in ("mmlu", "hellaswag"):
        figures = report["workloads"][name]
        assert figures["jaxvllm"]["max_abs_diff"] < 1e-4 and figures["jaxvllm"]["greedy_differs"] == 0
        assert figures["jaxvllm_full_prompt"]["max_abs_diff"] < 1e-5
        assert figures["speedup_vs_hf"] > 0 and figures["speedup_vs_full_prompt"] > 0
        for backend in ("jaxvllm", "hf"):  # each float32 run near the float64 scores, the flags equal
            assert figures["float64"][backend]["max_abs_diff"] < 1e-4
            assert figures["float64"][backend]["greedy_differs"] == 0
    assert report["jaxvllm_stats"]["prefix_cache_hits"] > 0  # the shared contexts were read from the cache


def test_refuses_what_would_compare_different_work(tiny_checkpoint, capsys):
    """No documents, or a max_model_len under the workload's prompts (each backend would
    truncate its own way, and the report would compare different windows): clear errors."""
    with pytest.raises(SystemExit):
        main(["--model", str(tiny_checkpoint("llama")), "--docs", "0"])
    assert "--docs 0" in capsys.readouterr().err
    with pytest.raises(ValueError, match="mmlu workload's longest request is .* --max-model-len must be at least"):
        main(["--model", str(tiny_checkpoint("llama")), "--docs", "1", "--workloads", "mmlu", "--max-model-len", "256",
              "--no-full-prompt"])

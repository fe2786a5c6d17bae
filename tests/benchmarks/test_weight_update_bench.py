"""`python -m jaxvllm.benchmarks.weight_update` runs end to end on dummy:tiny and reports every figure,
at once and one layer a call (`--by-layer`, as it runs an 8B model on a CPU)."""

import json

import pytest

from jaxvllm.benchmarks import weight_update


@pytest.mark.parametrize("by_layer", [False, True])
def test_weight_update_benchmark(tmp_path, by_layer):
    weight_update.main(["--model", "dummy:tiny", "--json", str(tmp_path / "out.json")] + ["--by-layer"] * by_layer)
    figures = json.loads((tmp_path / "out.json").read_text())["models"]["dummy:tiny"]
    assert figures["by_layer"] is by_layer
    for key in ("new_llm", "update_host", "update_device_hf", "update_device_own", "sleep_2", "wake_2_weights",
                "wake_2_kv_cache", "update_host_vs_new_llm") + (() if by_layer else ("sleep_1", "wake_1")):
        assert figures[key] > 0, key

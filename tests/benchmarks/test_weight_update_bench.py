"""`python -m jaxvllm.benchmarks.weight_update` runs end to end on dummy:tiny and reports every figure."""

import json

from jaxvllm.benchmarks import weight_update


def test_weight_update_benchmark(tmp_path):
    weight_update.main(["--model", "dummy:tiny", "--json", str(tmp_path / "out.json")])
    figures = json.loads((tmp_path / "out.json").read_text())["models"]["dummy:tiny"]
    for key in ("new_llm", "update_host", "update_device_hf", "update_device_own", "sleep_1", "wake_1", "sleep_2",
                "wake_2_weights", "wake_2_kv_cache", "update_host_vs_new_llm"):
        assert figures[key] > 0, key

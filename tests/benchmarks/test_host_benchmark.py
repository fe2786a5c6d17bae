"""The benchmark scripts run end to end at small sizes and write their figures."""

import json

from jaxvllm.benchmarks.host_step import PARTS, main


def test_host_step_benchmark_writes_json(tmp_path, capsys):
    path = tmp_path / "host.json"
    main(["--num-requests", "32", "--steps", "3", "--prompt-len", "64", "--output-len", "8", "--device-ms", "4",
          "--json", str(path)])
    assert "outputs" in capsys.readouterr().out
    (result,) = json.loads(path.read_text())
    assert result["num_requests"] == 32 and result["steps"] == 3 and result["prefill_steps"] >= 1
    assert list(result["parts"]) == [p for p in PARTS if p != "propose"]  # (no drafts without --ngram)
    for part, figures in result["parts"].items():
        assert all(figures[k] > 0 for k in ("mean_ms", "p50_ms", "p90_ms", "us_per_request")), (part, figures)

    pipe = result["pipelining"]
    (row,) = pipe["rows"]
    assert row["device_ms"] == 4 and pipe["host_ms_sync"] > 0 and pipe["host_ms_async"] > 0
    # Bounds the stub device sets, whatever the machine: a synchronous step waits for its own
    # device step, and async steps still queue on one stream (3 steps take at least 2 of D).
    assert row["sync_wall_ms"] >= 4 and row["async_wall_ms"] >= 4 * 2 / 3
    assert 0 < row["async_device_busy"] <= 1 and 0 < row["sync_device_busy"] <= 1


def test_host_step_with_ngram_drafts_times_the_proposer(tmp_path):
    path = tmp_path / "host.json"
    main(["--num-requests", "16", "--steps", "3", "--prompt-len", "64", "--ngram", "4", "--device-ms",
          "--json", str(path)])
    (result,) = json.loads(path.read_text())
    assert result["ngram"] == 4 and result["parts"]["propose"]["mean_ms"] > 0

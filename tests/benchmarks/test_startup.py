"""Start-up: the benchmark's cold and warm starts, each in a fresh process, and what they
show: a warm-up that compiles without running, served whole by the persistent
compilation cache in a second process."""

import json

import pytest

from jaxvllm.benchmarks.startup import main
from jaxvllm.config import EngineConfig


@pytest.mark.slow
def test_second_process_compiles_nothing(tmp_path, capsys):
    path = tmp_path / "startup.json"
    main(["--model", "dummy:tiny", "--max-model-len", "64", "--json", str(path)])
    assert "dummy:tiny" in capsys.readouterr().out
    cold, warm = json.loads(path.read_text())["results"]["dummy:tiny"]
    assert (cold["run"], warm["run"]) == ("cold", "warm")
    for run in (cold, warm):
        assert run["ready_seconds"] > run["warmup_seconds"] > 0 and run["load_seconds"] > 0
        # (a CPU is ready after its smallest bucket; the figures cover the rest, compiled after)
        assert run["all_compiled_seconds"] >= run["ready_seconds"] and run["pending_at_ready"] > 0
        assert run["warmup_done_seconds"] >= run["warmup_seconds"]
        assert run["profile_seconds"] >= 0
        assert run["max_num_batched_tokens"] == 256 == run["token_buckets"][-1]  # dummy:tiny's own default
        assert run["token_buckets"][:3] == [1, 4, 16]  # (a CPU's)
    # every bucket and warmed sampler variant was compiled, the first time for real ...
    assert cold["warmup_compilations"] >= len(cold["token_buckets"]) and cold["compilation_cache_hits"] == 0
    # ... and in a second process entirely from the persistent cache
    assert warm["warmup_compilations"] == cold["warmup_compilations"]
    assert warm["compilation_cache_hits"] == warm["warmup_compilations"] and warm["compilation_cache_misses"] == 0


def test_max_num_batched_tokens_defaults_by_platform():
    config = EngineConfig(model="m")
    assert config.max_num_batched_tokens is None  # chosen when the engine knows its platform
    assert config.for_platform("cpu").max_num_batched_tokens == 2048
    assert config.for_platform("gpu").max_num_batched_tokens == 8192
    # a full decode batch fits one step; given buckets decide; a value given is kept
    assert EngineConfig(model="m", max_num_seqs=4096).for_platform("cpu").max_num_batched_tokens == 4096
    assert EngineConfig(model="m", max_num_seqs=8, token_buckets=[8, 24]).for_platform("gpu").max_num_batched_tokens == 24
    assert EngineConfig(model="m", max_num_seqs=8, max_num_batched_tokens=64).for_platform("cpu").max_num_batched_tokens == 64


def test_a_cold_start_ignores_the_users_cache_folder(monkeypatch):
    """JAX's own JAX_COMPILATION_CACHE_DIR would win over the benchmark's new folder: the
    child process does not get it, so a "cold" start finds an empty cache."""
    import subprocess

    from jaxvllm.benchmarks import startup

    seen = {}

    def run(args, env=None, **kwargs):
        seen.update(env)
        return subprocess.CompletedProcess(args, 0, stdout='{"ok": 1}\n', stderr="")

    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", "/somewhere/warm")
    monkeypatch.setattr(startup.subprocess, "run", run)
    assert startup.start_in_child("dummy:tiny", "/tmp/new", {}) == {"ok": 1}
    assert "JAX_COMPILATION_CACHE_DIR" not in seen and seen.get("PATH")

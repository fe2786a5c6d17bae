"""Multi-host on one machine: two processes joined by `jax.distributed`, four CPU devices
each, every process running tests/distributed/multihost_worker.py (JAX's multi-controller model).
The outputs must equal one process's on one device, in both processes."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from jaxvllm import LLM, EngineConfig
from tests.distributed.multihost_worker import ENGINE, run, with_adapter
from weights.make_lora import make_lora
from weights.make_tiny import make_tiny

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("multihost")
    for seed, name in ((0, "llama-8-heads"), (1, "llama-8-heads-seed-1")):
        make_tiny("llama", folder / name, seed=seed, num_attention_heads=8, num_key_value_heads=2, head_dim=16)
    make_lora(folder / "llama-8-heads", folder / "adapter", rank=8)
    return folder


@pytest.fixture(scope="module")
def results(model) -> list[dict]:
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu",
               PYTHONPATH=str(ROOT))
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, str(ROOT / "tests" / "distributed" / "multihost_worker.py"), str(model), port, str(rank)],
                              cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank in (0, 1)]
    outs = []
    try:
        for proc in procs:
            stdout, stderr = proc.communicate(timeout=900)
            assert proc.returncode == 0, stderr[-5000:]
            outs.append(json.loads(stdout.strip().splitlines()[-1]))
    finally:
        for proc in procs:
            proc.kill()
    return outs


@pytest.fixture(scope="module")
def one_device(model) -> list:
    with LLM(model / "llama-8-heads", **ENGINE) as llm:
        return run(llm)


@pytest.fixture(scope="module")
def other_checkpoint(model) -> list:
    with LLM(model / "llama-8-heads-seed-1", **ENGINE) as llm:
        return run(llm)


@pytest.mark.parametrize("name", ["host", "device", "dp2_tp4"])
def test_update_weights_in_every_process(results, other_checkpoint, name):
    """Every process gives the other checkpoint's tensors: host arrays, or a multi-controller
    trainer's global arrays (on the engine's devices without a host round trip: a transfer
    guard is on), also into two replicas on 4 devices each."""
    for r in results:
        given, tensors = r["updates"]["count"]
        assert given == tensors
        assert r["updates"][name] == other_checkpoint


def test_processes_giving_different_updates_get_an_error(results, one_device):
    for r in results:
        errors = r["updates"]["errors"]
        assert errors["update"].startswith("update_weights: the 2 processes gave different tensors")
        assert errors["values"].startswith("update_weights: the 2 processes gave different tensors")
        assert r["updates"]["after_update_error"] == one_device  # nothing changed


def test_lora_adapters_across_processes(results, model):
    """TP 8 over both processes, every other prompt under an adapter: one device's outputs."""
    want = with_adapter(model / "llama-8-heads", model / "adapter")
    assert results[0]["lora_tp8"] == want and results[1]["lora_tp8"] == want


def test_two_processes_of_four_devices(results):
    for r in results:
        assert (r["processes"], r["devices"], r["local_devices"]) == (2, 8, 4)


@pytest.mark.parametrize("name", ["tp8", "tp2_pallas", "dp2_tp4", "after_error"])
def test_outputs_equal_one_device_in_every_process(results, one_device, name):
    """Greedy and seeded sampling (n=2) alike."""
    assert results[0][name] == one_device
    assert results[1][name] == one_device


def test_every_engine_spans_both_processes(results):
    assert results[0]["tp8_processes"] == [[0, 1]]
    assert results[0]["tp2_pallas_processes"] == [[0, 1]]  # one device of each
    assert results[0]["dp2_tp4_processes"] == [[0, 1], [0, 1]]  # each replica: two devices of each


def test_kv_cache_is_sized_from_the_process_with_least_room(results):
    """Process 1 peaks at 30 MiB of a 50 MiB budget: both allocate what fits there."""
    per_device = results[0]["sizing"]["bytes_per_block"] // 8
    assert results[0]["sizing"]["num_blocks"] == results[1]["sizing"]["num_blocks"] == (20 << 20) // per_device


def test_processes_with_different_requests_get_an_error(results):
    """Different prompts, or the same prompt with a cache salt in one process only (whose
    prefix-cache hits would differ)."""
    for r in results:
        assert r["errors"]["differ"].startswith("the 2 processes hold different requests")
        assert r["errors"]["salt"].startswith("the 2 processes hold different requests")


def test_processes_given_different_arguments_get_an_error(results):
    """A seed, a max_model_len, hf_overrides or a config.json of one process's own is named before
    anything loads (the steps would differ, and the processes wait on each other for good)."""
    for r in results:
        for name in ("seed", "max_model_len", "hf_overrides, config.json", "config.json"):
            assert r["errors"]["arguments_" + name].startswith(f"the 2 processes were given different {name}: ")


def test_what_processes_may_set_each_their_own_way():
    """Paths (the draft model's and the generation config's too) and the memory budget are
    each process's own; a function is compared by its name, not its address."""
    def config(model, draft, budget, seed=0):
        return EngineConfig(model=model, gpu_memory_utilization=budget, seed=seed, hf_overrides=lambda c: c,
                            generation_config=model + "-generation",  # (its file is compared as read)
                            speculative_config={"method": "draft_model", "model": draft, "num_speculative_tokens": 2})

    mine = config("/host0/model", "/host0/draft", 0.5).shared_fields()
    assert mine == config("/host1/model", "/host1/draft", 0.9).shared_fields()
    assert mine["hf_overrides"].endswith("_own_way.<locals>.config.<locals>.<lambda>")
    assert mine != config("/host1/model", "/host1/draft", 0.9, seed=1).shared_fields()


def test_a_step_left_in_flight_does_not_overlap_the_next_check(results, one_device):
    """TP 2 over one device of each process: requests that stop early leave their engine's
    last step unread; the next call's check across processes (over all 8 devices) waits
    for it (the collectives overlapped: gloo aborted both processes)."""
    for r in results:
        assert r["after_early_stops"] == [one_device[:2]] * 4


def test_an_engine_must_split_evenly_over_the_processes(results):
    assert results[0]["errors"]["tp1"].startswith("tensor_parallel_size=1 over 2 processes")
    assert results[0]["errors"]["tp3"].startswith("tensor_parallel_size=3 over 2 processes")

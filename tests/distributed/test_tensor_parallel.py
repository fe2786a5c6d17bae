"""Tensor parallelism on 8 CPU devices (XLA's forced host device count), checked in a
process of its own: tests/distributed/tensor_parallel_worker.py runs every engine once and reports."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu",
               PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "distributed" / "tensor_parallel_worker.py"),
                           str(tmp_path_factory.mktemp("tp"))], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=1200)
    assert proc.returncode == 0, proc.stderr[-5000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_eight_devices(results):
    assert results["devices"] == 8


@pytest.mark.parametrize("name", ["llama", "mistral", "qwen2", "qwen3", "llama-8-heads", "qwen3_moe", "mixtral"])
def test_greedy_parity_with_one_device_and_hf(results, name):
    case = results["cases"][name]
    assert case["tp1"] == case["hf"]
    sizes = [key for key in case if re.fullmatch(r"tp\d+", key)]
    assert len(sizes) >= 3
    for key in sizes:
        assert case[key] == case["tp1"], key


@pytest.mark.parametrize("name", ["qwen3", "qwen3_moe"])
def test_stacked_layer_weights_split_as_one_layer(results, name):
    """Layer weights stacked (a GPU's layout) over 4 devices: each stack split on its head
    axis, never on its layer axis, and the same greedy outputs as one device's per-layer weights."""
    case = results["cases"][name]
    assert case["tp4_stacked"] == case["tp1"]
    shape, shards = case["tp4_stacked_q_proj"]
    assert shards == [[shape[0], shape[1] // 4, *shape[2:]]]  # JSON gives lists


def test_kv_heads_are_repeated_when_fewer_than_devices(results):
    assert results["cases"]["qwen3"]["tp2_kv_heads"] == 2  # 1 KV head, repeated for 2 devices
    assert results["cases"]["qwen3"]["tp4_kv_heads"] == 4
    assert results["cases"]["qwen2"]["tp2_kv_heads"] == 4  # 4 KV heads: split 2 per device
    assert results["cases"]["llama-8-heads"]["tp8_kv_heads"] == 8


def test_pallas_kernels_per_device(results):
    case = results["cases"]["qwen3"]
    assert case["tp4_pallas"] == case["tp1"]


def test_each_device_holds_its_share(results):
    """8 query heads (head_dim 16), 2 KV heads repeated to 8, hidden 64, MLP 128, vocab 512,
    over 8 devices: every split parameter has 1/8 per device (q/k/v: one KV head with its one
    query head); norms are whole everywhere."""
    shards = results["cases"]["llama-8-heads"]["shards"]
    # (a CPU's layer matrices are stored inputs first: hidden leads qkv's and gate/up's)
    assert shards["qkv_proj"] == [[64, 1, 3, 16], 8]
    assert shards["o_proj"] == [[1, 16, 64], 8]
    assert shards["gate_up_proj"] == [[64, 2, 16], 8]
    assert shards["down_proj"] == [[16, 64], 8]
    assert shards["embed"] == [[64, 64], 8]
    assert shards["input_norm"] == [[64], 8]
    assert shards["k_cache"][0][0] == 1 and shards["k_cache"][-1] == 8


def test_experts_split_by_intermediate_dimension(results):
    """8 experts of intermediate 32 over 4 devices: every device holds 8 experts x 8 columns."""
    shards = results["cases"]["qwen3_moe"]["moe_shards"]
    assert shards["experts_gate"] == shards["experts_up"] == [[8, 64, 8]]
    assert shards["experts_down"] == [[8, 8, 64]]
    assert shards["router"] == [[8, 64]]


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_expert_parallel_greedy_parity(results, name):
    """enable_expert_parallel at 2 and 4 devices (Mixtral's 4 experts: one per device) gives
    one device's tokens, and the Pallas grouped matmul per device those of the reference."""
    case = results["cases"][name]
    for tp in (2, 4):
        assert case[f"tp{tp}_ep"] == case["tp1"], tp
    if name == "qwen3_moe":
        assert case["tp2_ep_pallas"] == case["tp1"]


def test_expert_parallel_holds_whole_experts(results):
    """Expert parallelism: each device holds E / N whole experts (never all of them gathered
    into one step); the router is replicated."""
    moe, mixtral = results["cases"]["qwen3_moe"], results["cases"]["mixtral"]
    shards = moe["tp4_ep_shards"]
    assert shards["experts_gate"] == shards["experts_up"] == [[2, 64, 32]]  # 8 experts of 32 over 4
    assert shards["experts_down"] == [[2, 32, 64]]
    assert shards["router"] == [[8, 64]]
    assert moe["tp2_ep_shards"]["experts_gate"] == [[4, 64, 32]]
    assert mixtral["tp4_ep_shards"]["experts_down"] == [[1, 64, 64]]  # 4 experts of 64: one each
    for case in (moe, mixtral):
        assert case["ep_hlo"]["gathers"] == 0
        assert case["ep_hlo"]["all_reduces"] >= 2 * case["ep_hlo"]["num_layers"]


def test_gemma3_greedy_parity_tp2(results):
    case = results["cases"]["gemma3"]
    assert case["tp1"] == case["hf"]
    assert case["tp2"] == case["tp1"]
    assert case["tp2_kv_heads"] == 2  # 2 KV heads: one per device


def test_no_kv_cache_is_gathered(results):
    hlo = results["cases"]["llama-8-heads"]["hlo"]
    assert hlo["gathers"] == 0
    assert hlo["all_reduces"] >= 2 * hlo["num_layers"]  # o_proj and down_proj partial sums


def test_kv_cache_is_sized_from_the_device_with_least_room(results):
    """gpu_memory_utilization=0.5 of 100 MiB per device; device 3 peaks at 30 MiB, the others
    at 10: blocks = (50 - 30) MiB / the per-device bytes of a block (a quarter of it)."""
    sizing = results["sizing"]
    per_device = sizing["bytes_per_block"] // 4
    assert sizing["num_blocks"] == (20 << 20) // per_device
    assert len(sizing["per_device"]) == 4
    assert all(d["num_blocks"] == sizing["num_blocks"] and d["bytes"] == sizing["num_blocks"] * per_device
               for d in sizing["per_device"])


def test_data_parallel_replicas_give_one_replicas_outputs(results):
    dp = results["dp"]
    assert dp["dp2"] == dp["dp1"] and dp["dp2tp2"] == dp["dp1"]  # greedy and seeded sampling alike
    assert dp["dp2_engines"] == ["0", "1"] and dp["dp2tp2_engines"] == ["0", "1"]
    # requests spread over both replicas (by load: prompt + max tokens), none left running
    assert all(n > 0 for n in dp["dp2_finished_per_engine"].values())
    assert dp["dp2_replicas"] == [0, 0]
    # enqueue + wait_for_completion as generate; prompts queued one call at a time still spread
    assert dp["dp1_enqueued"] == dp["dp2_enqueued"] == dp["dp2tp2_enqueued"] == dp["dp1"]
    assert dp["dp1_reloaded"] != dp["dp1"]
    assert dp["dp2_reloaded"] == dp["dp2tp2_reloaded"] == dp["dp1_reloaded"]
    assert len(dp["dp1_updated"]) == 1 and dp["dp1_updated"][0] > 0
    assert dp["dp2_updated"] == dp["dp2tp2_updated"] == dp["dp1_updated"] * 2
    assert dp["dp2_enqueued_per_replica"] == dp["dp2tp2_enqueued_per_replica"] == [4, 4]


def test_bad_sizes_are_refused_naming_the_numbers(results):
    assert results["errors"]["3"] == "tensor_parallel_size=3 does not divide num_attention_heads=4"
    assert results["errors"]["16"].startswith("tensor_parallel_size=16 exceeds the 8 cpu device(s)")
    assert results["errors"]["4x4"].startswith("tensor_parallel_size=4 x data_parallel_size=4 needs 16 devices")
    assert results["errors"]["ep"] == "tensor_parallel_size=4 with enable_expert_parallel does not divide the 6 experts"



def test_speculative_decoding_tp2_greedy_parity(results):
    """n-gram drafts verified on 2 devices: the greedy outputs of one device without them."""
    spec = results["spec"]
    assert spec["tp2_spec"] == spec["tp1"]
    stats = spec["tp2_spec_stats"]
    assert 0 < stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"]


def test_draft_model_tp2_greedy_parity(results):
    """A draft model split over 2 devices as the target is (here the target itself: every draft accepted)."""
    spec = results["spec"]
    assert spec["tp2_draft"] == spec["tp1"]
    assert spec["tp2_draft_stats"]["spec_decode_acceptance_rate"] == 1.0


def test_eagle_heads_tp2_greedy_parity(results):
    """EAGLE and EAGLE-3 heads split over 2 devices: the greedy outputs of one device without
    drafts, and the drafts of one device with them (the same counts accepted)."""
    spec = results["spec"]
    for method in ("eagle", "eagle3"):
        assert spec[f"tp2_{method}"] == spec[f"tp1_{method}"] == spec["tp1"]
        assert spec[f"tp2_{method}_stats"] == spec[f"tp1_{method}_stats"]
    assert spec["tp2_eagle_stats"]["spec_decode_num_accepted_tokens"] > 0

"""Tensor-parallel checks on 8 CPU devices, run by tests/distributed/test_tensor_parallel.py in a process
of its own (the device count is fixed when jax starts): prints one JSON object of results.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/distributed/tensor_parallel_worker.py DIR
"""

from __future__ import annotations

import contextlib
import json
import re
import sys
from pathlib import Path

import jax
import torch
from transformers import AutoModelForCausalLM

import jaxvllm.loader as loader
from jaxvllm import LLM, SamplingParams
from jaxvllm.models import MODELS
from jaxvllm.models.common import layer_params
from tests.models.paged import hf_greedy
from tests.spec_decode.eagle_heads import make_head, passing_head
from weights.make_tiny import make_tiny

ENGINE = dict(max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64, token_buckets=[64])
PROMPTS = [list(range(5, 5 + n)) for n in (3, 17, 40)]
MAX_TOKENS = 8
# (name, arch, config overrides, tensor-parallel sizes): every tiny architecture (4 query
# heads, 1-4 KV heads), and 8 query heads over 2 KV heads for 8 devices (KV heads repeated 4x).
CASES = [
    ("llama", "llama", {}, (2, 4)),
    ("mistral", "mistral", {}, (2, 4)),
    ("qwen2", "qwen2", {}, (2, 4)),
    ("qwen3", "qwen3", {}, (2, 4)),
    ("llama-8-heads", "llama", dict(num_attention_heads=8, num_key_value_heads=2, head_dim=16), (2, 4, 8)),
    # Mixture of experts (layer 0 sparse: 8 experts of 32, top 2; layer 1 dense; Mixtral: 4
    # experts, both layers sparse): experts split by their intermediate dimension, and whole
    # (enable_expert_parallel: the "_ep" runs).
    ("qwen3_moe", "qwen3_moe", {}, (2, 4)),
    ("mixtral", "mixtral", {}, (2, 4)),
    # Gemma 3: sliding and global layers with their two RoPEs, four (1 + w) norms per layer.
    ("gemma3", "gemma3", {}, (2,)),
]


def greedy(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params,
                                                           use_tqdm=False)]


def hf_completions(path: Path) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    return hf_greedy(model, PROMPTS, MAX_TOKENS)


@contextlib.contextmanager
def stacked_layers():
    """Engines made inside load their layer weights stacked, as on a GPU (a CPU's default
    is one array per layer)."""
    default = loader.stacks_layers
    loader.stacks_layers = lambda device: True
    try:
        yield
    finally:
        loader.stacks_layers = default


def first_layer(runner) -> dict:
    """Layer 0's params: its slices of the stacks, placed as the stacks are."""
    return layer_params(runner.params, MODELS[runner.cfg.architecture].param_specs(runner.cfg), 0)


def shard_shapes(llm: LLM) -> dict[str, list]:
    """The shape of every device's block of a few parameters (a matrix stored inputs first:
    of its value) and of a KV cache."""
    runner = llm.llm_engine.runner
    layer = first_layer(runner)
    arrays = {name: getattr(layer[name], "value", layer[name])
              for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "input_norm")}
    arrays["embed"] = runner.params["embed"]
    arrays["k_cache"] = runner.kv_caches[0]
    return {name: sorted({tuple(s.data.shape) for s in a.addressable_shards}) + [len(a.addressable_shards)]
            for name, a in arrays.items()}


def all_gathers(llm: LLM, shape: tuple) -> dict:
    """All-gathers in the compiled forward whose result has `shape` (a whole KV cache, a
    layer's whole stack of experts), and the all-reduces."""
    runner = llm.llm_engine.runner
    b = runner.builder
    batch = b.padding_batch(b.buckets[-1], b.widths[-1], None)
    packed = jax.device_put(batch.packed, runner._replicated)
    hlo = runner._forward.lower(runner.params, runner.kv_caches, packed, runner.last_sampled,
                                layout=batch.layout).compile().as_text()
    dims = ",".join(map(str, shape))
    gathers = [line for line in hlo.splitlines() if "all-gather" in line and f"[{dims}]" in line]
    return {"gathers": len(gathers), "all_reduces": len(re.findall(r"= \S+ all-reduce(?:-start)?\(", hlo)),
            "num_layers": runner.cfg.num_layers}


def expert_shards(llm: LLM) -> dict[str, list]:
    """The shape of every device's block of the first layer's router and experts."""
    layer = first_layer(llm.llm_engine.runner)
    return {n: sorted({tuple(s.data.shape) for s in layer[n].addressable_shards})
            for n in ("router", "experts_gate", "experts_up", "experts_down")}


def per_device_sizing(path: Path) -> dict:
    """KV blocks sized from the device with the least room: fake allocator figures where
    device 3 has the highest peak (100 MiB total on each, JAX's 0.75 limit)."""
    import jaxvllm.kv_cache as kv_cache

    def stats(device):
        peak = (30 if device.id == 3 else 10) << 20
        return {"bytes_limit": 75 << 20, "bytes_in_use": peak, "peak_bytes_in_use": peak}

    real = kv_cache.device_memory_stats
    kv_cache.device_memory_stats = stats
    try:
        with LLM(path, **ENGINE, tensor_parallel_size=4, gpu_memory_utilization=0.5, enforce_eager=True) as llm:
            runner = llm.llm_engine.runner
            return {"num_blocks": runner.num_blocks, "bytes_per_block": runner.kv_spec.bytes_per_block,
                    "per_device": llm.stats()["kv_cache_per_device"]}
    finally:
        kv_cache.device_memory_stats = real


def data_parallel(path: Path) -> dict:
    """dp=2 (one device each) and dp=2 x tp=2 against dp=1: greedy and seeded sampling, n=2;
    then the same after new weights came through collective_rpc as one-shot iterators."""
    from safetensors.numpy import load_file

    other = load_file(str(make_tiny("llama", path.parent / "llama-seed-1", seed=1) / "model.safetensors"))
    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (3, 9, 17, 25, 33, 40, 7, 12)]
    params = [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
              SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=6, n=2, ignore_eos=True)] * 4
    out = {}
    for name, kwargs in (("dp1", {}), ("dp2", dict(data_parallel_size=2)),
                         ("dp2tp2", dict(data_parallel_size=2, tensor_parallel_size=2))):
        with LLM(path, **ENGINE, **kwargs) as llm:
            out[name] = [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params, use_tqdm=False)]
            stats = llm.stats()
            out[name + "_replicas"] = [r["num_running"] for r in stats.get("replicas", [stats])]
            out[name + "_engines"] = sorted({m.labels["engine"] for m in llm.get_metrics()})
            done = [m for m in llm.get_metrics() if m.name == "vllm:request_success"]
            out[name + "_finished_per_engine"] = {e: sum(m.value for m in done if m.labels["engine"] == e)
                                                  for e in out[name + "_engines"]}
            # one prompt per enqueue call: each call counts what the replicas hold already
            ids = [i for p, sp in zip(prompts, params) for i in llm.enqueue(p, sp)]
            out[name + "_enqueued_per_replica"] = [len(e.request_ids()) for e in llm.engines]
            outputs = llm.wait_for_completion(use_tqdm=False)
            assert [o.request_id for o in outputs] == ids
            out[name + "_enqueued"] = [[c.token_ids for c in o.outputs] for o in outputs]
            # (every replica must read the whole iterator, not what the first one left)
            llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(other.items())})
            outputs = llm.generate(prompts, params, use_tqdm=False)
            out[name + "_reloaded"] = [[c.token_ids for c in o.outputs] for o in outputs]
            out[name + "_updated"] = llm.collective_rpc("update_weights", args=(((k, v) for k, v in other.items()),))
    return out


def speculative(path: Path) -> dict:
    """n-gram speculative decoding under tensor parallelism 2 against one device without it:
    greedy outputs of prompts that repeat (a random model's outputs loop, so drafts match)."""
    prompts = [{"prompt_token_ids": p} for p in ([1, 2, 3, 4, 1, 2, 3], [9, 8, 9, 8, 9], list(range(20, 50)))]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    out = {}
    draft = {"method": "draft_model", "model": str(path), "num_speculative_tokens": 3}  # (the target itself)
    # EAGLE heads split as the target is: one passing the target's state through (its drafts
    # repeat the last token, which loops accept), a random EAGLE-3 head over layers 0 and 1.
    eagle = {"method": "eagle", "model": str(passing_head(path, path.parent / "eagle")), "num_speculative_tokens": 3}
    eagle3 = {"method": "eagle3", "num_speculative_tokens": 3,
              "model": str(make_head(path, path.parent / "eagle3", "eagle3", draft_vocab=256, aux_layers=[0, 1, 1]))}
    for name, kwargs in (("tp1", {}), ("tp2_spec", dict(tensor_parallel_size=2, speculative_config=spec)),
                         ("tp2_draft", dict(tensor_parallel_size=2, speculative_config=draft)),
                         ("tp1_eagle", dict(speculative_config=eagle)),
                         ("tp2_eagle", dict(tensor_parallel_size=2, speculative_config=eagle)),
                         ("tp1_eagle3", dict(speculative_config=eagle3)),
                         ("tp2_eagle3", dict(tensor_parallel_size=2, speculative_config=eagle3))):
        with LLM(path, **ENGINE, **kwargs) as llm:
            out[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            out[name + "_stats"] = {k: v for k, v in llm.stats().items() if k.startswith("spec_decode")}
    return out


def main(folder: str) -> None:
    results: dict = {"devices": jax.device_count(), "cases": {}, "errors": {}}
    for name, arch, overrides, sizes in CASES:
        path = make_tiny(arch, Path(folder) / name, **overrides)
        case = {"hf": hf_completions(path)}
        with LLM(path, **ENGINE) as one:
            case["tp1"] = greedy(one)
        for tp in sizes:
            with LLM(path, **ENGINE, tensor_parallel_size=tp) as llm:
                case[f"tp{tp}"] = greedy(llm)
                case[f"tp{tp}_kv_heads"] = llm.llm_engine.runner.cfg.num_kv_heads
                if name == "qwen3_moe" and tp == 4:
                    case["moe_shards"] = expert_shards(llm)
                if name == "llama-8-heads" and tp == 8:
                    case["shards"] = shard_shapes(llm)
                    case["hlo"] = all_gathers(llm, llm.llm_engine.runner.kv_caches[0].shape)
            if arch in ("qwen3_moe", "mixtral"):  # expert parallelism: whole experts per device
                with LLM(path, **ENGINE, tensor_parallel_size=tp, enable_expert_parallel=True) as llm:
                    case[f"tp{tp}_ep"] = greedy(llm)
                    case[f"tp{tp}_ep_shards"] = expert_shards(llm)
                    if tp == 4:
                        case["ep_hlo"] = all_gathers(llm, first_layer(llm.llm_engine.runner)["experts_gate"].shape)
        if name == "qwen3":  # the Pallas kernels (interpret mode) per device, KV heads repeated 4x
            with LLM(path, **ENGINE, tensor_parallel_size=4, attention_backend="pallas") as llm:
                case["tp4_pallas"] = greedy(llm)
        if name == "qwen3_moe":  # the Pallas grouped matmul (interpret mode) per device, on whole experts
            with LLM(path, **ENGINE, tensor_parallel_size=2, attention_backend="pallas",
                     enable_expert_parallel=True) as llm:
                case["tp2_ep_pallas"] = greedy(llm)
        if name in ("qwen3", "qwen3_moe"):  # layer weights stacked, as on a GPU, each stack split as a layer
            ep = {"enable_expert_parallel": True} if name == "qwen3_moe" else {}
            with stacked_layers(), LLM(path, **ENGINE, tensor_parallel_size=4, **ep) as llm:
                case["tp4_stacked"] = greedy(llm)
                q_proj = llm.llm_engine.runner.params["layers"]["q_proj"]
                case["tp4_stacked_q_proj"] = [list(q_proj.shape), sorted({tuple(s.data.shape)
                                                                          for s in q_proj.addressable_shards})]
        results["cases"][name] = case
    path = Path(folder) / "llama"
    results["sizing"] = per_device_sizing(path)
    results["dp"] = data_parallel(path)
    results["spec"] = speculative(path)
    try:
        LLM(path, **ENGINE, tensor_parallel_size=4, data_parallel_size=4)
    except ValueError as e:
        results["errors"]["4x4"] = str(e)
    for tp in (3, 16):
        try:
            LLM(path, **ENGINE, tensor_parallel_size=tp)
            results["errors"][str(tp)] = None
        except ValueError as e:
            results["errors"][str(tp)] = str(e)
    try:  # 8 experts over 4 devices split whole, but 6 do not
        LLM(make_tiny("qwen3_moe", Path(folder) / "moe6", num_experts=6), **ENGINE, tensor_parallel_size=4,
            enable_expert_parallel=True)
        results["errors"]["ep"] = None
    except ValueError as e:
        results["errors"]["ep"] = str(e)
    print(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1])

"""Mixture-of-experts models (Qwen3-MoE, Mixtral): their config and stacked expert params, the
checkpoint layouts, the router against HF's, expert parallelism and the grouped (ragged_dot,
Pallas) expert computation. Their parity with HF transformers (the model through the paged KV
cache and the engine) is in tests/models/test_hf_parity.py with every other architecture's.
"""

import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors import safe_open

from jaxvllm import load_model
from jaxvllm.model_config import ModelConfig
from jaxvllm.kv_cache import allocate_kv_caches
from jaxvllm.models import MODELS, moe
from jaxvllm.models.common import layer_params
from tests.models.paged import Chunk, build_inputs

MOE_ARCHS = ["qwen3_moe", "mixtral"]


@pytest.fixture(scope="module", params=MOE_ARCHS)
def moe_setup(request, tiny_checkpoint, hf_model):
    path = tiny_checkpoint(request.param)
    cfg, params = load_model(path)
    return request.param, path, cfg, params, hf_model(path)


def first_layers(cfg, params) -> tuple[dict, dict]:
    """Layers 0 and 1's params, from their stacks (or lists: the experts)."""
    specs = MODELS[cfg.architecture].param_specs(cfg)
    return layer_params(params, specs, 0), layer_params(params, specs, 1)


def test_config_and_stacked_params(moe_setup):
    arch, _, cfg, params, hf = moe_setup
    # qwen3_moe: layer 1 is in `mlp_only_layers` (a dense MLP); Mixtral: every layer sparse.
    assert cfg.moe_layers == ((True, False) if arch == "qwen3_moe" else (True, True))
    assert cfg.norm_topk_prob == (arch == "mixtral")
    e, f = cfg.num_experts, cfg.moe_intermediate_size
    layer, layer1 = first_layers(cfg, params)
    assert layer["router"].shape == (e, cfg.hidden_size)
    assert layer["experts_gate"].shape == layer["experts_up"].shape == (e, cfg.hidden_size, f)
    assert layer["experts_down"].shape == (e, f, cfg.hidden_size)
    assert "gate_up_proj" not in layer
    if arch == "qwen3_moe":
        assert "router" not in layer1 and layer1["gate_up_proj"].shape == (2, 128, 64)
    assert cfg.num_params == sum(p.numel() for n, p in hf.named_parameters() if "_norm" not in n)


def test_sharded_checkpoint_loads_the_same(tiny_checkpoint):
    """Experts of one layer spread over several safetensors files are stacked alike."""
    _, whole = load_model(tiny_checkpoint("mixtral"))
    path = tiny_checkpoint("mixtral", max_shard_size="30KB")
    assert len(list(path.glob("*.safetensors"))) > 2 and (path / "model.safetensors.index.json").is_file()
    _, sharded = load_model(path)
    for a, b in zip(jax.tree.leaves(whole), jax.tree.leaves(sharded)):
        np.testing.assert_array_equal(a, b)


def test_fused_expert_checkpoint(moe_setup, tiny_checkpoint, caplog):
    """transformers 5's own layout (`save_pretrained(save_original_format=False)`: each
    layer's experts fused into gate_up_proj [E, 2I, hidden] and down_proj [E, hidden, I],
    Mixtral's router under `mlp.`) loads to the same params, every tensor used (and gives
    HF's logits when HF loads that checkpoint: tests/models/test_hf_parity.py)."""
    arch, _, _, params, _ = moe_setup
    path = tiny_checkpoint(arch, save_original_format=False)
    with safe_open(str(path / "model.safetensors"), "np") as f:
        names = set(f.keys())
    assert "model.layers.0.mlp.experts.gate_up_proj" in names and not any(".experts.0." in n for n in names)
    with caplog.at_level("WARNING", logger="jaxvllm.loader"):
        _, fused = load_model(path)
    assert "ignoring" not in caplog.text
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(fused), strict=True):
        np.testing.assert_array_equal(a, b)


def test_decoder_sparse_step_and_mlp_only_layers():
    from transformers import MixtralConfig, Qwen3MoeConfig

    common = dict(architectures=["Qwen3MoeForCausalLM"], hidden_size=64, num_attention_heads=4, num_hidden_layers=6,
                  num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
    cfg = ModelConfig.from_hf(Qwen3MoeConfig(**common, decoder_sparse_step=2, mlp_only_layers=[3]))
    assert cfg.moe_layers == (False, True, False, False, False, True)  # HF: (i + 1) % step == 0, not listed
    assert cfg.qk_norm and not cfg.norm_topk_prob
    mixtral = ModelConfig.from_hf(MixtralConfig(architectures=["MixtralForCausalLM"], hidden_size=64,
                                                num_attention_heads=4, num_hidden_layers=3, intermediate_size=32,
                                                num_local_experts=8, num_experts_per_tok=2, sliding_window=16))
    assert mixtral.moe_layers == (True,) * 3 and mixtral.num_experts == 8 and mixtral.moe_intermediate_size == 32
    assert mixtral.norm_topk_prob and mixtral.sliding_windows == (16,) * 3 and not mixtral.qk_norm


def test_expert_parallel_config_and_split():
    """enable_expert_parallel: whole experts on each device (the stack's first axis split) when
    a mixture of experts runs on several devices; nothing changes on one device or for a dense
    model; a device count that does not divide the experts is refused."""
    from transformers import LlamaConfig, Qwen3MoeConfig
    from jax.sharding import PartitionSpec as P

    from jaxvllm.sharding import AXIS, param_partition, sharded_config

    common = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=2)
    cfg = ModelConfig.from_hf(Qwen3MoeConfig(architectures=["Qwen3MoeForCausalLM"], num_experts=8,
                                             num_experts_per_tok=2, moe_intermediate_size=6, **common))
    ep = sharded_config(cfg, 4, expert_parallel=True)
    assert ep.expert_parallel and not sharded_config(cfg, 1, expert_parallel=True).expert_parallel
    assert [param_partition((name,), ep, 4) for name in moe.EXPERTS] == [P(AXIS)] * 3
    assert param_partition(("router",), ep, 4) == P() and param_partition(("qkv_proj",), ep, 4) == P(AXIS)
    # 6 intermediate columns do not split over 4 devices, but 8 whole experts do (and 6 do not)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=4 does not divide the experts' intermediate size 6"):
        sharded_config(cfg, 4)
    six = ModelConfig.from_hf(Qwen3MoeConfig(architectures=["Qwen3MoeForCausalLM"], num_experts=6,
                                             num_experts_per_tok=2, moe_intermediate_size=8, **common))
    with pytest.raises(ValueError, match=r"tensor_parallel_size=4 with enable_expert_parallel does not divide the "
                                         r"6 experts"):
        sharded_config(six, 4, expert_parallel=True)
    # The dense MLP's intermediate size counts only where a layer has one (it was refused all the same).
    odd = dict(architectures=["Qwen3MoeForCausalLM"], num_experts=8, num_experts_per_tok=2, moe_intermediate_size=8,
               intermediate_size=130, **common)
    assert sharded_config(ModelConfig.from_hf(Qwen3MoeConfig(mlp_only_layers=[], **odd)), 4, expert_parallel=True)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=4 does not divide intermediate_size=130"):
        sharded_config(ModelConfig.from_hf(Qwen3MoeConfig(mlp_only_layers=[1], **odd)), 4, expert_parallel=True)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=4 does not divide intermediate_size=130"):
        sharded_config(ModelConfig.from_hf(LlamaConfig(architectures=["LlamaForCausalLM"], intermediate_size=130,
                                                       **common)), 4)
    dense = ModelConfig.from_hf(LlamaConfig(architectures=["LlamaForCausalLM"], intermediate_size=128, **common))
    assert not sharded_config(dense, 4, expert_parallel=True).expert_parallel


def test_experts_are_a_grouped_matmul(moe_setup):
    """The MoE MLP's jaxpr holds three ragged_dots (gate, up, down) over the T * k rows sorted by
    expert, and no intermediate as large as tokens x experts x anything (no dense expert pass)."""
    _, _, cfg, params, _ = moe_setup
    t = 16
    x = jnp.ones((t, cfg.hidden_size), jnp.float32)
    jaxpr = jax.make_jaxpr(lambda layer, x: moe.sparse_moe(layer, x, cfg))(first_layers(cfg, params)[0], x).jaxpr
    eqns = list(jaxpr.eqns)
    ragged = [e for e in eqns if e.primitive.name.startswith("ragged_dot")]
    assert len(ragged) == 3
    assert all(e.invars[0].aval.shape[0] == t * cfg.num_experts_per_tok for e in ragged)
    assert not any(e.primitive.name == "dot_general" and e.invars[1].aval.ndim == 3 for e in eqns)
    largest = max(int(np.prod(v.aval.shape)) for e in eqns for v in e.outvars)
    assert largest < t * cfg.num_experts * min(cfg.hidden_size, cfg.moe_intermediate_size)


def test_pallas_backend_runs_the_grouped_matmul_kernel(moe_setup):
    """backend "pallas": the experts are three Pallas grouped matmuls (interpret mode on CPU),
    no ragged_dot, and the same output as the ragged_dot path."""
    _, _, cfg, params, _ = moe_setup
    layer = first_layers(cfg, params)[0]
    x = jnp.asarray(np.random.default_rng(6).normal(size=(21, cfg.hidden_size)), jnp.float32)
    jaxpr = jax.make_jaxpr(lambda layer, x: moe.sparse_moe(layer, x, cfg, "pallas"))(layer, x).jaxpr
    names = [e.primitive.name for e in jaxpr.eqns]
    assert names.count("pallas_call") == 3 and not any(n.startswith("ragged_dot") for n in names)
    got = jax.jit(lambda layer, x: moe.sparse_moe(layer, x, cfg, "pallas"))(layer, x)
    want = jax.jit(lambda layer, x: moe.sparse_moe(layer, x, cfg))(layer, x)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_routing_matches_hf_router(moe_setup):
    """Top-k ids and weights of the router alone, against HF's router module."""
    arch, _, cfg, params, hf = moe_setup
    x = np.random.default_rng(5).normal(size=(40, cfg.hidden_size)).astype(np.float32)
    block = hf.model.layers[0].mlp
    with torch.no_grad():
        _, want_w, want_ids = block.gate(torch.from_numpy(x))
    weights, ids = moe.route(jnp.asarray(x), first_layers(cfg, params)[0]["router"], cfg)
    np.testing.assert_array_equal(np.sort(ids, -1), np.sort(want_ids.numpy(), -1))
    order, want_order = np.argsort(ids, -1), np.argsort(want_ids.numpy(), -1)
    np.testing.assert_allclose(np.take_along_axis(np.asarray(weights), order, -1),
                               np.take_along_axis(want_w.numpy(), want_order, -1), rtol=1e-5, atol=1e-6)
    assert weights.dtype == jnp.float32


def test_qwen3_30b_a3b_traces():
    """dummy:qwen3-30b-a3b's config builds and its step traces with the real shapes (no weights)."""
    from jaxvllm.dummy import write_dummy_model
    from jaxvllm.loader import dummy_params, load_config
    from jaxvllm.models import forward

    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(write_dummy_model("dummy:qwen3-30b-a3b", tmp))
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (48, 2048, 32, 4, 128)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.vocab_size) == (128, 8, 768, 151936)
    assert all(cfg.moe_layers) and cfg.norm_topk_prob and not cfg.tie_word_embeddings
    assert abs(cfg.num_params / 1e9 - 30.5) < 0.05 and abs(cfg.num_active_params / 1e9 - 3.35) < 0.05
    params = jax.eval_shape(lambda: dummy_params(cfg, jnp.bfloat16))
    caches = jax.eval_shape(lambda: allocate_kv_caches(cfg, 8, 16, jnp.bfloat16))
    inputs = build_inputs([Chunk(list(range(3, 35)), 0, [0, 1])], 16)
    logits, _ = jax.eval_shape(lambda p, c: forward(p, c, inputs, cfg, "reference"), params, caches)
    assert logits.shape == (1, 151936)


def test_bench_throughput_tiny_moe(tmp_path, capsys):
    import json

    from jaxvllm.cli import main

    out = tmp_path / "bench.json"
    assert main(["bench", "throughput", "--model", "dummy:tiny-moe", "--dataset", "random", "--num-prompts", "4",
                 "--input-len", "12", "--output-len", "5", "--max-model-len", "64", "--max-num-batched-tokens", "32",
                 "--max-num-seqs", "8", "--disable-tqdm", "--output-json", str(out)]) == 0
    assert "jaxvllm: Throughput:" in capsys.readouterr().out
    (run,) = json.loads(out.read_text())["results"].values()
    assert run["num_requests"] == 4 and run["total_output_tokens"] == 20 and run["output_tokens_per_second"] > 0

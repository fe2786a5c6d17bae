"""Loader: sharded and single-file safetensors, dtypes, dummy weights, and clear errors."""

import dataclasses
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from jaxvllm import SUPPORTED_ARCHITECTURES, load_model
from jaxvllm.layers import rope_inv_freq
from jaxvllm.model_config import RopeConfig
from jaxvllm.loader import load_config


def copy_checkpoint(src, dst):
    shutil.copytree(src, dst)
    return dst


def edit_config(path, **changes):
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


def test_sharded_checkpoint_with_index(tiny_checkpoint):
    single = tiny_checkpoint("qwen2")
    sharded = tiny_checkpoint("qwen2", max_shard_size="40KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 2
    _, want = load_model(single)
    _, got = load_model(sharded)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(g, w)


def test_sharded_without_index_reads_every_file(tiny_checkpoint, tmp_path):
    path = copy_checkpoint(tiny_checkpoint("llama", max_shard_size="40KB"), tmp_path / "noindex")
    (path / "model.safetensors.index.json").unlink()
    _, got = load_model(path)
    _, want = load_model(tiny_checkpoint("llama"))
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(g, w)


def test_dtypes(tiny_checkpoint):
    fp32 = tiny_checkpoint("llama")
    bf16 = tiny_checkpoint("llama", dtype="bfloat16")
    # (the stacks' int32 row indices, `layer_rows`, are not weights)
    dtypes = lambda params: {x.dtype for x in jax.tree.leaves(params) if x.dtype != jnp.int32}  # noqa: E731
    assert dtypes(load_model(fp32)[1]) == {jnp.dtype(jnp.float32)}  # auto = the config's
    assert dtypes(load_model(bf16)[1]) == {jnp.dtype(jnp.bfloat16)}
    assert dtypes(load_model(fp32, dtype="bfloat16")[1]) == {jnp.dtype(jnp.bfloat16)}
    assert dtypes(load_model(bf16, dtype="float32")[1]) == {jnp.dtype(jnp.float32)}
    assert dtypes(load_model(fp32, dtype="float16")[1]) == {jnp.dtype(jnp.float16)}
    # A bf16 file loaded as bf16 is bit-exact.
    want = load_file(str(bf16 / "model.safetensors"))["model.embed_tokens.weight"].float().numpy()
    got = load_model(bf16)[1]["embed"]
    np.testing.assert_array_equal(np.asarray(got, np.float32), want)


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_dummy_matches_real_shapes_without_weight_files(arch, tiny_checkpoint, tmp_path):
    path = tiny_checkpoint(arch)
    only_config = tmp_path / "config-only"
    only_config.mkdir()
    shutil.copy(path / "config.json", only_config)
    _, real = load_model(path)
    _, dummy = load_model(only_config, load_format="dummy", dtype="bfloat16")
    assert jax.tree.structure(dummy) == jax.tree.structure(real)
    for d, r in zip(jax.tree.leaves(dummy), jax.tree.leaves(real)):
        assert d.shape == r.shape and d.dtype == (jnp.int32 if r.dtype == jnp.int32 else jnp.bfloat16)  # layer_rows
    again = load_model(only_config, load_format="dummy", dtype="bfloat16")[1]
    np.testing.assert_array_equal(again["embed"], dummy["embed"])  # seeded
    assert float(jnp.std(dummy["embed"].astype(jnp.float32))) == pytest.approx(0.1, rel=0.1)


def test_qwen3_real_sized_dummy_config_is_accepted(tmp_path):
    """The B1 benchmark model (Qwen3-0.6B shape) parses, with its real parameter count."""
    from transformers import Qwen3Config

    Qwen3Config(
        vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
        max_position_embeddings=40960, architectures=["Qwen3ForCausalLM"],
    ).save_pretrained(tmp_path)
    cfg = load_config(tmp_path)
    assert cfg.num_params == pytest.approx(596e6, rel=0.01)  # 0.6B with tied embeddings
    assert cfg.qk_norm and cfg.head_dim == 128 and not cfg.qkv_bias


def test_llama3_rope_matches_transformers():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = LlamaConfig(
        hidden_size=256, num_attention_heads=2, max_position_embeddings=131072,
        rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                             high_freq_factor=4.0, original_max_position_embeddings=8192),
    )
    want, _ = ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu")
    rope = RopeConfig(theta=500000.0, rope_type="llama3", factor=8.0, original_max_position_embeddings=8192)
    np.testing.assert_allclose(rope_inv_freq(rope, 128), want.numpy(), rtol=1e-6)


def test_missing_directory_and_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="does-not-exist.*does not exist"):
        load_model(tmp_path / "does-not-exist")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_model(tmp_path)


def test_unsupported_architecture_lists_supported(tiny_checkpoint, tmp_path):
    path = copy_checkpoint(tiny_checkpoint("llama"), tmp_path / "gpt2")
    edit_config(path, architectures=["GPT2LMHeadModel"])
    with pytest.raises(ValueError, match="unsupported architecture.*GPT2LMHeadModel") as e:
        load_model(path)
    assert all(a in str(e.value) for a in SUPPORTED_ARCHITECTURES)


def test_unsupported_rope_and_activation(tiny_checkpoint, tmp_path):
    path = copy_checkpoint(tiny_checkpoint("llama"), tmp_path / "dynamic")
    edit_config(path, rope_parameters={"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0})
    with pytest.raises(ValueError, match="rope type 'dynamic' is not supported"):
        load_model(path)
    edit_config(path, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, hidden_act="gelu")
    with pytest.raises(ValueError, match="hidden_act 'gelu'"):
        load_model(path)
    gemma = copy_checkpoint(tiny_checkpoint("gemma3"), tmp_path / "gemma-silu")
    edit_config(gemma, hidden_activation="silu")  # (named as its config names it)
    with pytest.raises(ValueError, match=r"Gemma3ForCausalLM: hidden_activation 'silu' is not supported \(only"):
        load_model(gemma)


def test_missing_tensor_is_named(tiny_checkpoint, tmp_path):
    path = copy_checkpoint(tiny_checkpoint("qwen3"), tmp_path / "missing")
    tensors = load_file(str(path / "model.safetensors"))
    del tensors["model.layers.1.self_attn.k_norm.weight"]
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing tensor\(s\): model\.layers\.1\.self_attn\.k_norm\.weight"):
        load_model(path)


def test_shape_mismatch_is_named(tiny_checkpoint, tmp_path):
    path = copy_checkpoint(tiny_checkpoint("mistral"), tmp_path / "shape")
    edit_config(path, intermediate_size=96)
    with pytest.raises(ValueError, match=r"mlp\.\w+_proj\.weight in model\.safetensors has shape .* implies"):
        load_model(path)


def test_corrupt_safetensors_file_is_named(tiny_checkpoint, tmp_path):
    path = copy_checkpoint(tiny_checkpoint("qwen2"), tmp_path / "corrupt")
    (path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not a header")
    with pytest.raises(ValueError, match="cannot read safetensors file .*model.safetensors"):
        load_model(path)


def test_truncated_safetensors_file_is_named(tiny_checkpoint, tmp_path):
    path = copy_checkpoint(tiny_checkpoint("qwen2"), tmp_path / "truncated")
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="model.safetensors"):
        load_model(path)


def test_missing_shard_and_bad_index(tiny_checkpoint, tmp_path):
    path = copy_checkpoint(tiny_checkpoint("qwen2", max_shard_size="40KB"), tmp_path / "shard")
    shard = sorted(path.glob("*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=f"lists {shard.name}, which is missing"):
        load_model(path)
    (path / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(ValueError, match="not a valid safetensors index"):
        load_model(path)


def test_no_weight_files(tiny_checkpoint, tmp_path):
    path = tmp_path / "empty"
    path.mkdir()
    shutil.copy(tiny_checkpoint("llama") / "config.json", path)
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors files"):
        load_model(path)


def test_bad_dtype_and_load_format(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    with pytest.raises(ValueError, match="dtype 'int8' is not supported"):
        load_model(path, dtype="int8")
    with pytest.raises(ValueError, match="load_format 'pt' is not supported"):
        load_model(path, load_format="pt")


def test_torch_reference_files_are_float32(tiny_checkpoint):
    """Guard for the parity tests: tiny checkpoints hold float32 weights."""
    tensors = load_file(str(tiny_checkpoint("llama") / "model.safetensors"))
    assert {t.dtype for t in tensors.values()} == {torch.float32}


@pytest.mark.parametrize("arch", ["qwen3", "gemma3", "qwen3_moe"])
def test_param_leaves_do_not_grow_with_depth(arch, tiny_checkpoint):
    """Each kind of layer weight is one array stacked over the layers (a step's jit
    dispatch costs per argument leaf): 2 and 30 layers give the same leaves, bar the
    experts, one stack per sparse layer. (The tiny checkpoints have 2 to 4 layers.)"""
    from jaxvllm.loader import dummy_params, load_config

    def leaves(**overrides):
        cfg = dataclasses.replace(load_config(tiny_checkpoint(arch, **overrides)), stack_layers=True)
        params = jax.eval_shape(lambda: dummy_params(cfg, jnp.float32))
        sparse = sum(cfg.moe_layers) if any(cfg.moe_layers) else 0
        return len(jax.tree.leaves(params)) - 3 * sparse, params["layers"]["q_proj"].shape[0]

    # (Qwen3-MoE's tiny layer 1 is dense; Gemma 3's layer types then come from its pattern.)
    kw = {"layer_types": None} if arch == "gemma3" else {}
    few, thirty = leaves(), leaves(num_hidden_layers=30, **kw)
    assert few[1] <= 4 and thirty[1] == 30
    assert few[0] == thirty[0] < 20


@pytest.mark.parametrize("stacked", [True, False])
def test_stacked_layers_hold_each_layers_tensor(tmp_path, stacked):
    """Row i of a stack (or element i of a list, a CPU's layout) is layer i's checkpoint
    tensor, reshaped head-explicit; a parameter only some layers have (the dense MLP of
    `mlp_only_layers`) stacks those. A CPU's merged q/k/v hold each KV head's query heads,
    then its k and v, HF's rows head by head; its gate/up, gate then up; each matrix is
    stored inputs first (`InputMajorWeight`)."""
    from jaxvllm.layers import InputMajorWeight
    from safetensors.numpy import load_file as load_numpy
    from weights.make_tiny import make_tiny

    path = make_tiny("qwen3_moe", tmp_path / "moe", num_hidden_layers=3, mlp_only_layers=[0, 2])
    cfg, params = load_model(path, stack_layers=stacked)
    tensors = load_numpy(str(path / "model.safetensors"))
    layers = params["layers"]
    hkv, hd, d = cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size
    assert len(layers["down_proj"]) == 2 and len(layers["router"]) == 1 and cfg.merge_projections != stacked
    for i in range(3):
        tensor = lambda x: tensors[f"model.layers.{i}.self_attn.{x}_proj.weight"]  # noqa: E731
        if stacked:
            np.testing.assert_array_equal(layers["q_proj"][i], tensor("q").reshape(layers["q_proj"].shape[1:]))
            continue
        qkv = layers["qkv_proj"][i]
        assert qkv.value.shape == (d, hkv, cfg.num_heads // hkv + 2, hd)  # (hidden, the input, first)
        qkv = np.asarray(qkv.weight())
        assert qkv.shape == (hkv, cfg.num_heads // hkv + 2, hd, d)
        np.testing.assert_array_equal(qkv[:, :-2].reshape(-1, d), tensor("q"))
        np.testing.assert_array_equal(qkv[:, -2].reshape(-1, d), tensor("k"))
        np.testing.assert_array_equal(qkv[:, -1].reshape(-1, d), tensor("v"))
    weight = lambda w: w.weight() if isinstance(w, InputMajorWeight) else w  # noqa: E731
    for row, i in enumerate((0, 2)):
        tensor = lambda x: tensors[f"model.layers.{i}.mlp.{x}_proj.weight"]  # noqa: E731
        np.testing.assert_array_equal(weight(layers["down_proj"][row]), tensor("down"))
        gate, up = ((layers["gate_proj"][row], layers["up_proj"][row]) if stacked
                    else weight(layers["gate_up_proj"][row]))
        np.testing.assert_array_equal(gate, tensor("gate"))
        np.testing.assert_array_equal(up, tensor("up"))
    np.testing.assert_array_equal(layers["router"][0], tensors["model.layers.1.mlp.gate.weight"])


def test_dummy_values():
    """Dummy weights: mean 0 and the scale as standard deviation, a different stream per key,
    a layer of a stack (keys vmapped) the same as that layer's key alone, and the same
    values however the devices split the array."""
    import os
    import subprocess
    import sys
    from functools import partial

    from jaxvllm.loader import dummy_values

    key = jax.random.key(7)
    value = np.asarray(jax.jit(partial(dummy_values, shape=(256, 384), scale=0.05))(key))
    assert abs(value.mean()) < 1e-3 and abs(value.std() - 0.05) < 1e-3
    assert np.abs(value).max() < 0.05 * 3 ** 0.5 + 1e-6 and len(np.unique(value)) > 0.99 * value.size
    other = np.asarray(dummy_values(jax.random.fold_in(key, 1), (256, 384), 0.05))
    assert abs(np.corrcoef(value.ravel(), other.ravel())[0, 1]) < 0.02
    keys = jax.vmap(partial(jax.random.fold_in, key))(jnp.arange(3))
    stack = jax.vmap(partial(dummy_values, shape=(16, 24), scale=1.0))(keys)
    np.testing.assert_array_equal(stack[2], dummy_values(jax.random.fold_in(key, 2), (16, 24), 1.0))

    code = """
import jax, numpy as np
from functools import partial
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jaxvllm.loader import dummy_values
mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("a", "b"))
f = partial(dummy_values, shape=(12, 8, 20), scale=0.1)
whole = np.asarray(jax.jit(f)(jax.random.key(1)))
for spec in (P("a", None, "b"), P(None, ("a", "b")), P(None, None, "a")):
    split = jax.jit(f, out_shardings=NamedSharding(mesh, spec))(jax.random.key(1))
    assert len(split.addressable_shards) == 4 and split.sharding.spec == spec
    np.testing.assert_array_equal(np.asarray(split), whole)
print("same")
"""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("same"), done.stderr[-3000:]


def test_hf_overrides_change_the_config_the_model_runs(tiny_checkpoint, hf_model):
    """vLLM's hf_overrides: a dict of fields, or a function, applied to the HF config before
    it is read; the common use, fewer layers of a checkpoint, equals HF with the same change."""
    from transformers import AutoModelForCausalLM

    from jaxvllm import LLM, SamplingParams
    from tests.models.paged import hf_greedy

    path = tiny_checkpoint("qwen3")
    assert load_config(path).num_layers == 2
    assert load_config(path, {"num_hidden_layers": 1}).num_layers == 1

    def one_layer(config):
        config.num_hidden_layers = 1
        return config

    assert load_config(path, one_layer).num_layers == 1
    prompts = [[5, 6, 7, 8], [40, 2, 9]]
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, num_hidden_layers=1).eval()
    want = hf_greedy(hf, prompts, 6)
    assert want != hf_greedy(hf_model(path), prompts, 6)  # (the override matters)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    with LLM(path, hf_overrides={"num_hidden_layers": 1}, max_model_len=64, enforce_eager=True) as llm:
        assert llm.llm_engine.model_config.num_layers == 1
        got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                            use_tqdm=False)]
        state = load_file(str(path / "model.safetensors"))
        with pytest.raises(ValueError, match=r"'model.layers.1.[a-z_.]+' is not a weight of this model"):
            llm.update_weights(state)  # (the layers the override dropped are not the model's)
    assert got == want
    with pytest.raises(ValueError, match="hf_overrides must be a dict of config fields or a function"):
        LLM(path, hf_overrides=[("num_hidden_layers", 1)])

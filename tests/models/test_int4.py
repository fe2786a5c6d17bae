"""Weight-only quantized weights (W4A16, and GPTQ's 8 bits, W8A16: activations as they are)
against their oracles, on tiny checkpoints that weights/make_quantized.py writes in each
published packing: compressed-tensors pack-quantized (transformers with the
compressed-tensors library, or the library's own decompression), GPTQ (4- and 8-bit) and
AWQ (unpacked here as AutoGPTQ's and AutoAWQ's torch code unpacks them, into a
full-precision HF model). Also vLLM-style online 4-bit (`quantization="gptq-dummy"`),
tensor parallelism, the engine, and the refusals. (8-bit GPTQ is here rather than in a file
of its own: it shares the 4-bit packings' writer, oracle, matmul and tensor-parallel worker.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxvllm import LLM, SamplingParams, load_model
from jaxvllm.kv_cache import allocate_kv_caches
from jaxvllm.quantization import QuantizedWeight, quantize_int4
from tests.models.paged import Chunk, build_inputs, hf_greedy, hf_logits, jit_forward, random_tokens, rel_err
from tests.models.test_quantization import _with_config, assert_a_ctrl_c_in_the_join_leaves_nothing_placed

ROOT = Path(__file__).resolve().parents[2]
TOL = 1e-5  # the same weights as the oracle's; sums in another order
GROUP = 32  # the tiny models' 64 and 128 inputs: several groups a row
ENGINE = dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64, token_buckets=[64])
LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def int4_checkpoint(tiny_checkpoint, tmp_path_factory):
    """int4_checkpoint(kind, arch="llama", group=GROUP) -> a tiny checkpoint, 4-bit: kind
    "w4a16" / "w4a16-asym" (compressed-tensors), "gptq" (symmetric) / "gptq-asym" /
    "gptq_v2" (asymmetric, GPTQModel's v2 zero points) / "gptq-act-order" (desc_act), "awq";
    8-bit GPTQ: "gptq8", "gptq8-asym", "gptq8_v2", "gptq8-act-order", as the 4-bit ones;
    compressed-tensors W8A16: "w8a16", "w8a16-asym"."""
    from weights.make_quantized import make_awq, make_gptq, make_w4a16

    writers = {"w4a16": lambda s, o, g: make_w4a16(s, o, g, True),
               "w4a16-asym": lambda s, o, g: make_w4a16(s, o, g, False),
               "w8a16": lambda s, o, g: make_w4a16(s, o, g, True, bits=8),
               "w8a16-asym": lambda s, o, g: make_w4a16(s, o, g, False, bits=8),
               "gptq": lambda s, o, g: make_gptq(s, o, g, True),
               "gptq-asym": lambda s, o, g: make_gptq(s, o, g, False),
               "gptq_v2": lambda s, o, g: make_gptq(s, o, g, False, "gptq_v2"),
               "gptq-act-order": lambda s, o, g: make_gptq(s, o, g, False, desc_act=True),
               "gptq8": lambda s, o, g: make_gptq(s, o, g, True, bits=8),
               "gptq8-asym": lambda s, o, g: make_gptq(s, o, g, False, bits=8),
               "gptq8_v2": lambda s, o, g: make_gptq(s, o, g, False, "gptq_v2", bits=8),
               "gptq8-act-order": lambda s, o, g: make_gptq(s, o, g, False, desc_act=True, bits=8),
               "awq": make_awq}
    made = {}

    def get(kind: str, arch: str = "llama", group: int = GROUP) -> Path:
        if (kind, arch, group) not in made:
            made[kind, arch, group] = writers[kind](tiny_checkpoint(arch), tmp_path_factory.mktemp(f"{kind}-{arch}"),
                                                    group)
        return made[kind, arch, group]

    return get


def _nibbles(words: torch.Tensor, dim: int, bits: int = 4) -> torch.Tensor:
    """int32 words unpacked along `dim` into 32 / bits values each, low bits first (as
    AutoGPTQ's and AutoAWQ's torch code shifts and masks them)."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    words = words.movedim(dim, -1)
    values = torch.bitwise_and(torch.bitwise_right_shift(words.unsqueeze(-1), shifts), 2**bits - 1)
    return values.reshape(*words.shape[:-1], -1).movedim(-1, dim)


def gptq_weight(t: dict, module: str, v1: bool, bits: int = 4) -> torch.Tensor:
    """AutoGPTQ's dequantization: scales[g_idx] * (weight - zeros[g_idx]), the zeros stored one
    less in the v1 format; as [out, in]."""
    weight = _nibbles(t[f"{module}.qweight"], 0, bits)  # [in, out]
    zeros = _nibbles(t[f"{module}.qzeros"], 1, bits) + (1 if v1 else 0)  # [groups, out]
    g_idx = t[f"{module}.g_idx"].long()
    return (t[f"{module}.scales"].float()[g_idx] * (weight - zeros[g_idx]).float()).T


def awq_weight(t: dict, module: str) -> torch.Tensor:
    """AutoAWQ's (and vLLM's reference) dequantization: unpack, undo AWQ's interleave
    (AWQ_REVERSE_ORDER), (weight - zeros) * scales per group; as [out, in]."""
    def unpack(words):
        values = _nibbles(words, 1)
        order = torch.arange(values.shape[1]).view(-1, 8)[:, [0, 4, 1, 5, 2, 6, 3, 7]].reshape(-1)
        return values[:, order]

    weight, zeros, scales = unpack(t[f"{module}.qweight"]), unpack(t[f"{module}.qzeros"]), t[f"{module}.scales"]
    group = weight.shape[0] // scales.shape[0]
    return ((weight - zeros.repeat_interleave(group, 0)).float() * scales.float().repeat_interleave(group, 0)).T


def compressed_tensors_weight(t: dict, module: str, config: dict) -> torch.Tensor:
    """The compressed-tensors library's own decompression of one module."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationScheme

    scheme = QuantizationScheme(**config["config_groups"]["group_0"])
    local = {key.removeprefix(module + "."): value for key, value in t.items() if key.startswith(module + ".")}
    return PackedQuantizationCompressor.decompress(local, scheme)["weight"].float()


def unpacked_hf(path: Path, src: Path):
    """The full-precision HF model of `src` with each decoder Linear's weight replaced by
    `path`'s 4- or 8-bit weight, dequantized here by its format's own unpacking; a mixture
    of experts' experts (transformers' fused [E, ...] parameters) likewise, expert by expert."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    config = json.loads((path / "config.json").read_text())["quantization_config"]
    tensors = load_file(str(path / "model.safetensors"))
    hf = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).eval()

    def weight(module: str) -> torch.Tensor:
        if f"{module}.weight" in tensors:  # (a module the checkpoint keeps in full precision)
            return tensors[f"{module}.weight"].float()
        if config["quant_method"] == "gptq":
            return gptq_weight(tensors, module, config.get("checkpoint_format", "gptq") == "gptq", config["bits"])
        if config["quant_method"] == "awq":
            return awq_weight(tensors, module)
        return compressed_tensors_weight(tensors, module, config)

    with torch.no_grad():
        for name, module in hf.model.layers.named_modules():
            if name.rsplit(".", 1)[-1] in LINEAR:
                module.weight.copy_(weight(f"model.layers.{name}"))
        for i, layer in enumerate(hf.model.layers):
            if f"model.layers.{i}.mlp.gate.qweight" in tensors:  # (a quantized router)
                layer.mlp.gate.weight.copy_(weight(f"model.layers.{i}.mlp.gate"))
            experts = getattr(getattr(layer, "mlp", None), "experts", None)
            if experts is None:
                continue
            for e in range(experts.gate_up_proj.shape[0]):
                gate, up, down = (weight(f"model.layers.{i}.mlp.experts.{e}.{n}") for n in ("gate_proj", "up_proj",
                                                                                            "down_proj"))
                experts.gate_up_proj[e].copy_(torch.cat([gate, up]))
                experts.down_proj[e].copy_(down)
    return hf


def _logits(params, cfg, tokens):
    inputs = build_inputs([Chunk(tokens, 0, list(range(8)))], 4, all_logits=True)
    return jit_forward(params, allocate_kv_caches(cfg, 8, 4, jnp.float32), inputs, cfg, "reference")[0]


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("zero", [False, True], ids=["symmetric", "zero-points"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_grouped_matmul_matches_the_dequantized_weight(bits, zero, dtype):
    """The GPU's weight-only matmuls, the Pallas kernel (interpreted here; int4 only) and XLA's
    batched over the groups (scales and zero points applied to the products), against x
    times the dequantized weight (the CPU's); `quantized_matmul` takes 8-bit weights marked
    `weight_only` to them (W8A16: x not quantized) rather than to W8A8."""
    from jaxvllm.quantization import _int4_pallas, _weight_only_dequantized, _weight_only_grouped, quantized_matmul

    rng = np.random.default_rng(0)
    out, inputs, group, half = 48, 96, 32, 2 ** (bits - 1)
    zeros = jnp.asarray(rng.integers(-half, half, (out, inputs // group)), jnp.float32)
    scales = rng.uniform(0.01, 0.1, (out, inputs // group)) / 2 ** (bits - 4)  # (weights of like sizes)
    weight = QuantizedWeight(jnp.asarray(rng.integers(-half, half, (out, inputs)), jnp.int4 if bits == 4 else jnp.int8),
                             jnp.asarray(scales, jnp.float32), group, zero=zeros if zero else None,
                             weight_only=bits == 8)
    x = jnp.asarray(rng.standard_normal((5, inputs)), dtype)
    want = x.astype(jnp.float32) @ weight.dequantized().T
    kernel = (partial(_int4_pallas, interpret=True),) if bits == 4 else ()
    for fn in (_weight_only_grouped, _weight_only_dequantized, quantized_matmul, *kernel):
        got = jax.jit(fn, static_argnums=2)(x, weight, out)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5 if dtype == jnp.float32 else 1e-2,
                                   atol=1e-5 if dtype == jnp.float32 else 2e-2)


@pytest.mark.parametrize("kind, arch", [("w4a16", "llama"), ("w4a16", "qwen3"), ("w8a16", "llama")])
@pytest.mark.parametrize("stack", [False, True], ids=["per-layer", "stacked"])
def test_w4a16_matches_transformers(kind, arch, stack, int4_checkpoint):
    """compressed-tensors W4A16 and W8A16 (symmetric, groups of 32) against transformers
    reading them through the compressed-tensors library; 8 bits as int8 values marked
    weight-only."""
    from transformers import AutoModelForCausalLM

    path = int4_checkpoint(kind, arch)
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    cfg, params = load_model(path, stack_layers=stack)
    weights = [w if stack else w[0] for name, w in params["layers"].items() if name.endswith("proj")]
    want = (jnp.int8, True) if kind == "w8a16" else (jnp.int4, False)
    assert all(isinstance(w, QuantizedWeight) and (w.value.dtype, w.weight_only) == want and w.group_size == GROUP
               and w.zero is None for w in weights)
    tokens = random_tokens(np.random.default_rng(0), 24)
    assert rel_err(_logits(params, cfg, tokens), hf_logits(hf, tokens)) <= TOL


@pytest.mark.parametrize("kind, arch, group", [("w4a16-asym", "llama", GROUP), ("gptq", "llama", GROUP),
                                               ("gptq-asym", "qwen2", GROUP), ("gptq_v2", "llama", GROUP),
                                               ("gptq-asym", "llama", 0), ("gptq-act-order", "llama", GROUP),
                                               ("gptq-act-order", "qwen3", 16), ("awq", "qwen2", GROUP),
                                               ("awq", "qwen3", 64), ("gptq8", "llama", GROUP),
                                               ("gptq8-asym", "qwen2", GROUP), ("gptq8_v2", "llama", 0),
                                               ("gptq8-act-order", "qwen3", 16), ("w8a16-asym", "qwen2", GROUP),
                                               ("w8a16", "llama", 0)])
def test_int4_formats_match_their_unpacking(kind, arch, group, int4_checkpoint, tiny_checkpoint):
    """Each packing (zero points, group sizes of 16, 32, 64 and whole rows; GPTQ's act-order;
    Qwen2's biases; GPTQ's 8 bits as well)
    against the full-precision model holding the weights that its own libraries' unpacking
    gives (compressed-tensors' decompression; AutoGPTQ's and AutoAWQ's shifts, masks and
    interleave, reproduced in torch). 8-bit GPTQ is int8 values marked weight-only (W8A16:
    x as it is, which the tolerance checks: quantizing x to 8 bits would move logits by
    ~1e-2), not for the Pallas kernel (int4 only), and so is compressed-tensors' W8A16 (its
    zero points packed along out, 4 to a word); 4-bit is int4, for the kernel."""
    path = int4_checkpoint(kind, arch, group)
    hf = unpacked_hf(path, tiny_checkpoint(arch))
    cfg, params = load_model(path)
    want = (jnp.int8, True, False) if kind.startswith(("gptq8", "w8a16")) else (jnp.int4, False, True)
    for w in (w[0] if isinstance(w, list) else w for name, w in params["layers"].items() if name.endswith("proj")):
        assert (w.value.dtype, w.weight_only, w.kernel) == want
    tokens = random_tokens(np.random.default_rng(1), 24)
    assert rel_err(_logits(params, cfg, tokens), hf_logits(hf, tokens)) <= TOL


def kept_full_precision(path: Path, src: Path, out: Path, modules: tuple[str, ...], **changes) -> Path:
    """A copy of GPTQ / AWQ checkpoint `path` whose linears ending in one of `modules` (names
    from after "model.layers.") are stored in full precision (`src`'s float16 weights, as
    optimum and AutoAWQ keep the modules they skip), with quantization_config `changes`."""
    from safetensors.torch import load_file, save_file

    out = _with_config(path, out, **changes)
    tensors = load_file(str(out / "model.safetensors"))
    full = load_file(str(src / "model.safetensors"))
    for name in [n for n in tensors if n.endswith(".qweight") and n.removesuffix(".qweight").endswith(modules)]:
        module = name.removesuffix(".qweight")
        for part in ("qweight", "qzeros", "scales", "g_idx"):
            tensors.pop(f"{module}.{part}", None)
        tensors[f"{module}.weight"] = full[f"{module}.weight"].half()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


@pytest.mark.parametrize("kind, modules, changes", [
    # optimum's modules_in_block_to_quantize (down_proj left out), and the same without the list:
    # vLLM reads which modules are quantized from the files then
    ("gptq-asym", ("down_proj",), dict(modules_in_block_to_quantize=[["self_attn.q_proj", "self_attn.k_proj",
                                      "self_attn.v_proj", "self_attn.o_proj"], ["mlp.gate_proj", "mlp.up_proj"]])),
    ("gptq-act-order", ("down_proj", "o_proj"), {}),
    # GPTQModel's rules: "-:" skips modules; a "+:" rule that changes nothing is read too
    ("gptq-asym", ("down_proj",), dict(dynamic={r"-:.*down_proj": {}, r"+:.*q_proj": {"bits": 4, "sym": False}})),
    # AutoAWQ's and vLLM's modules_to_not_convert match any part of a module's name
    ("awq", ("q_proj", "k_proj", "v_proj", "o_proj"), dict(modules_to_not_convert=["self_attn"])),
])
def test_modules_kept_in_full_precision(kind, modules, changes, int4_checkpoint, tiny_checkpoint, tmp_path):
    """GPTQ and AWQ checkpoints that keep some linears in full precision load them so, the
    others quantized, against the oracle (which takes those as stored)."""
    path = kept_full_precision(int4_checkpoint(kind), tiny_checkpoint("llama"), tmp_path / "kept", modules,
                                **changes)
    hf = unpacked_hf(path, tiny_checkpoint("llama"))
    for stack in (False, True):
        cfg, params = load_model(path, stack_layers=stack)
        kept = [name for name, w in params["layers"].items() if name.endswith("proj")
                and not isinstance(w if stack else w[0], QuantizedWeight)]
        assert kept and all(name.endswith(modules) or name in ("qkv_proj", "gate_up_proj") for name in kept)
        tokens = random_tokens(np.random.default_rng(4), 24)
        assert rel_err(_logits(params, cfg, tokens), hf_logits(hf, tokens)) <= TOL


@pytest.mark.parametrize("kind, name, drop", [("gptq-act-order", "quantize_config.json", ()),
                                              ("awq", "quant_config.json", ("quant_method",))])
def test_quantization_config_in_its_own_file(kind, name, drop, int4_checkpoint, tiny_checkpoint, tmp_path):
    """Older AutoGPTQ and AutoAWQ uploads keep the quantization config in a file of its own
    (AutoAWQ's with its own field names, no quant_method), as vLLM reads them: read as if in
    config.json."""
    path = _with_config(int4_checkpoint(kind), tmp_path / "own-file")
    config = json.loads((path / "config.json").read_text())
    quant = {k: v for k, v in config.pop("quantization_config").items() if k not in drop}
    if kind == "awq":
        quant = {"zero_point": quant["zero_point"], "q_group_size": quant["group_size"], "w_bit": quant["bits"],
                 "version": "GEMM"}
    (path / "config.json").write_text(json.dumps(config))
    (path / name).write_text(json.dumps(quant))
    hf = unpacked_hf(int4_checkpoint(kind), tiny_checkpoint("llama"))
    cfg, params = load_model(path)
    assert cfg.quant_method == kind.split("-")[0]
    tokens = random_tokens(np.random.default_rng(6), 24)
    assert rel_err(_logits(params, cfg, tokens), hf_logits(hf, tokens)) <= TOL


def test_compressed_tensors_static_actorder_is_read_as_weight(int4_checkpoint, tmp_path):
    """llm-compressor 0.14's GPTQ writes actorder "static", compressed-tensors' alias of
    "weight" (the order quantized in; no weight_g_idx): read as "weight" (it was refused)."""
    path = int4_checkpoint("w4a16")
    groups = json.loads((path / "config.json").read_text())["quantization_config"]["config_groups"]
    groups["group_0"]["weights"]["actorder"] = "static"
    cfg, params = load_model(_with_config(path, tmp_path / "static", config_groups=groups))
    _, want = load_model(path)
    tokens = random_tokens(np.random.default_rng(7), 24)
    np.testing.assert_array_equal(np.asarray(_logits(params, cfg, tokens)), np.asarray(_logits(want, cfg, tokens)))


def test_gptq_without_sym_reads_the_zero_points(int4_checkpoint, tiny_checkpoint, tmp_path):
    """A GPTQ config without `sym` (older writers): the zero points are read, as vLLM's GPTQ
    kernel reads them, so an asymmetric checkpoint loads right (it loaded as symmetric)."""
    path = _with_config(int4_checkpoint("gptq-asym"), tmp_path / "no-sym", sym=None)
    hf = unpacked_hf(path, tiny_checkpoint("llama"))
    cfg, params = load_model(path)
    tokens = random_tokens(np.random.default_rng(5), 24)
    assert rel_err(_logits(params, cfg, tokens), hf_logits(hf, tokens)) <= TOL


@pytest.mark.parametrize("kind", ["gptq-act-order", "gptq8-act-order"])
def test_act_order_stacked(kind, int4_checkpoint, tiny_checkpoint):
    """GPTQ act-order (4- and 8-bit) with stacked layers (the GPU layout: each layer's
    permutation a row of a stack, q/k/v apart) against the same oracle; the permutation is
    not the identity."""
    path = int4_checkpoint(kind)
    hf = unpacked_hf(path, tiny_checkpoint("llama"))
    cfg, params = load_model(path, stack_layers=True)
    perm = np.asarray(params["layers"]["q_proj"].perm)
    assert perm.shape == (cfg.num_layers, cfg.hidden_size) and (perm != np.arange(cfg.hidden_size)).any()
    # a stack dequantizes each layer in its own input order, as that layer alone does
    _, alone = load_model(path, stack_layers=False)
    for name in ("o_proj", "down_proj"):  # (those a CPU's per-layer load keeps apart)
        np.testing.assert_array_equal(np.asarray(params["layers"][name].dequantized()),
                                      np.stack([np.asarray(w.dequantized()) for w in alone["layers"][name]]))
    tokens = random_tokens(np.random.default_rng(3), 24)
    assert rel_err(_logits(params, cfg, tokens), hf_logits(hf, tokens)) <= TOL


def test_int4_checkpoint_through_the_engine(int4_checkpoint, tiny_checkpoint):
    """Greedy tokens as the oracle's; the format and the smaller weights in `stats()`
    (int4 values count half a byte). `quantization` may name the checkpoint's method."""
    path = int4_checkpoint("gptq-asym")
    hf = unpacked_hf(path, tiny_checkpoint("llama"))
    prompts = [random_tokens(np.random.default_rng(seed), n) for seed, n in [(1, 5), (2, 17), (3, 40)]]
    llm = LLM(path, quantization="gptq", **ENGINE)  # (the checkpoint's own method, named as vLLM allows)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=8),
                        use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == hf_greedy(hf, prompts, 8)
    stats = llm.llm_engine.stats()
    assert stats["quantization"] == "gptq (checkpoint)"
    value = llm.llm_engine.runner.params["layers"]["qkv_proj"][0].value
    llm.shutdown()
    fp8 = LLM(tiny_checkpoint("llama"), quantization="fp8", **ENGINE)
    fp8_bytes = fp8.llm_engine.stats()["weight_bytes_per_device"][0]
    fp8_value = fp8.llm_engine.runner.params["layers"]["qkv_proj"][0].value
    fp8.shutdown()
    # same layout, half the bytes of fp8's values; the whole model (embeddings full precision) smaller
    assert value.shape == fp8_value.shape and value.dtype == jnp.int4
    assert stats["weight_bytes_per_device"][0] < fp8_bytes


def test_gptq_8bit_through_the_engine(int4_checkpoint, tiny_checkpoint):
    """8-bit GPTQ as Qwen's GPTQ-Int8 checkpoints ship it (Qwen2 with biases, symmetric, v1
    format, groups): greedy tokens as the oracle's (transformers, float32, the weights
    AutoGPTQ's unpacking gives)."""
    path = int4_checkpoint("gptq8", "qwen2")
    hf = unpacked_hf(path, tiny_checkpoint("qwen2"))
    prompts = [random_tokens(np.random.default_rng(seed), n) for seed, n in [(1, 5), (2, 17), (3, 40)]]
    llm = LLM(path, **ENGINE)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=8),
                        use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == hf_greedy(hf, prompts, 8)
    assert llm.llm_engine.stats()["quantization"] == "gptq (checkpoint)"
    weight = llm.llm_engine.runner.params["layers"]["qkv_proj"][0]
    assert weight.value.dtype == jnp.int8 and weight.weight_only and weight.zero is None
    llm.shutdown()


def test_online_int4(tiny_checkpoint):
    """`quantization="gptq-dummy"`: each linear weight rounded to 4 bits per group of 128 (of
    64 on the tiny model's 64 inputs: whole groups) at load, against transformers holding
    the weights those 4 bits stand for; random 4-bit weights with load_format="dummy"."""
    from transformers import AutoModelForCausalLM

    path = tiny_checkpoint("llama")
    cfg, params = load_model(path, quantization="gptq-dummy")
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        for name, module in hf.model.layers.named_modules():
            if name.rsplit(".", 1)[-1] in LINEAR:
                weight = quantize_int4(jnp.asarray(module.weight.numpy()), 1)
                assert weight.group_size == min(128, module.weight.shape[1])
                module.weight.copy_(torch.from_numpy(np.array(weight.dequantized())))
    # on one device, each marked for the Pallas W4A16 kernel (which a GPU runs)
    assert all(w[0].value.dtype == jnp.int4 and w[0].kernel for name, w in params["layers"].items()
               if name.endswith("proj"))
    tokens = random_tokens(np.random.default_rng(2), 24)
    assert rel_err(_logits(params, cfg, tokens), hf_logits(hf, tokens)) <= TOL
    llm = LLM(path, load_format="dummy", quantization="gptq-dummy", **ENGINE)
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4 and llm.llm_engine.stats()["quantization"] == "gptq-dummy"
    llm.shutdown()


_TP_SCRIPT = """
import json, sys
import numpy as np
from jaxvllm import LLM, SamplingParams
ENGINE = dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64, token_buckets=[64])
prompts = [{"prompt_token_ids": np.random.default_rng(seed).integers(3, 200, 12).tolist()} for seed in range(3)]
out = {}
for path, quantization in [(path, None) for path in sys.argv[1:-1]] + [(sys.argv[-1], "gptq-dummy")]:
    for tp in (1, 2):
        llm = LLM(path, quantization=quantization, tensor_parallel_size=tp, **ENGINE)
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
        out[f"{path} {quantization} {tp}"] = [o.outputs[0].token_ids for o in outs]
        weight = llm.llm_engine.runner.params["layers"]["o_proj"]
        weight = weight[0] if isinstance(weight, list) else weight
        out[f"kernel {path} {quantization} {tp}"] = [weight.kernel, str(weight.value.dtype)]
        llm.shutdown()
print(json.dumps(out))
"""


def test_int4_under_tensor_parallelism(int4_checkpoint, tiny_checkpoint, tmp_path):
    """2 CPU devices (a process of its own): GPTQ (also act-order, and 8-bit act-order) and AWQ
    checkpoints (zero points, o_proj and down_proj split on their grouped input axis) and
    online 4-bit give one device's tokens; only one device's int4 weights are marked for the
    Pallas kernel (8-bit ones never are). With 1 KV head over 2 devices, the k/v projections'
    zero points are repeated with their values and scales (they once were not: a shape error)."""
    from weights.make_quantized import make_gptq

    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    one_kv_head = make_gptq(tiny_checkpoint("llama", num_key_value_heads=1), tmp_path / "gptq-asym-1kv", GROUP, False)
    paths = [str(int4_checkpoint("gptq-asym")), str(int4_checkpoint("awq")), str(int4_checkpoint("gptq-act-order")),
             str(int4_checkpoint("gptq8-act-order")), str(one_kv_head), str(tiny_checkpoint("llama"))]
    proc = subprocess.run([sys.executable, "-c", _TP_SCRIPT, *paths], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for key in [k for k in out if k.endswith(" 1") and not k.startswith("kernel")]:
        assert out[key[:-1] + "2"] == out[key], key
        # one device: the Pallas kernel's int4 weights; split: XLA's (its partitioner cannot split a kernel)
        (kernel, dtype), (split_kernel, _) = out[f"kernel {key}"], out[f"kernel {key[:-1]}2"]
        assert kernel == (dtype == "int4") and not split_kernel, key
    assert sum(out[key][1] == "int8" for key in out if key.startswith("kernel")) == 2
    assert f"{one_kv_head} None 2" in out


def test_no_compiles_after_warmup(int4_checkpoint, compile_counter):
    """A 4-bit checkpoint serves both buckets with what the warm-up compiled."""
    prompts = [{"prompt_token_ids": list(range(10, 10 + n))} for n in (20, 3, 6, 1)]
    llm = LLM(int4_checkpoint("awq"), max_model_len=128, max_num_seqs=12, max_num_batched_tokens=24,
              token_buckets=[8, 24])
    llm.llm_engine.finish_warmup()
    before = compile_counter.count
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
    assert compile_counter.count == before
    llm.shutdown()


def test_bad_int4_checkpoints_are_refused(int4_checkpoint, tiny_checkpoint, tmp_path):
    """Each refused while the config is read or the tensors load, naming the problem; nothing
    placed stays on the device while the error is kept."""
    gptq, w4a16 = int4_checkpoint("gptq-asym"), int4_checkpoint("w4a16")
    cases = [
        (gptq, dict(bits=3), r"3-bit GPTQ is not supported; jaxvllm reads 4- and 8-bit GPTQ and 4-bit AWQ"),
        (gptq, dict(quant_method="awq", bits=8), r"8-bit AWQ is not supported; jaxvllm reads 4- and 8-bit GPTQ"),
        (gptq, dict(checkpoint_format="marlin"), r"GPTQ checkpoint_format 'marlin' is not supported"),
        # GPTQModel's per-module overrides (here down_proj asymmetric) were ignored: wrong weights
        (gptq, dict(sym=True, dynamic={"+:.*down_proj": {"sym": False}}),
         r"GPTQ 'dynamic' per-module overrides \(\+:\.\*down_proj\) are not supported"),
        (gptq, dict(group_size=48), r"model.layers.0.self_attn.q_proj.weight: group_size 48 does not divide its 64 "
                                    r"inputs, which GPTQ requires"),
        # groups of 32 over 64 inputs: scales [2, out]; groups of 16 imply [4, out]
        (gptq, dict(group_size=16), r"tensor model.layers.0.self_attn.q_proj.scales has shape \(2, 64\), "
                                    r"config.json implies \(4, 64\)"),
        (gptq, dict(quant_method="awq", version="gemv"), r"AWQ version 'gemv' is not supported"),
        (w4a16, dict(format="marlin-24"), r"compressed-tensors format 'marlin-24' is not supported; jaxvllm reads"),
        (w4a16, dict(config_groups={"group_0": {"targets": ["Linear"], "weights": {
            "num_bits": 4, "type": "int", "strategy": "group", "group_size": 32, "symmetric": True},
            "input_activations": {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True}}}),
         r"pack-quantized with input_activations .* is not supported; jaxvllm reads weight-only \(W4A16, W8A16\)"),
        (w4a16, dict(config_groups={"group_0": {"targets": ["Linear"], "weights": {
            "num_bits": 2, "type": "int", "strategy": "group", "group_size": 32, "symmetric": True}}}),
         r"pack-quantized weights \{'num_bits': 2, 'type': 'int', 'strategy': 'group'\} are not supported; jaxvllm "
         r"reads 4- or 8-bit int weights"),
        (w4a16, dict(config_groups={"group_0": {"targets": ["Linear"], "weights": {
            "num_bits": 4, "type": "int", "strategy": "group", "group_size": 32, "symmetric": True,
            "actorder": "group"}}}),
         r"compressed-tensors actorder 'group' \(weight_g_idx\) is not supported"),
    ]
    for i, (path, changes, match) in enumerate(cases):
        live = len(jax.live_arrays())
        with pytest.raises(ValueError, match=match) as caught:
            LLM(_with_config(path, tmp_path / str(i), **changes), **ENGINE)
        assert len(jax.live_arrays()) == live, caught.value
    unpacked = _with_config(tiny_checkpoint("llama"), tmp_path / "unpacked", quant_method="gptq", bits=4,
                            group_size=32, sym=True, desc_act=False)
    with pytest.raises(ValueError, match=r"the checkpoint.s quantization config is GPTQ, but it holds no quantized weight "
                                         r"\(no \*.qweight tensor\)"):
        LLM(unpacked, **ENGINE)
    # A quantized lm_head whose config does not say so (GPTQModel's `lm_head: true` is refused by the config)
    from safetensors.torch import load_file, save_file

    head = _with_config(gptq, tmp_path / "head")
    tensors = load_file(str(head / "model.safetensors"))
    weight = tensors.pop("lm_head.weight")
    tensors["lm_head.qweight"] = torch.zeros(weight.shape[1] // 8, weight.shape[0], dtype=torch.int32)
    save_file(tensors, str(head / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"lm_head is quantized in the checkpoint, which jaxvllm does not read for that "
                                         r"weight"):
        LLM(head, **ENGINE)
    # Keys vLLM's readers require, refused with its words rather than read with a default
    for i, (path, key) in enumerate([(gptq, "desc_act"), (gptq, "group_size"), (gptq, "bits"),
                                     (int4_checkpoint("awq"), "zero_point")]):
        with pytest.raises(ValueError, match=rf"Cannot find any of \[.*'{key}'\] in the model's quantization config"):
            LLM(_with_config(path, tmp_path / f"no-{key}-{i}", **{key: None}), **ENGINE)
    no_scale = _with_config(w4a16, tmp_path / "no-scale")
    tensors = load_file(str(no_scale / "model.safetensors"))
    del tensors["model.layers.1.mlp.down_proj.weight_scale"]
    save_file(tensors, str(no_scale / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing tensor\(s\): model.layers.1.mlp.down_proj.weight_scale"):
        LLM(no_scale, **ENGINE)
    # A scale of a weight the loader reads as plain values (a quantized router, say) is refused.
    stray = _with_config(w4a16, tmp_path / "stray-scale")
    tensors = load_file(str(stray / "model.safetensors"))
    tensors["model.layers.0.input_layernorm.weight_scale"] = torch.ones(1)
    save_file(tensors, str(stray / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"quantization tensors jaxvllm does not read: "
                                         r"\['model.layers.0.input_layernorm.weight_scale'\]"):
        LLM(stray, **ENGINE)
    with pytest.raises(ValueError, match=r"quantization='gptq-dummy' does not match the checkpoint's quant_method "
                                         r"'gptq' in config.json"):
        LLM(gptq, quantization="gptq-dummy", **ENGINE)
    # (expert stacks' refusals: tests/models/test_quantized_moe.py)
    # act-order: a group one input short; q and k (merged on a CPU) in different orders
    act_order = int4_checkpoint("gptq-act-order")
    for i, (module, change, match) in enumerate([
            ("mlp.down_proj", lambda g: torch.cat([(g[:1] + 1) % 4, g[1:]]),
             r"tensor model.layers.0.mlp.down_proj.g_idx gives groups of \[31, 32, 33\] inputs; act-order needs "
             r"groups of group_size 32"),
            ("self_attn.k_proj", lambda g: g.flip(0), r"model.layers.0.self_attn.k_proj.g_idx orders its inputs unlike "
                                                      r"model.layers.0.self_attn.q_proj.g_idx")]):
        broken = _with_config(act_order, tmp_path / f"act-order-{i}")
        tensors = load_file(str(broken / "model.safetensors"))
        key = f"model.layers.0.{module}.g_idx"
        tensors[key] = change(tensors[key]).to(torch.int32).contiguous()
        save_file(tensors, str(broken / "model.safetensors"), metadata={"format": "pt"})
        with pytest.raises(ValueError, match=match):
            LLM(broken, **ENGINE)


def test_a_ctrl_c_while_act_order_weights_join_leaves_nothing_placed(int4_checkpoint, monkeypatch):
    """The permutations placed beside act-order weights for their join are deleted too."""
    assert_a_ctrl_c_in_the_join_leaves_nothing_placed(int4_checkpoint("gptq-act-order"), monkeypatch, at=2)

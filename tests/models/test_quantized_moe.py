"""Quantized expert stacks (Qwen3-MoE, Mixtral): online fp8 and 8-bit checkpoints through
the grouped matmul (W8A8: `jaxvllm.quantization.quantized_grouped_matmul`), against HF
transformers (float32, CPU) whose attention Linears and experts compute the same product
in torch: weights as the format rounds them, each input rounded to fp8 per token (and
block). Weight-only expert stacks (4-bit GPTQ, AWQ and compressed-tensors W4A16, 8-bit
GPTQ, online "gptq-dummy") against transformers holding the weights their formats' own
unpacking gives (`test_int4.unpacked_hf`), and a GPU's path for them, the grouped W4A16
kernel (interpreted), against the CPU's float stacks. Also tensor and expert parallelism,
and the refusals."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from functools import partial
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxvllm import LLM, SamplingParams, load_model
from jaxvllm.kv_cache import allocate_kv_caches
from jaxvllm.quantization import QuantizedWeight, experts_dequantized, quantize_int4
from tests.models.paged import (Chunk, build_inputs, greedy_decode, hf_greedy, hf_logits, jit_forward, random_tokens,
                                 rel_err)
from tests.models.test_quantization import (block_dequantized, fp8_block, fp8_round, near_ties, tie_free_tokens,
                                            w8a8_oracle)
from tests.models.test_int4 import LINEAR, int4_checkpoint, kept_full_precision, unpacked_hf  # noqa: F401 (a fixture)

ROOT = Path(__file__).resolve().parents[2]
TOL = 1e-4
ENGINE = dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64, token_buckets=[64])
BLOCK = (16, 16)  # several blocks in each expert's 64 hidden and 32 intermediate inputs


def w8a8_experts(model, group: int = 0, round_weights: bool = True):
    """`model`'s experts computing the W8A8 product: each expert's weights rounded to fp8 per
    output row (`round_weights`; a checkpoint's come rounded), each input (the token's
    hidden state, then its expert's intermediate activations) per token and `group` inputs.
    HF's routing and weighting are kept as they are; inputs near an fp8 rounding jump are
    counted into `model.near_ties`."""
    for layer in model.model.layers:
        experts = getattr(layer.mlp, "experts", None)
        if experts is None:
            continue
        if round_weights:
            with torch.no_grad():
                experts.gate_up_proj.copy_(fp8_round(experts.gate_up_proj, -1))
                experts.down_proj.copy_(fp8_round(experts.down_proj, -1))

        def forward(self, hidden_states, top_k_index, top_k_weights):
            out = torch.zeros_like(hidden_states)
            for e in range(self.gate_up_proj.shape[0]):
                token, k = torch.where(top_k_index == e)
                if len(token) == 0:
                    continue
                x = hidden_states[token]
                model.near_ties += near_ties(x, group)
                gate, up = torch.nn.functional.linear(fp8_round(x, -1, group), self.gate_up_proj[e]).chunk(2, dim=-1)
                h = self.act_fn(gate) * up
                model.near_ties += near_ties(h, group)
                h = torch.nn.functional.linear(fp8_round(h, -1, group), self.down_proj[e])
                out.index_add_(0, token, (h * top_k_weights[token, k, None]).to(out.dtype))
            return out

        experts.forward = types.MethodType(forward, experts)
    return model


def block_fp8_hf(path: Path, src: Path):
    """The full-precision HF model of `src` holding `path`'s block-fp8 weights (HF's or
    compressed-tensors'), dequantized from the format's definition (each scale over its
    block), experts included."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).eval()
    tensors = load_file(str(path / "model.safetensors"))
    dequantized = partial(block_dequantized, tensors, block=fp8_block(path))
    state = hf.state_dict()
    with torch.no_grad():
        for name in [n for n, t in tensors.items() if t.dtype == torch.float8_e4m3fn]:
            if ".experts." not in name:
                state[name].copy_(dequantized(name))
        for i, layer in enumerate(hf.model.layers):
            experts = getattr(layer.mlp, "experts", None)
            if experts is None:
                continue
            p = f"model.layers.{i}.mlp.experts" if ".mlp.experts." in " ".join(tensors) else \
                f"model.layers.{i}.block_sparse_moe.experts"
            names = ("gate_proj", "up_proj", "down_proj") if "mlp.experts" in p else ("w1", "w3", "w2")
            for e in range(experts.gate_up_proj.shape[0]):
                gate, up, down = (dequantized(f"{p}.{e}.{n}.weight") for n in names)
                experts.gate_up_proj[e].copy_(torch.cat([gate, up]))
                experts.down_proj[e].copy_(down)
    return hf


def _logits(params, cfg, tokens, backend):
    inputs = build_inputs([Chunk(tokens, 0, list(range(8)))], 4, all_logits=True)
    return jit_forward(params, allocate_kv_caches(cfg, 8, 4, jnp.float32), inputs, cfg, backend)[0]


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
@pytest.mark.parametrize("backend", ["reference", "pallas"])
def test_online_fp8_experts_match_the_oracle(arch, backend, tiny_checkpoint):
    """`quantization="fp8"` on a mixture of experts: every expert per output channel, through
    ragged_dot or the Pallas grouped matmul."""
    from transformers import AutoModelForCausalLM

    path = tiny_checkpoint(arch)
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    hf = w8a8_experts(w8a8_oracle(hf))
    cfg, params = load_model(path, quantization="fp8")
    experts = params["layers"]["experts_gate"][0]
    assert isinstance(experts, QuantizedWeight) and experts.scale.shape == (cfg.num_experts, 1,
                                                                            cfg.moe_intermediate_size)
    tokens = tie_free_tokens(hf, 24)
    assert rel_err(_logits(params, cfg, tokens, backend), hf_logits(hf, tokens)) <= TOL


@pytest.mark.parametrize("arch, writer", [("qwen3_moe", "hf"), ("mixtral", "hf"), ("qwen3_moe", "compressed-tensors")])
@pytest.mark.parametrize("backend", ["reference", "pallas"])
def test_block_fp8_experts_match_the_oracle(arch, writer, backend, tiny_checkpoint, tmp_path):
    """An HF block-fp8 checkpoint whose experts are block-fp8 too (as Qwen3-30B-A3B-FP8
    ships), or compressed-tensors' FP8_BLOCK, blocks of 16: activations per token and block
    through ragged_dot once per block, or the Pallas grouped matmul once, scaling each
    block's product in the kernel."""
    from weights.make_quantized import make_compressed, make_fp8

    src = tiny_checkpoint(arch)
    path = (make_fp8(src, tmp_path / "fp8", BLOCK) if writer == "hf" else
            make_compressed(src, tmp_path / "fp8", "fp8-block", BLOCK))
    hf = w8a8_experts(w8a8_oracle(block_fp8_hf(path, src), group=BLOCK[1], round_weights=False), group=BLOCK[1],
                      round_weights=False)
    cfg, params = load_model(path)
    experts = params["layers"]["experts_down"][0]
    groups = cfg.moe_intermediate_size // BLOCK[1]  # (the down projection's inputs)
    assert experts.group_size == BLOCK[1] and experts.scale.shape == (cfg.num_experts, groups, cfg.hidden_size)
    tokens = tie_free_tokens(hf, 24)
    assert rel_err(_logits(params, cfg, tokens, backend), hf_logits(hf, tokens)) <= TOL


_PARALLEL_SCRIPT = """
import json, sys
import numpy as np
from jaxvllm import LLM, SamplingParams
ENGINE = dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64, token_buckets=[64])
prompts = [{"prompt_token_ids": np.random.default_rng(seed).integers(3, 200, 12).tolist()} for seed in range(3)]
out = {}
for path, quantization in ((sys.argv[1], "fp8"), (sys.argv[2], None)):
    for tp, ep in ((1, False), (2, False), (2, True)):
        llm = LLM(path, quantization=quantization, tensor_parallel_size=tp, enable_expert_parallel=ep, **ENGINE)
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, logprobs=1), use_tqdm=False)
        out[f"{quantization} {tp} {ep}"] = [[o.outputs[0].token_ids, o.outputs[0].cumulative_logprob] for o in outs]
        llm.shutdown()
# the Pallas backend: each device's block-scaled experts through the grouped kernel's block scales
llm = LLM(sys.argv[2], attention_backend="pallas", tensor_parallel_size=2, **ENGINE)
outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, logprobs=1), use_tqdm=False)
out["None 2 False pallas"] = [[o.outputs[0].token_ids, o.outputs[0].cumulative_logprob] for o in outs]
llm.shutdown()
try:  # blocks of 32 over an intermediate size of 32 split in 2
    LLM(sys.argv[3], tensor_parallel_size=2, **ENGINE)
except ValueError as e:
    out["straddle"] = str(e)
print(json.dumps(out))
"""


def test_quantized_experts_under_tensor_and_expert_parallelism(tiny_checkpoint, tmp_path):
    """2 CPU devices (a process of its own), the engine's backend: online fp8 and a block-fp8
    checkpoint give one device's tokens (and log-probabilities) split by the experts'
    intermediate dimension (the down projection's per-token scales over both devices'
    inputs) and by whole experts, the block-fp8 one also on the Pallas backend (each
    device's blocks through the kernel's block scales); block scales that the split would
    cut are refused."""
    from weights.make_quantized import make_fp8

    src = tiny_checkpoint("qwen3_moe")
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    paths = [str(src), str(make_fp8(src, tmp_path / "fp8", BLOCK)), str(make_fp8(src, tmp_path / "fp8-32", (32, 32)))]
    proc = subprocess.run([sys.executable, "-c", _PARALLEL_SCRIPT, *paths], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for kind in ("fp8", "None"):
        one = out[f"{kind} 1 False"]
        for split in ("2 False", "2 True") + (("2 False pallas",) if kind == "None" else ()):
            two = out[f"{kind} {split}"]
            assert [t for t, _ in two] == [t for t, _ in one], (kind, split)
            np.testing.assert_allclose([lp for _, lp in two], [lp for _, lp in one], rtol=1e-4, atol=1e-4)
    # block scales a split would cut: refused before any weight loads, naming the sizes
    assert out["straddle"].startswith("experts_down: blocks of 32 inputs straddle the split of moe_intermediate_size "
                                      "32 over 2 devices (16 each)")


def test_quantized_experts_through_the_engine(tiny_checkpoint, compile_counter):
    """fp8 experts serve both buckets with what the warm-up compiled; the weight bytes in
    `stats()` below the full model's."""
    engine = dict(max_model_len=128, max_num_seqs=12, max_num_batched_tokens=24, token_buckets=[8, 24])
    full = LLM(tiny_checkpoint("mixtral"), **engine)
    fp8 = LLM(tiny_checkpoint("mixtral"), quantization="fp8", **engine)
    full.llm_engine.finish_warmup()
    fp8.llm_engine.finish_warmup()
    prompts = [{"prompt_token_ids": list(range(10, 10 + n))} for n in (20, 3, 6, 1)]
    before = compile_counter.count
    out = fp8.generate(prompts, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert compile_counter.count == before
    assert all(len(o.outputs[0].token_ids) == 8 for o in out)
    assert fp8.llm_engine.stats()["weight_bytes_per_device"][0] < full.llm_engine.stats()["weight_bytes_per_device"][0]
    full.shutdown()
    fp8.shutdown()


def test_quantized_experts_refusals(tiny_checkpoint, tmp_path):
    """Expert stacks with static activation scales or GPTQ act-order are refused before any
    weight loads (the config alone: no tensor is read)."""
    from tests.models.test_quantization import _with_config

    src = tiny_checkpoint("qwen3_moe")
    static = _with_config(src, tmp_path / "static", quant_method="fp8", activation_scheme="static")
    with pytest.raises(ValueError, match=r"Qwen3MoeForCausalLM: statically scaled expert stacks are not supported "
                                         r"yet; jaxvllm reads"):
        LLM(static, **ENGINE)
    act_order = _with_config(src, tmp_path / "act-order", quant_method="gptq", bits=4, group_size=16, desc_act=True)
    with pytest.raises(ValueError, match=r"Qwen3MoeForCausalLM: GPTQ act-order \(desc_act\) expert stacks are not "
                                         r"supported yet; .* 4-bit or 8-bit GPTQ without act-order \(desc_act false\)"):
        LLM(act_order, **ENGINE)


def test_expert_blocks_are_checked_in_the_experts_own_scheme(tiny_checkpoint, tmp_path):
    """Under tensor parallelism the experts' down projection's blocks must not straddle a
    split (32 inputs over 2 devices: 16 each). In a mixed-precision checkpoint the experts'
    own scheme decides: blocks of 32 in the attention alone leave per-channel experts free
    (they were refused), and the experts' own blocks of 32 are refused."""
    from jaxvllm.loader import _check_expert_blocks, load_config, quantization_config, quantized_specs
    from jaxvllm.models import MODELS
    from jaxvllm.quantization import checkpoint_format
    from weights.make_quantized import make_mixed

    src = tiny_checkpoint("qwen3_moe")
    for name, experts, refused in (("channel", ("w8a16", 0, True), False), ("blocks", ("fp8-block", (32, 32)), True)):
        path = make_mixed(src, tmp_path / name, {r".*self_attn": ("fp8-block", (32, 32)), r".*mlp": experts})
        cfg, fmt = load_config(path), checkpoint_format(quantization_config(path), str(path))
        specs = quantized_specs(MODELS[cfg.architecture].param_specs(cfg), fmt)
        assert cfg.moe_intermediate_size == 32
        _check_expert_blocks(cfg, specs, fmt, 2, expert_parallel=True)
        if refused:
            with pytest.raises(ValueError, match=r"experts_down: blocks of 32 inputs straddle the split of "
                                                 r"moe_intermediate_size 32 over 2 devices"):
                _check_expert_blocks(cfg, specs, fmt, 2, expert_parallel=False)
        else:
            _check_expert_blocks(cfg, specs, fmt, 2, expert_parallel=False)


def test_a_quantized_router(int4_checkpoint, tiny_checkpoint, tmp_path):
    """AutoAWQ quantizes Qwen3-MoE's router (`mlp.gate`) unless told not to, and vLLM reads it
    so: logits as transformers' holding the router that AutoAWQ's unpacking gives, in both
    layouts (it was refused)."""
    from safetensors.torch import load_file, save_file

    from tests.models.test_quantization import _with_config
    from weights.make_quantized import AWQ_ORDER, pack_words, quantize_groups

    path = _with_config(int4_checkpoint("awq", "qwen3_moe", 16), tmp_path / "router")
    tensors = load_file(str(path / "model.safetensors"))
    for name in [n for n in tensors if n.endswith("mlp.gate.weight")]:
        module = name.removesuffix(".weight")
        value, scale, zero = quantize_groups(tensors.pop(name).float(), 16, symmetric=False)
        tensors.update({f"{module}.qweight": torch.from_numpy(pack_words(value.T.numpy(), AWQ_ORDER)),
                        f"{module}.qzeros": torch.from_numpy(pack_words(zero.T.numpy(), AWQ_ORDER)),
                        f"{module}.scales": scale.T.contiguous()})
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    hf = unpacked_hf(path, tiny_checkpoint("qwen3_moe"))
    tokens = random_tokens(np.random.default_rng(1), 24)
    for stack in (False, True):
        cfg, params = load_model(path, stack_layers=stack)
        router = params["layers"]["router"]
        assert isinstance(router if stack else router[0], QuantizedWeight)
        assert rel_err(_logits(params, cfg, tokens, "reference"), hf_logits(hf, tokens)) <= 1e-5


def test_expert_stacks_kept_in_full_precision(int4_checkpoint, tiny_checkpoint, tmp_path):
    """A GPTQ mixture of experts whose experts are stored in full precision (the rest 4-bit):
    the experts read as stored, in both layouts, against the oracle (they were refused: an
    expert stack's name is a template, which matched no module stored so)."""
    path = kept_full_precision(int4_checkpoint("gptq-asym", "qwen3_moe", 16), tiny_checkpoint("qwen3_moe"),
                               tmp_path / "kept", tuple(f"experts.{e}.{name}" for e in range(8)
                                                        for name in ("gate_proj", "up_proj", "down_proj")))
    hf = unpacked_hf(path, tiny_checkpoint("qwen3_moe"))
    tokens = random_tokens(np.random.default_rng(1), 24)
    for stack in (False, True):
        cfg, params = load_model(path, stack_layers=stack)
        experts, o = params["layers"]["experts_gate"][0], params["layers"]["o_proj"]
        assert not isinstance(experts, QuantizedWeight) and isinstance(o if stack else o[0], QuantizedWeight)
        assert rel_err(_logits(params, cfg, tokens, "reference"), hf_logits(hf, tokens)) <= 1e-5


# Weight-only expert stacks: (writer, group) of each kind; groups of 16 and 32 over the experts'
# 64 (gate/up) and 32 (down) inputs, 0: one group a row (compressed-tensors' channel strategy).
WEIGHT_ONLY = {"gptq": ("gptq", 16), "gptq-asym": ("gptq-asym", 16), "awq": ("awq", 16),
               "w4a16-channel": ("w4a16", 0), "gptq8": ("gptq8", 32), "w8a16-asym": ("w8a16-asym", 16)}


def test_experts_dequantized():
    """A weight-only stack [E, in, out] dequantized as each expert's [out, in] weight is
    (`QuantizedWeight.dequantized`), whole and partial groups, zero points or none; and
    through the Pallas grouped matmul (interpreted) as through ragged_dot."""
    from jaxvllm.models.moe import grouped_experts

    rng = np.random.default_rng(0)
    e, n, out = 3, 40, 24
    for group, zero in ((8, True), (16, False), (16, True), (0, False)):
        groups = -(-n // group) if group else 1
        value = jnp.asarray(rng.integers(-8, 8, (e, n, out)), jnp.int4)
        scale = jnp.asarray(rng.uniform(0.01, 0.1, (e, groups, out)), jnp.float32)
        zeros = jnp.asarray(rng.integers(-8, 8, (e, groups, out)), jnp.float32) if zero else None
        stack = QuantizedWeight(value, scale, group, zeros)
        want = [QuantizedWeight(value[j].T, scale[j].T, group, None if zeros is None else zeros[j].T).dequantized().T
                for j in range(e)]
        np.testing.assert_array_equal(np.asarray(experts_dequantized(stack, jnp.float32)), np.stack(want))
    rows, sizes = jnp.asarray(rng.standard_normal((10, 16)), jnp.float32), jnp.asarray([4, 0, 6], jnp.int32)
    layer = {name: QuantizedWeight(jnp.asarray(rng.integers(-128, 128, (3, i, o)), jnp.int8),
                                   jnp.asarray(rng.uniform(0.001, 0.01, (3, 1, o)), jnp.float32), weight_only=True)
             for name, i, o in (("experts_gate", 16, 8), ("experts_up", 16, 8), ("experts_down", 8, 16))}
    dense = {name: experts_dequantized(w, jnp.float32) for name, w in layer.items()}
    np.testing.assert_allclose(np.asarray(grouped_experts(rows, sizes, layer, "pallas")),
                               np.asarray(grouped_experts(rows, sizes, dense, "reference")), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", list(WEIGHT_ONLY))
def test_weight_only_experts_match_their_unpacking(kind, int4_checkpoint, tiny_checkpoint):
    """4-bit GPTQ (symmetric, asymmetric), AWQ and compressed-tensors W4A16 expert stacks and
    8-bit GPTQ and compressed-tensors ones (W8A16), with the rest of the model in the same format: logits and greedy
    tokens as transformers' (float32) holding the weights the formats' own unpacking gives."""
    writer, group = WEIGHT_ONLY[kind]
    path = int4_checkpoint(writer, "qwen3_moe", group)
    hf = unpacked_hf(path, tiny_checkpoint("qwen3_moe"))
    cfg, params = load_model(path)
    down = params["layers"]["experts_down"][0]
    eight = kind in ("gptq8", "w8a16-asym")
    assert down.value.dtype == (jnp.int8 if eight else jnp.int4) and down.weight_only == eight
    groups = cfg.moe_intermediate_size // group if group else 1
    assert down.scale.shape == (cfg.num_experts, groups, cfg.hidden_size) and not down.kernel
    assert (down.zero is None) == (kind in ("gptq", "w4a16-channel", "gptq8"))
    tokens = random_tokens(np.random.default_rng(1), 24)
    assert rel_err(_logits(params, cfg, tokens, "reference"), hf_logits(hf, tokens)) <= 1e-5
    prompt = random_tokens(np.random.default_rng(2), 12)
    caches = allocate_kv_caches(cfg, 8, 4, jnp.float32)
    got, _ = greedy_decode(params, cfg, caches, prompt, 6, list(range(8)), 4)
    assert got[len(prompt):] == hf_greedy(hf, [prompt], 6)[0]


def test_online_int4_experts(tiny_checkpoint):
    """`quantization="gptq-dummy"` on a mixture of experts: each expert's weights rounded to
    4 bits as a linear weight is (`quantize_int4`), against transformers holding the
    weights those 4 bits stand for, experts and all."""
    from transformers import AutoModelForCausalLM

    path = tiny_checkpoint("qwen3_moe")
    cfg, params = load_model(path, quantization="gptq-dummy")
    gate = params["layers"]["experts_gate"][0]
    assert gate.value.dtype == jnp.int4 and gate.scale.shape == (cfg.num_experts, 1, cfg.moe_intermediate_size)
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()

    def rounded(weight: torch.Tensor) -> torch.Tensor:  # [out, in]
        return torch.from_numpy(np.array(quantize_int4(jnp.asarray(weight.numpy()), 1).dequantized()))

    with torch.no_grad():
        for name, module in hf.model.layers.named_modules():
            if name.rsplit(".", 1)[-1] in LINEAR:
                module.weight.copy_(rounded(module.weight))
            elif name.endswith("mlp.experts"):
                for e in range(module.gate_up_proj.shape[0]):
                    gate_up = module.gate_up_proj[e]
                    half = gate_up.shape[0] // 2
                    module.gate_up_proj[e].copy_(torch.cat([rounded(gate_up[:half]), rounded(gate_up[half:])]))
                    module.down_proj[e].copy_(rounded(module.down_proj[e]))
    tokens = random_tokens(np.random.default_rng(2), 24)
    assert rel_err(_logits(params, cfg, tokens, "reference"), hf_logits(hf, tokens)) <= 1e-5


_WEIGHT_ONLY_PARALLEL_SCRIPT = """
import json, sys
import numpy as np
from jaxvllm import LLM, SamplingParams
ENGINE = dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64, token_buckets=[64])
prompts = [{"prompt_token_ids": np.random.default_rng(seed).integers(3, 200, 12).tolist()} for seed in range(3)]
out = {}
for path, quantization, splits in ((sys.argv[1], None, ((1, False), (2, False), (2, True))),
                                   (sys.argv[2], "gptq-dummy", ((1, False), (2, False)))):
    for tp, ep in splits:
        llm = LLM(path, quantization=quantization, tensor_parallel_size=tp, enable_expert_parallel=ep, **ENGINE)
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, logprobs=1), use_tqdm=False)
        out[f"{quantization} {tp} {ep}"] = [[o.outputs[0].token_ids, o.outputs[0].cumulative_logprob] for o in outs]
        llm.shutdown()
import jax  # a GPU's branches from here on: each device's experts through the grouped W4A16 kernel (interpreted)
from jaxvllm import quantization as q
jax.lax.platform_dependent = lambda *args, default, **branches: default(*args)
kernel, calls = q._grouped_weight_only_pallas, []
q._grouped_weight_only_pallas = lambda rows, *args, **kwargs: calls.append(rows.shape) or kernel(rows, *args, **kwargs)
for path, quantization, ep in ((sys.argv[1], None, True), (sys.argv[1], None, False),
                               (sys.argv[2], "gptq-dummy", False)):
    calls.clear()
    llm = LLM(path, quantization=quantization, attention_backend="pallas", tensor_parallel_size=2,
              enable_expert_parallel=ep, **ENGINE)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, logprobs=1), use_tqdm=False)
    out[f"{quantization} 2 {ep} kernel"] = [[o.outputs[0].token_ids, o.outputs[0].cumulative_logprob] for o in outs]
    out[f"{quantization} 2 {ep} kernel calls"] = len(calls)
    llm.shutdown()
print(json.dumps(out))
"""


def test_weight_only_experts_under_tensor_and_expert_parallelism(int4_checkpoint, tiny_checkpoint):
    """2 CPU devices (a process of its own), the engine: a GPTQ 4-bit checkpoint with zero
    points gives one device's tokens (and log-probabilities) split by the experts'
    intermediate dimension (groups of 16: one a device in the down projection) and by whole
    experts; online 4-bit under tensor parallelism too (one group of 32 over the down
    projection's inputs, which the devices hold 16 and 16 of). And the Pallas backend on a
    GPU's path, under expert parallelism and under tensor parallelism without it (both
    checkpoints: whole groups a device, and one group shared): each device's int4 experts
    through the grouped kernel, which no float copy of the stacks replaces."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    paths = [str(int4_checkpoint("gptq-asym", "qwen3_moe", 16)), str(tiny_checkpoint("qwen3_moe"))]
    proc = subprocess.run([sys.executable, "-c", _WEIGHT_ONLY_PARALLEL_SCRIPT, *paths], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for kind, splits in (("None", ("2 False", "2 True", "2 True kernel", "2 False kernel")),
                         ("gptq-dummy", ("2 False", "2 False kernel"))):
        one = out[f"{kind} 1 False"]
        for split in splits:
            two = out[f"{kind} {split}"]
            assert [t for t, _ in two] == [t for t, _ in one], (kind, split)
            np.testing.assert_allclose([lp for _, lp in two], [lp for _, lp in one], rtol=1e-4, atol=1e-4)
            if split.endswith("kernel"):  # (traced per device: gate, up and down of every MoE layer kind)
                assert out[f"{kind} {split} calls"] >= 3, (kind, split)


def gpu_branches(monkeypatch) -> list:
    """From here on in the test, `jax.lax.platform_dependent` takes its GPU (default) branch on
    the CPU: the weight-only experts' grouped W4A16 / W8A16 kernel runs (interpreted) where a
    GPU would run it. The list returned counts the traces of that kernel's call."""
    import jax

    from jaxvllm import quantization

    calls, kernel = [], quantization._grouped_weight_only_pallas
    monkeypatch.setattr(jax.lax, "platform_dependent", lambda *args, default, **branches: default(*args))
    monkeypatch.setattr(quantization, "_grouped_weight_only_pallas",
                        lambda *args, **kwargs: calls.append(1) or kernel(*args, **kwargs))
    return calls


@pytest.mark.parametrize("bits,group,zero,dtype", [(4, 16, True, jnp.float32), (4, 32, False, jnp.float32),
                                                   (4, 0, True, jnp.float32), (8, 16, True, jnp.float32),
                                                   (4, 32, True, jnp.bfloat16)])
def test_weight_only_experts_through_the_grouped_kernel(bits, group, zero, dtype, monkeypatch):
    """`grouped_experts` on the Pallas backend: weight-only stacks through a GPU's grouped
    kernel (interpreted; int4 packed two a byte, int8 as they are) as through the CPU's
    float stacks (`experts_dequantized`, then the float grouped matmul); a stack with a
    partial last group keeps the float path there too."""
    from jaxvllm.models.moe import grouped_experts

    rng = np.random.default_rng(bits + group)
    half = 2 ** (bits - 1)

    def stack(n_in, out, size):
        groups = -(-n_in // size) if size else 1
        return QuantizedWeight(jnp.asarray(rng.integers(-half, half, (4, n_in, out)), jnp.int4 if bits == 4 else
                                           jnp.int8), jnp.asarray(rng.uniform(0.01, 0.1, (4, groups, out)) /
                                                                  2 ** (bits - 4), jnp.float32), size,
                               jnp.asarray(rng.integers(-half, half, (4, groups, out)), jnp.float32) if zero else None,
                               weight_only=bits == 8)

    layer = {"experts_gate": stack(64, 32, group), "experts_up": stack(64, 32, group),
             "experts_down": stack(32, 64, group)}
    rows, sizes = jnp.asarray(rng.standard_normal((23, 64)), dtype), jnp.asarray([5, 0, 9, 6], jnp.int32)
    dense = {name: experts_dequantized(w, dtype) for name, w in layer.items()}
    want = grouped_experts(rows, sizes, dense, "pallas")
    partial_group = dict(layer, experts_down=stack(32, 64, 24))  # groups of 24, 8: the float path
    want_partial = grouped_experts(rows, sizes, {**dense, "experts_down": experts_dequantized(
        partial_group["experts_down"], dtype)}, "pallas")
    calls = gpu_branches(monkeypatch)
    got = grouped_experts(rows, sizes, layer, "pallas")
    assert len(calls) == 3 and got.dtype == dtype
    tol = dict(rtol=1e-5, atol=1e-4) if dtype == jnp.float32 else dict(rtol=2e-2, atol=2e-2)  # (outputs to ~20)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), **tol)
    got = grouped_experts(rows, sizes, partial_group, "pallas")
    assert len(calls) == 5  # gate and up only
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want_partial, np.float32), **tol)


def test_weight_only_experts_kernel_through_the_engine(int4_checkpoint, monkeypatch):
    """The engine (Pallas backend) on a 4-bit GPTQ mixture of experts with zero points
    (groups of 16): a GPU's path, the grouped W4A16 kernel on the stored int4 stacks
    (interpreted), gives the tokens and log-probabilities of the CPU's, the float stacks."""
    path = str(int4_checkpoint("gptq-asym", "qwen3_moe", 16))
    prompts = [{"prompt_token_ids": np.random.default_rng(seed).integers(3, 200, 12).tolist()} for seed in range(3)]

    def generate():
        llm = LLM(path, attention_backend="pallas", **ENGINE)
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, logprobs=1), use_tqdm=False)
        llm.shutdown()
        return [o.outputs[0].token_ids for o in outs], [o.outputs[0].cumulative_logprob for o in outs]

    cpu = generate()
    calls = gpu_branches(monkeypatch)
    gpu = generate()
    assert calls  # (the kernel's call traced: each layer's three projections)
    assert gpu[0] == cpu[0]
    np.testing.assert_allclose(gpu[1], cpu[1], rtol=1e-4, atol=1e-4)

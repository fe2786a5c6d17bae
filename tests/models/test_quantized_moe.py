"""Quantized expert stacks (Qwen3-MoE, Mixtral): online fp8 and 8-bit checkpoints through
the grouped matmul (W8A8: `jaxvllm.quantization.quantized_grouped_matmul`), against HF
transformers (float32, CPU) whose attention Linears and experts compute the same product
in torch: weights as the format rounds them, each input rounded to fp8 per token (and
block). Also tensor and expert parallelism, and the refusals."""

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
from jaxvllm.quantization import QuantizedWeight
from tests.models.paged import Chunk, build_inputs, hf_logits, jit_forward, rel_err
from tests.models.test_quantization import block_dequantized, fp8_round, near_ties, tie_free_tokens, w8a8_oracle

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
    """The full-precision HF model of `src` holding `path`'s block-fp8 weights, dequantized
    from the format's definition (each `weight_scale_inv` over its block), experts included."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).eval()
    tensors = load_file(str(path / "model.safetensors"))
    block = json.loads((path / "config.json").read_text())["quantization_config"]["weight_block_size"]
    dequantized = partial(block_dequantized, tensors, block=block)
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


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_block_fp8_experts_match_the_oracle(arch, tiny_checkpoint, tmp_path):
    """An HF block-fp8 checkpoint whose experts are block-fp8 too (as Qwen3-30B-A3B-FP8
    ships), blocks of 16: activations per token and block through the grouped matmul."""
    from weights.make_quantized import make_fp8

    src = tiny_checkpoint(arch)
    path = make_fp8(src, tmp_path / "fp8", BLOCK)
    hf = w8a8_experts(w8a8_oracle(block_fp8_hf(path, src), group=BLOCK[1], round_weights=False), group=BLOCK[1],
                      round_weights=False)
    cfg, params = load_model(path)
    experts = params["layers"]["experts_down"][0]
    groups = cfg.moe_intermediate_size // BLOCK[1]  # (the down projection's inputs)
    assert experts.group_size == BLOCK[1] and experts.scale.shape == (cfg.num_experts, groups, cfg.hidden_size)
    tokens = tie_free_tokens(hf, 24)
    assert rel_err(_logits(params, cfg, tokens, "reference"), hf_logits(hf, tokens)) <= TOL


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
    inputs) and by whole experts; block scales that the split would cut are refused."""
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
        for split in ("2 False", "2 True"):
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
    prompts = [{"prompt_token_ids": list(range(10, 10 + n))} for n in (20, 3, 6, 1)]
    before = compile_counter.count
    out = fp8.generate(prompts, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert compile_counter.count == before
    assert all(len(o.outputs[0].token_ids) == 8 for o in out)
    assert fp8.llm_engine.stats()["weight_bytes_per_device"][0] < full.llm_engine.stats()["weight_bytes_per_device"][0]
    full.shutdown()
    fp8.shutdown()


def test_quantized_experts_refusals(tiny_checkpoint, tmp_path):
    """4-bit expert stacks are refused before any weight loads."""
    from weights.make_quantized import make_gptq

    src = tiny_checkpoint("qwen3_moe")
    with pytest.raises(ValueError, match=r"Qwen3MoeForCausalLM: 4-bit expert stacks are not supported yet"):
        LLM(src, quantization="gptq-dummy", **ENGINE)
    with pytest.raises(ValueError, match=r"4-bit expert stacks are not supported yet"):
        LLM(make_gptq(src, tmp_path / "gptq", 32), **ENGINE)

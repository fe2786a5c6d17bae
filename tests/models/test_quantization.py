"""Online fp8 (`quantization="fp8"`, jaxvllm/quantization.py) against its oracle: HF
transformers (float32, CPU) whose decoder Linear layers compute the same W8A8 product
in torch: each weight rounded to fp8 per output row, each input to fp8 per token.
Also: what stays full precision, the quantized layout under stacking and tensor
parallelism, the weight bytes in `stats()`, and the refusals."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxvllm import LLM, SamplingParams, load_model
from jaxvllm.kv_cache import allocate_kv_caches
from jaxvllm.quantization import QuantizedWeight, quantize_fp8
from tests.models.paged import Chunk, build_inputs, hf_greedy, hf_logits, jit_forward, random_tokens, rel_err

ROOT = Path(__file__).resolve().parents[2]
FP8_MAX = 448.0
TOL = 1e-4  # the same products as the oracle's, summed in another order
ENGINE = dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64, token_buckets=[64])
QUANTIZED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def fp8_round(x: torch.Tensor, dim: int) -> torch.Tensor:
    """x rounded to fp8 with one scale per slice along `dim` (its largest magnitude to 448;
    scaled by multiplying, as jaxvllm does: XLA may turn a division into one)."""
    amax = x.abs().amax(dim=dim, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny)
    return (x * (FP8_MAX / amax)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).to(torch.float32) * (amax / FP8_MAX)


def w8a8_oracle(model):
    """`model` (HF, float32) with every decoder Linear computing online fp8's W8A8 product.
    `model.near_ties` counts the inputs within 3e-6 (relative) of a point where fp8's
    rounding jumps: float32's last-bit differences from another implementation move those
    by a whole fp8 step (6-12%), so an exact comparison takes inputs without any."""
    model.near_ties = 0

    def quantize_input(_, args):
        x = args[0]
        scaled = x * (FP8_MAX / x.abs().amax(dim=-1, keepdim=True))
        up, down = [(scaled * f).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn) for f in (1 + 3e-6, 1 - 3e-6)]
        model.near_ties += int((up.float() != down.float()).sum())
        return (fp8_round(x, dim=-1),)

    for name, module in model.model.layers.named_modules():
        if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in QUANTIZED:
            with torch.no_grad():
                module.weight.copy_(fp8_round(module.weight, dim=1))
            module.register_forward_pre_hook(quantize_input)
    return model


def tie_free_tokens(hf, n: int) -> list[int]:
    """Random tokens whose W8A8 run in the oracle has no input near an fp8 rounding jump."""
    for seed in range(20):
        tokens = random_tokens(np.random.default_rng(seed), n)
        hf.near_ties = 0
        hf_logits(hf, tokens)
        if hf.near_ties == 0:
            return tokens
    raise AssertionError("no tie-free prompt in 20 seeds")


@pytest.fixture(scope="module")
def oracle(tiny_checkpoint):
    """oracle(arch) -> (path, HF W8A8 model); loaded once per architecture."""
    from transformers import AutoModelForCausalLM

    made = {}

    def get(arch: str):
        if arch not in made:
            path = tiny_checkpoint(arch)
            hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
            made[arch] = path, w8a8_oracle(hf)
        return made[arch]

    return get


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3"])
@pytest.mark.parametrize("stack", [False, True], ids=["per-layer", "stacked"])
def test_fp8_logits_match_the_w8a8_oracle(arch, stack, oracle):
    """Both layouts (a CPU's per-layer merged q/k/v and gate/up, a GPU's stacks) against
    HF's W8A8 model; and the quantization matters (the unquantized model is farther)."""
    path, hf = oracle(arch)
    cfg, params = load_model(path, quantization="fp8", stack_layers=stack)
    _, full = load_model(path, stack_layers=stack)
    layers = params["layers"]
    quantized = [name for name, value in layers.items()
                 if isinstance(value if stack else value[0], QuantizedWeight)]
    assert sorted(quantized) == sorted(["o_proj", "down_proj"] + (["q_proj", "k_proj", "v_proj", "gate_proj",
                                                                  "up_proj"] if stack else ["qkv_proj", "gate_up_proj"]))
    assert not isinstance(params["embed"], QuantizedWeight)  # embeddings, norms, biases, lm_head: as loaded
    tokens = tie_free_tokens(hf, 24)
    inputs = build_inputs([Chunk(tokens, 0, list(range(8)))], 4, all_logits=True)
    logits, _ = jit_forward(params, allocate_kv_caches(cfg, 8, 4, jnp.float32), inputs, cfg, "reference")
    unquantized, _ = jit_forward(full, allocate_kv_caches(cfg, 8, 4, jnp.float32), inputs, cfg, "reference")
    want = hf_logits(hf, tokens)
    err, full_err = rel_err(logits, want), rel_err(unquantized, want)
    print(f"{arch} stacked={stack}: fp8 rel err {err:.2e} (full precision against the oracle: {full_err:.2e})")
    assert err <= TOL < full_err, (err, full_err)


def test_fp8_greedy_matches_the_oracle_through_the_engine(oracle):
    path, hf = oracle("llama")
    prompts = [random_tokens(np.random.default_rng(seed), n) for seed, n in [(1, 5), (2, 17), (3, 40)]]
    llm = LLM(path, quantization="fp8", **ENGINE)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=8),
                        use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == hf_greedy(hf, prompts, 8)
    stats = llm.llm_engine.stats()
    full = LLM(path, **ENGINE)
    fp8_bytes, full_bytes = stats["weight_bytes_per_device"][0], full.llm_engine.stats()["weight_bytes_per_device"][0]
    cfg = llm.llm_engine.runner.cfg
    linear = cfg.num_layers * (cfg.hidden_size * (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
                               + cfg.hidden_size * cfg.num_heads * cfg.head_dim + 3 * cfg.hidden_size * cfg.intermediate_size)
    assert stats["quantization"] == "fp8"
    assert full_bytes - fp8_bytes == 3 * linear - 4 * (cfg.num_layers * (
        (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim + 2 * cfg.hidden_size + 2 * cfg.intermediate_size))
    llm.shutdown()
    full.shutdown()


_TP_SCRIPT = """
import json, sys
import numpy as np
from jaxvllm import LLM, SamplingParams
from jaxvllm.quantization import QuantizedWeight
ENGINE = dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64, token_buckets=[64])
prompts = [{"prompt_token_ids": np.random.default_rng(seed).integers(3, 200, 12).tolist()} for seed in range(3)]
out = {}
for tp in (1, 2):
    llm = LLM(sys.argv[1], quantization="fp8", tensor_parallel_size=tp, **ENGINE)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
    layers = llm.llm_engine.runner.params["layers"]
    shards = {name: [sorted({tuple(s.data.shape) for s in a.addressable_shards}) for a in (w.value, w.scale)]
              for name, ws in layers.items() for w in ws[:1] if isinstance(w, QuantizedWeight)}
    out[tp] = dict(tokens=[o.outputs[0].token_ids for o in outs], shards=shards,
                   bytes=llm.llm_engine.stats()["weight_bytes_per_device"])
    llm.shutdown()
print(json.dumps(out))
"""


def test_fp8_under_tensor_parallelism(tiny_checkpoint):
    """2 CPU devices (a process of its own): values split as the weights are, scales split
    with the output axes and whole where the input axis is split; one device's tokens."""
    path = tiny_checkpoint("llama")
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", _TP_SCRIPT, str(path)], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    one, two = json.loads(proc.stdout.strip().splitlines()[-1]).values()
    assert two["tokens"] == one["tokens"]
    (value1, scale1), (value2, scale2) = one["shards"]["o_proj"], two["shards"]["o_proj"]  # [hidden, heads, head_dim]
    assert value2[0][1] * 2 == value1[0][1] and scale2 == scale1  # split on heads (input): scales whole
    (value1, scale1), (value2, scale2) = one["shards"]["qkv_proj"], two["shards"]["qkv_proj"]  # [kv_heads, ...]
    assert value2[0][0] * 2 == value1[0][0] and scale2[0][0] * 2 == scale1[0][0]  # split on KV heads: both
    assert len(two["bytes"]) == 2 and sum(two["bytes"]) > one["bytes"][0]  # (norms and o/down scales: on both)


def test_quantize_fp8_scales_each_output_row():
    w = jnp.asarray(np.random.default_rng(0).normal(size=(3, 4, 10)), jnp.float32).at[0, 0].mul(100)
    q = quantize_fp8(w, 2)  # two input axes: one scale per row of the first
    assert q.value.dtype == jnp.float8_e4m3fn and q.scale.shape == (3, 1)
    assert np.allclose(np.abs(np.asarray(q.value, np.float32)).max(axis=(1, 2)), FP8_MAX)
    assert np.abs(np.asarray(q.dequantized()) - np.asarray(w)).max() <= np.abs(np.asarray(w)).max() / 16


def test_bad_quantization_is_refused(tiny_checkpoint, tmp_path):
    path = tiny_checkpoint("llama")
    with pytest.raises(ValueError, match=r"quantization='int3' is not supported by jaxvllm; choose from None, 'fp8'"):
        LLM(path, quantization="int3", **ENGINE)
    quantized = tmp_path / "fp8-checkpoint"
    shutil.copytree(path, quantized)
    config = json.loads((quantized / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (quantized / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"is quantized \(quant_method 'fp8' in config.json\).*does not read quantized"):
        LLM(quantized, **ENGINE)
    with pytest.raises(ValueError, match="quant_method 'fp8'"):
        LLM(quantized, quantization="fp8", **ENGINE)
    with pytest.raises(ValueError, match="expert stacks cannot be quantized yet"):
        LLM(tiny_checkpoint("qwen3_moe"), quantization="fp8", **ENGINE)

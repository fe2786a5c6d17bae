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
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxvllm import LLM, SamplingParams, load_model
from jaxvllm.kv_cache import allocate_kv_caches
from jaxvllm.layers import linear
from jaxvllm.quantization import QuantizedWeight, online_method, quantize_fp8
from tests.models.paged import Chunk, build_inputs, hf_greedy, hf_logits, jit_forward, random_tokens, rel_err

ROOT = Path(__file__).resolve().parents[2]
FP8_MAX = 448.0
TOL = 1e-4  # the same products as the oracle's, summed in another order
ENGINE = dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64, token_buckets=[64])
QUANTIZED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def fp8_round(x: torch.Tensor, dim: int, group: int = 0) -> torch.Tensor:
    """x rounded to fp8 with one scale per slice along `dim`, or per `group` elements of it
    (the last group may be partial): its largest magnitude to 448, scaled by multiplying as
    jaxvllm does (XLA may turn a division into one)."""
    return _grouped(x, dim, group, lambda g: _round(g)[0])


def near_ties(x: torch.Tensor, group: int = 0) -> int:
    """How many of x's elements lie within 3e-6 (relative) of a point where their fp8
    rounding jumps (per token and group, as `fp8_round` of the last axis)."""
    return int(_grouped(x, -1, group, lambda g: _round(g)[1]).sum())


def _round(g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    amax = g.abs().amax(dim=-1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny)
    scaled = g * (FP8_MAX / amax)
    fp8 = lambda v: v.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).to(torch.float32)  # noqa: E731
    return fp8(scaled) * (amax / FP8_MAX), (fp8(scaled * (1 + 3e-6)) != fp8(scaled * (1 - 3e-6))).float()


def _grouped(x: torch.Tensor, dim: int, group: int, fn) -> torch.Tensor:
    x = x.movedim(dim, -1)
    n = x.shape[-1]
    size = group or n
    padded = torch.nn.functional.pad(x, (0, -n % size))
    out = fn(padded.reshape(*x.shape[:-1], -1, size)).reshape(padded.shape)[..., :n]
    return out.movedim(-1, dim)


def w8a8_oracle(model, group: int = 0, round_weights: bool = True, full_precision: tuple[str, ...] = ()):
    """`model` (HF, float32) with every decoder Linear computing fp8's W8A8 product: its
    weight rounded to fp8 per output row (`round_weights`; a checkpoint's fp8 weights come
    rounded already) and each input per token (and `group` inputs); the Linears named in
    `full_precision` (a checkpoint's modules_to_not_convert) stay as they are. `model.near_ties`
    counts the inputs near an fp8 rounding jump (`near_ties`): float32's last-bit
    differences from another implementation move those by a whole fp8 step (6-12%), so
    an exact comparison takes inputs without any."""
    model.near_ties = 0

    def quantize_input(_, args):
        model.near_ties += near_ties(args[0], group)
        return (fp8_round(args[0], -1, group),)

    for name, module in model.model.layers.named_modules():
        if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in set(QUANTIZED) - set(full_precision):
            if round_weights:
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
for path, quantization in ((sys.argv[1], "fp8"), (sys.argv[2], None)):  # online; a block-fp8 checkpoint
    for tp in (1, 2):
        llm = LLM(path, quantization=quantization, tensor_parallel_size=tp, **ENGINE)
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
        layers = llm.llm_engine.runner.params["layers"]
        shards = {name: [sorted({tuple(s.data.shape) for s in a.addressable_shards}) for a in (w.value, w.scale)]
                  for name, ws in layers.items() for w in ws[:1] if isinstance(w, QuantizedWeight)}
        out[f"{quantization or 'checkpoint'} {tp}"] = dict(
            tokens=[o.outputs[0].token_ids for o in outs], shards=shards,
            bytes=llm.llm_engine.stats()["weight_bytes_per_device"])
        llm.shutdown()
print(json.dumps(out))
"""


def test_fp8_under_tensor_parallelism(tiny_checkpoint, fp8_checkpoint):
    """2 CPU devices (a process of its own), online fp8 and a block-fp8 checkpoint: values
    split as the weights are, online scales split with the output axes and whole where the
    input axis is split; one device's tokens."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", _TP_SCRIPT, str(tiny_checkpoint("llama")),
                           str(fp8_checkpoint("llama", (32, 32)))], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for kind in ("fp8", "checkpoint"):
        one, two = out[f"{kind} 1"], out[f"{kind} 2"]
        assert two["tokens"] == one["tokens"]
        # o_proj [hidden, heads, head_dim], split on heads (its input); qkv_proj [kv_heads, ...], on KV heads
        assert two["shards"]["o_proj"][0][0][1] * 2 == one["shards"]["o_proj"][0][0][1]
        assert two["shards"]["qkv_proj"][0][0][0] * 2 == one["shards"]["qkv_proj"][0][0][0]
        assert len(two["bytes"]) == 2 and sum(two["bytes"]) > one["bytes"][0]  # (norms, some scales: on both)
    (_, scale1), (_, scale2) = out["fp8 1"]["shards"]["o_proj"], out["fp8 2"]["shards"]["o_proj"]
    assert scale2 == scale1  # whole on each device
    (_, scale1), (_, scale2) = out["fp8 1"]["shards"]["qkv_proj"], out["fp8 2"]["shards"]["qkv_proj"]
    assert scale2[0][0] * 2 == scale1[0][0]  # split with the KV heads


# -- quantized checkpoints (weights/make_quantized.py) ---------------------------------------------


@pytest.fixture(scope="module")
def fp8_checkpoint(tiny_checkpoint, tmp_path_factory):
    """fp8_checkpoint(arch, block, ignore=()) -> a tiny checkpoint in HF's block fp8."""
    from weights.make_quantized import make_fp8

    made = {}

    def get(arch: str, block: tuple[int, int], ignore: tuple[str, ...] = ()):
        key = (arch, block, ignore)
        if key not in made:
            made[key] = make_fp8(tiny_checkpoint(arch), tmp_path_factory.mktemp(f"fp8-{arch}"), block, ignore)
        return made[key]

    return get


def dequantized_hf(fp8_path: Path, src: Path):
    """The oracle where transformers cannot read a checkpoint (blocks that do not divide a
    weight's input axis): the full-precision model with each fp8 weight dequantized here
    from the format's definition (each `weight_scale_inv` over its block)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).eval()
    tensors = load_file(str(fp8_path / "model.safetensors"))
    block = fp8_block(fp8_path)
    state = hf.state_dict()
    with torch.no_grad():
        for name, value in tensors.items():
            if value.dtype == torch.float8_e4m3fn:
                state[name].copy_(block_dequantized(tensors, name, block))
    return hf


def fp8_block(path: Path) -> list[int]:
    """The (rows, inputs) block of a block-fp8 checkpoint, HF's or compressed-tensors'."""
    config = json.loads((path / "config.json").read_text())["quantization_config"]
    if config["quant_method"] == "fp8":
        return config["weight_block_size"]
    return config["config_groups"]["group_0"]["weights"]["block_structure"]


def block_dequantized(tensors: dict, name: str, block) -> torch.Tensor:
    """Weight `name` of a block-fp8 checkpoint's `tensors`: its values times each scale
    (HF's `weight_scale_inv`, compressed-tensors' `weight_scale`) over its block (the last
    block of an axis may be partial)."""
    value = tensors[name].float()
    scale = tensors[f"{name}_scale_inv" if f"{name}_scale_inv" in tensors else f"{name}_scale"].float()
    scale = scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    return value * scale[: value.shape[0], : value.shape[1]]


@pytest.mark.parametrize("arch, block", [("llama", (32, 32)), ("qwen2", (32, 32)), ("qwen3", (16, 32)),
                                         ("gemma3", (128, 128))])
@pytest.mark.parametrize("stack", [False, True], ids=["per-layer", "stacked"])
def test_fp8_checkpoint_matches_transformers(arch, block, stack, fp8_checkpoint):
    """HF's fp8 format (transformers' FineGrainedFP8) against transformers reading it (on a
    CPU it dequantizes) with each Linear's input rounded per token and block of inputs, as
    the format's dynamic activations are: blocks of 32 (several per weight), and of 128 over
    the tiny model's 64 (one partial block)."""
    from transformers import AutoModelForCausalLM

    path = fp8_checkpoint(arch, block)
    hf = w8a8_oracle(AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval(), group=block[1],
                     round_weights=False)
    cfg, params = load_model(path, stack_layers=stack)
    assert all(isinstance(w if stack else w[0], QuantizedWeight) and (w if stack else w[0]).group_size == block[1]
               for name, w in params["layers"].items() if name.endswith("proj"))
    tokens = tie_free_tokens(hf, 24)
    inputs = build_inputs([Chunk(tokens, 0, list(range(8)))], 4, all_logits=True)
    logits, _ = jit_forward(params, allocate_kv_caches(cfg, 8, 4, jnp.float32), inputs, cfg, "reference")
    assert rel_err(logits, hf_logits(hf, tokens)) <= TOL


@pytest.mark.parametrize("arch, block", [("qwen2", (16, 48)), ("llama", (24, 40))])
def test_fp8_checkpoint_with_partial_blocks(arch, block, fp8_checkpoint, tiny_checkpoint):
    """Blocks that do not divide a weight (SmolLM2's 576 is 4.5 blocks of 128; here 64 and
    128 inputs in blocks of 48 or 40, rows in blocks of 24), which transformers' fp8 reader
    refuses: against the format's definition, dequantized in torch."""
    path = fp8_checkpoint(arch, block)
    hf = w8a8_oracle(dequantized_hf(path, tiny_checkpoint(arch)), group=block[1], round_weights=False)
    cfg, params = load_model(path)
    tokens = tie_free_tokens(hf, 24)
    inputs = build_inputs([Chunk(tokens, 0, list(range(8)))], 4, all_logits=True)
    logits, _ = jit_forward(params, allocate_kv_caches(cfg, 8, 4, jnp.float32), inputs, cfg, "reference")
    assert rel_err(logits, hf_logits(hf, tokens)) <= TOL


def test_fp8_checkpoint_through_the_engine(fp8_checkpoint, tiny_checkpoint):
    """Greedy tokens as the oracle's; modules_to_not_convert stays full precision; the
    weights' bytes and the format in `stats()`."""
    from transformers import AutoModelForCausalLM

    path = fp8_checkpoint("llama", (32, 32), ignore=("down_proj",))
    hf = w8a8_oracle(AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval(), group=32,
                     round_weights=False, full_precision=("down_proj",))
    prompts = [random_tokens(np.random.default_rng(seed), n) for seed, n in [(1, 5), (2, 17), (3, 40)]]
    llm = LLM(path, **ENGINE)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=8),
                        use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == hf_greedy(hf, prompts, 8)
    layers = llm.llm_engine.runner.params["layers"]
    assert not isinstance(layers["down_proj"][0], QuantizedWeight) and isinstance(layers["o_proj"][0], QuantizedWeight)
    stats = llm.llm_engine.stats()
    assert stats["quantization"] == "fp8 (checkpoint)"
    llm.shutdown()
    full = LLM(tiny_checkpoint("llama"), **ENGINE)
    assert stats["weight_bytes_per_device"][0] < full.llm_engine.stats()["weight_bytes_per_device"][0]
    full.shutdown()


def test_ignore_entries_match_as_their_writers_and_vllm_match_them():
    """"re:" entries match from the module name's start (re.match), as compressed-tensors' and
    vLLM's do; otherwise compressed-tensors' name a module exactly (a bare "down_proj" names
    none: llm-compressor quantized those), transformers' fp8 ones a module, one above it or
    its last parts. GPTQ's and AWQ's modules are full precision where stored so, whatever
    modules_to_not_convert says."""
    from jaxvllm.quantization import CheckpointFormat

    fmt = CheckpointFormat("compressed-tensors", (1, 0), ignore=("lm_head", "re:.*self_attn", "re:model.layers.1.",
                                                                 "down_proj"))
    assert fmt.ignores("model.layers.0.self_attn.q_proj.weight") and fmt.ignores("lm_head.weight")
    assert fmt.ignores("model.layers.1.mlp.down_proj.weight")
    assert not fmt.ignores("model.layers.0.mlp.down_proj.weight")
    fp8 = CheckpointFormat("fp8", (32, 32), ignore=("down_proj", "model.layers.1"))
    assert fp8.ignores("model.layers.0.mlp.down_proj.weight") and fp8.ignores("model.layers.1.mlp.up_proj.weight")
    assert not fp8.ignores("model.layers.0.mlp.up_proj.weight")
    # GPTQ / AWQ: the module stored unquantized, by its exact name (not `mlp.gate_proj` for the router
    # `mlp.gate`); the list means nothing
    stored = CheckpointFormat("awq", (1, 32), ignore=("gate",), value_name="qweight",
                              unquantized=frozenset({"model.layers.0.mlp.gate"}))
    assert stored.ignores("model.layers.0.mlp.gate.weight") and not stored.ignores("model.layers.0.mlp.gate_proj.weight")


def test_quantize_fp8_scales_each_output_row():
    w = jnp.asarray(np.random.default_rng(0).normal(size=(3, 4, 10)), jnp.float32).at[0, 0].mul(100)
    q = quantize_fp8(w, 2)  # two input axes: one scale per row of the first
    assert q.value.dtype == jnp.float8_e4m3fn and q.scale.shape == (3, 1)
    assert np.allclose(np.abs(np.asarray(q.value, np.float32)).max(axis=(1, 2)), FP8_MAX)
    assert np.abs(np.asarray(q.dequantized()) - np.asarray(w)).max() <= np.abs(np.asarray(w)).max() / 16


@pytest.fixture(scope="module")
def compressed_checkpoint(tiny_checkpoint, tmp_path_factory):
    """compressed_checkpoint(arch, kind, block=(32, 32)) -> a tiny checkpoint as llm-compressor
    writes FP8_DYNAMIC ("fp8"), W8A8 int8 ("int8"), FP8 ("fp8-static") or FP8_BLOCK
    ("fp8-block", its blocks `block`) in the compressed-tensors format."""
    from weights.make_quantized import make_compressed

    made = {}

    def get(arch: str, kind: str, block: tuple[int, int] = (32, 32)):
        key = (arch, kind, block if kind == "fp8-block" else None)
        if key not in made:
            made[key] = make_compressed(tiny_checkpoint(arch), tmp_path_factory.mktemp(f"ct-{arch}"), kind, block)
        return made[key]

    return get


def compressed_tensors_hf(path: Path, group: int = 0):
    """transformers with the compressed-tensors library reading `path` (the issue's first
    oracle): its Linears compute the format's W8A8 product themselves. `near_ties` counts,
    as `w8a8_oracle`'s, the fp8 inputs near a rounding jump (per token, or per token and
    `group` inputs)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    hf.near_ties = 0

    def count(_, args):
        hf.near_ties += near_ties(args[0], group)

    for name, module in hf.model.layers.named_modules():
        if name.rsplit(".", 1)[-1] in QUANTIZED:
            module.register_forward_pre_hook(count)
    hf_logits(hf, [1, 2, 3])  # (the first forward decompresses the weights for the modules' own forward)
    return hf


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_compressed_tensors_fp8_matches_the_library(arch, compressed_checkpoint):
    """compressed-tensors float-quantized (weights per channel, activations dynamic per
    token) against transformers + compressed-tensors, on a prompt with no fp8 input near a
    rounding jump."""
    pytest.importorskip("compressed_tensors")
    path = compressed_checkpoint(arch, "fp8")
    hf = compressed_tensors_hf(path)
    cfg, params = load_model(path)
    assert all(w[0].value.dtype == jnp.float8_e4m3fn and w[0].group_size == 0
               for name, w in params["layers"].items() if name.endswith("proj"))
    tokens = tie_free_tokens(hf, 24)
    inputs = build_inputs([Chunk(tokens, 0, list(range(8)))], 4, all_logits=True)
    logits, _ = jit_forward(params, allocate_kv_caches(cfg, 8, 4, jnp.float32), inputs, cfg, "reference")
    assert rel_err(logits, hf_logits(hf, tokens)) <= TOL


@pytest.mark.parametrize("arch, stack", [("llama", False), ("qwen3", True)])
def test_compressed_tensors_fp8_block_matches_the_library(arch, stack, compressed_checkpoint):
    """compressed-tensors FP8_BLOCK (weights per block of 32 x 32, activations dynamic per
    token and group of 32) against transformers + compressed-tensors, both layouts."""
    pytest.importorskip("compressed_tensors")
    path = compressed_checkpoint(arch, "fp8-block")
    hf = compressed_tensors_hf(path, group=32)
    cfg, params = load_model(path, stack_layers=stack)
    assert all(isinstance(w if stack else w[0], QuantizedWeight) and (w if stack else w[0]).group_size == 32
               for name, w in params["layers"].items() if name.endswith("proj"))
    tokens = tie_free_tokens(hf, 24)
    inputs = build_inputs([Chunk(tokens, 0, list(range(8)))], 4, all_logits=True)
    logits, _ = jit_forward(params, allocate_kv_caches(cfg, 8, 4, jnp.float32), inputs, cfg, "reference")
    assert rel_err(logits, hf_logits(hf, tokens)) <= TOL


@pytest.mark.parametrize("block", [(128, 128), (24, 40)])
def test_compressed_tensors_fp8_partial_blocks_through_the_engine(block, compressed_checkpoint, tiny_checkpoint):
    """FP8_BLOCK's own 128 x 128 blocks over the tiny model's 64 and 128 (partial), and
    blocks of 24 x 40, which the library's activation groups refuse: against the format's
    definition dequantized in torch, greedy tokens through the engine."""
    path = compressed_checkpoint("qwen2", "fp8-block", block)
    hf = w8a8_oracle(dequantized_hf(path, tiny_checkpoint("qwen2")), group=block[1], round_weights=False)
    assert_engine_greedy_is_the_oracles(path, hf)


def assert_engine_greedy_is_the_oracles(path: Path, hf) -> None:
    """`path` through the engine: greedy tokens of two tie-free prompts as the oracle `hf`'s."""
    prompts = [tie_free_tokens(hf, n) for n in (5, 17)]
    with LLM(path, **ENGINE) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=8),
                            use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == hf_greedy(hf, prompts, 8)


# llm-compressor's mixed precision: each config group its own scheme and format
MIXED = {"fp8 attention, w4a16 mlp": {r".*self_attn": ("fp8",), r".*mlp": ("w4a16", 32, True)},
         "fp8-block, w8a16 down": {r".*mlp\.down_proj": ("w8a16", 32, True),
                                   r".*(self_attn|mlp\.(gate|up)_proj)": ("fp8-block", (32, 32))}}


@pytest.fixture(scope="module")
def mixed_checkpoint(tiny_checkpoint, tmp_path_factory):
    """mixed_checkpoint(name) -> the tiny Llama in `MIXED[name]`'s schemes."""
    from weights.make_quantized import make_mixed

    made = {}

    def get(name: str):
        if name not in made:
            made[name] = make_mixed(tiny_checkpoint("llama"), tmp_path_factory.mktemp("mixed"), MIXED[name])
        return made[name]

    return get


@pytest.mark.parametrize("name", list(MIXED))
@pytest.mark.parametrize("stack", [False, True], ids=["per-layer", "stacked"])
def test_compressed_tensors_mixed_precision_matches_the_library(name, stack, mixed_checkpoint):
    """Config groups of different schemes, each module read in its group's (vLLM's matching:
    the first target naming it): against transformers + compressed-tensors, both layouts."""
    pytest.importorskip("compressed_tensors")
    path = mixed_checkpoint(name)
    hf = compressed_tensors_hf(path)
    cfg, params = load_model(path, stack_layers=stack)
    kinds = {n: ((w if stack else w[0]).value.dtype, (w if stack else w[0]).weight_only)
             for n, w in params["layers"].items() if n.endswith("proj")}
    attention = (jnp.float8_e4m3fn, False)
    mlp = (jnp.int4, False) if "w4a16" in name else (jnp.float8_e4m3fn, False)
    down = (jnp.int8, True) if "w8a16" in name else mlp
    assert kinds == {"o_proj": attention, "down_proj": down,
                     **({"q_proj": attention, "k_proj": attention, "v_proj": attention, "gate_proj": mlp,
                         "up_proj": mlp} if stack else {"qkv_proj": attention, "gate_up_proj": mlp})}
    tokens = tie_free_tokens(hf, 24)
    inputs = build_inputs([Chunk(tokens, 0, list(range(8)))], 4, all_logits=True)
    logits, _ = jit_forward(params, allocate_kv_caches(cfg, 8, 4, jnp.float32), inputs, cfg, "reference")
    assert rel_err(logits, hf_logits(hf, tokens)) <= TOL


def test_compressed_tensors_mixed_precision_through_the_engine(mixed_checkpoint, tiny_checkpoint, tmp_path):
    """Greedy tokens as the library's; a module no group targets (and not ignored) is refused
    with vLLM's words, a weight whose layers differ in scheme by name, and a group without
    its format."""
    from weights.make_quantized import make_mixed

    path = mixed_checkpoint("fp8 attention, w4a16 mlp")
    assert_engine_greedy_is_the_oracles(path, compressed_tensors_hf(path))
    for i, (schemes, match) in enumerate([
            ({r".*self_attn": ("fp8",), r".*mlp\.(gate|up)_proj": ("w4a16", 32, True)},
             r"Unable to find matching target for model.layers.0.mlp.down_proj in the compressed-tensors config"),
            ({r"model\.layers\.0\.": ("fp8",), r"model\.layers\.1\.": ("int8",)},
             r"the checkpoint stores model.layers.0.self_attn.q_proj.weight and model.layers.1.self_attn.q_proj.weight "
             r"in different quantization schemes")]):
        live = len(jax.live_arrays())
        with pytest.raises(ValueError, match=match) as caught:
            LLM(make_mixed(tiny_checkpoint("llama"), tmp_path / str(i), schemes), **ENGINE)
        assert len(jax.live_arrays()) == live, caught.value
    groups = json.loads((path / "config.json").read_text())["quantization_config"]["config_groups"]
    del groups["group_1"]["format"]
    with pytest.raises(ValueError, match=r"a compressed-tensors config group without its own format in a "
                                         r"mixed-precision checkpoint \(targets \['re:\.\*mlp'\]\)"):
        LLM(_with_config(path, tmp_path / "no-format", config_groups=groups), **ENGINE)


def static_ties(x: torch.Tensor, scale: torch.Tensor) -> int:
    """How many of x / scale (a static activation scale) lie within 3e-6 (relative) of a
    point where their fp8 rounding jumps."""
    scaled = x.float() / scale.float()
    fp8 = lambda v: v.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).to(torch.float32)  # noqa: E731
    return int((fp8(scaled * (1 + 3e-6)) != fp8(scaled * (1 - 3e-6))).sum())


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("stack", [False, True], ids=["per-layer", "stacked"])
def test_compressed_tensors_fp8_static_matches_the_library(arch, stack, compressed_checkpoint):
    """llm-compressor's FP8 scheme: weights per tensor, activations quantized with a static
    per-tensor `input_scale`, against transformers + compressed-tensors (which quantizes
    each input with it), on a prompt with no input near an fp8 rounding jump. Merged q/k/v
    and gate/up (a CPU's layout) take the largest of their input scales, as vLLM does; the
    writer calibrates them on the same inputs, so they agree."""
    from transformers import AutoModelForCausalLM

    pytest.importorskip("compressed_tensors")
    path = compressed_checkpoint(arch, "fp8-static")
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()

    def count(module, args):
        hf.near_ties += static_ties(args[0], module.input_scale)

    for name, module in hf.model.layers.named_modules():
        if name.rsplit(".", 1)[-1] in QUANTIZED:
            module.register_forward_pre_hook(count)
    cfg, params = load_model(path, stack_layers=stack)
    weights = [w if stack else w[0] for name, w in params["layers"].items() if name.endswith("proj")]
    assert all(w.input_scale is not None and w.value.dtype == jnp.float8_e4m3fn for w in weights)
    tokens = tie_free_tokens(hf, 24)
    inputs = build_inputs([Chunk(tokens, 0, list(range(8)))], 4, all_logits=True)
    logits, _ = jit_forward(params, allocate_kv_caches(cfg, 8, 4, jnp.float32), inputs, cfg, "reference")
    assert rel_err(logits, hf_logits(hf, tokens)) <= TOL


@pytest.mark.parametrize("stack", [False, True], ids=["per-layer", "stacked"])
def test_compressed_tensors_int8_static_matches_the_library(stack, compressed_checkpoint):
    """llm-compressor's W8A8 int8 with static activations: weights per channel, inputs
    quantized with a static per-tensor `input_scale` (x / scale as a true division, rounded
    half to even, clamped to [-128, 127]), against transformers + compressed-tensors."""
    from transformers import AutoModelForCausalLM

    pytest.importorskip("compressed_tensors")
    path = compressed_checkpoint("llama", "int8-static")
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    cfg, params = load_model(path, stack_layers=stack)
    weights = [w if stack else w[0] for name, w in params["layers"].items() if name.endswith("proj")]
    assert all(w.input_scale is not None and w.value.dtype == jnp.int8 for w in weights)
    tokens = random_tokens(np.random.default_rng(0), 24)
    inputs = build_inputs([Chunk(tokens, 0, list(range(8)))], 4, all_logits=True)
    logits, _ = jit_forward(params, allocate_kv_caches(cfg, 8, 4, jnp.float32), inputs, cfg, "reference")
    assert rel_err(logits, hf_logits(hf, tokens)) <= TOL


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_per_tensor_fp8_checkpoint(static, tiny_checkpoint, tmp_path):
    """vLLM's (AutoFP8's) per-tensor fp8: `quant_method: "fp8"` without weight_block_size,
    `weight_scale` [] per weight and, static, `input_scale` []: against the full-precision
    model holding the dequantized weights, each Linear's input rounded per token (dynamic)
    or with its input scale (static), as the format defines (transformers reads only
    block fp8)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from weights.make_quantized import make_fp8

    src = tiny_checkpoint("llama")
    path = make_fp8(src, tmp_path / "fp8", None, static=static)
    tensors = load_file(str(path / "model.safetensors"))
    hf = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).eval()
    hf.near_ties = 0
    fp8 = lambda v: v.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).to(torch.float32)  # noqa: E731

    def static_input(scale):
        def hook(_, args):
            hf.near_ties += static_ties(args[0], scale)
            return (fp8(args[0] / scale) * scale,)
        return hook

    with torch.no_grad():
        for name, module in hf.model.layers.named_modules():
            if name.rsplit(".", 1)[-1] not in QUANTIZED:
                continue
            full = f"model.layers.{name}"
            module.weight.copy_(tensors[f"{full}.weight"].float() * tensors[f"{full}.weight_scale"])
            if static:
                module.register_forward_pre_hook(static_input(tensors[f"{full}.input_scale"]))
    if not static:
        hf = w8a8_oracle(hf, round_weights=False)
    cfg, params = load_model(path)
    q_proj = params["layers"]["qkv_proj"][0]
    assert q_proj.value.dtype == jnp.float8_e4m3fn and (q_proj.input_scale is not None) == static
    tokens = tie_free_tokens(hf, 24)
    inputs = build_inputs([Chunk(tokens, 0, list(range(8)))], 4, all_logits=True)
    logits, _ = jit_forward(params, allocate_kv_caches(cfg, 8, 4, jnp.float32), inputs, cfg, "reference")
    assert rel_err(logits, hf_logits(hf, tokens)) <= TOL


def test_compressed_tensors_int8_matches_the_library(compressed_checkpoint, tiny_checkpoint):
    """compressed-tensors int-quantized (W8A8 int8): a linear layer's product equals the
    library's own module's on the same input (scales amax / 127.5, x / scale rounded half
    to even). A token whose largest magnitude is negative has that input on a rounding tie
    (-127.5 -> -128, or -127 if the last bit of amax differs), so through the model, where
    amax carries float32 differences from transformers' computation, the logits are
    compared against a stated bound: within a quarter of the unquantized model's distance
    from the library's."""
    pytest.importorskip("compressed_tensors")
    path = compressed_checkpoint("llama", "int8")
    hf = compressed_tensors_hf(path)
    cfg, params = load_model(path)
    q_proj = params["layers"]["qkv_proj"][0]  # [kv_heads, group + 2, head_dim, hidden] int8
    assert q_proj.value.dtype == jnp.int8
    module = hf.model.layers[0].self_attn.q_proj
    x = torch.randn(7, cfg.hidden_size) * 3
    with torch.no_grad():
        want = module(x.unsqueeze(0))[0]  # (its forward quantizes the input per token)
    rows = cfg.num_heads * cfg.head_dim
    got = np.asarray(linear(jnp.asarray(x.numpy()), q_proj)).reshape(7, cfg.num_kv_heads, -1, cfg.head_dim)
    got = got[:, :, :-2].reshape(7, rows)  # the merged weight's q rows
    assert (x.amax(-1) < -x.amin(-1)).any()  # (some rows on the tie)
    np.testing.assert_allclose(got, want.numpy(), rtol=0, atol=1e-5)
    tokens = random_tokens(np.random.default_rng(0), 24)
    inputs = build_inputs([Chunk(tokens, 0, list(range(8)))], 4, all_logits=True)
    logits, _ = jit_forward(params, allocate_kv_caches(cfg, 8, 4, jnp.float32), inputs, cfg, "reference")
    _, full = load_model(tiny_checkpoint("llama"))
    unquantized, _ = jit_forward(full, allocate_kv_caches(cfg, 8, 4, jnp.float32), inputs, cfg, "reference")
    want = hf_logits(hf, tokens)
    assert rel_err(logits, want) < rel_err(unquantized, want) / 4


def test_no_compiles_after_warmup(tiny_checkpoint, compressed_checkpoint, compile_counter):
    """Online fp8 and an int8 checkpoint serve every bucket with what the warm-up compiled."""
    prompts = [{"prompt_token_ids": list(range(10, 10 + n))} for n in (20, 3, 6, 1)]  # (buckets 8 and 24)
    for path, quantization in ((tiny_checkpoint("llama"), "fp8"), (compressed_checkpoint("llama", "int8"), None)):
        llm = LLM(path, quantization=quantization, max_model_len=128, max_num_seqs=12, max_num_batched_tokens=24,
                  token_buckets=[8, 24])
        llm.llm_engine.finish_warmup()
        before = compile_counter.count
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
        assert compile_counter.count == before, f"{quantization or path.name}: a bucket compiled while serving"
        llm.shutdown()


def _with_config(path: Path, out: Path, **changes) -> Path:
    """A copy of checkpoint `path` whose quantization_config has `changes` (None: removed)."""
    shutil.copytree(path, out)
    config = json.loads((out / "config.json").read_text())
    quant = config.setdefault("quantization_config", {})
    quant.update(changes)
    config["quantization_config"] = {k: v for k, v in quant.items() if v is not None}
    (out / "config.json").write_text(json.dumps(config))
    return out


def assert_a_ctrl_c_in_the_join_leaves_nothing_placed(path, monkeypatch, at: int) -> None:
    """A Ctrl-C as the loader joins the `at`-th quantized weight with its scales (and the
    leaves placed beside it): everything placed is deleted, while the traceback is kept (as
    Jupyter keeps the last one)."""
    import jaxvllm.loader

    real, calls = jaxvllm.loader.QuantizedWeight, []

    def interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == at:
            raise KeyboardInterrupt("injected")
        return real(*args, **kwargs)

    monkeypatch.setattr(jaxvllm.loader, "QuantizedWeight", interrupted)
    live = len(jax.live_arrays())
    with pytest.raises(KeyboardInterrupt, match="injected") as caught:
        LLM(path, **ENGINE)
    assert len(calls) == at and len(jax.live_arrays()) == live, caught.tb


def test_a_ctrl_c_while_scales_join_their_weights_leaves_nothing_placed(fp8_checkpoint, monkeypatch):
    """The scales not yet joined (block fp8) are deleted with everything else placed."""
    assert_a_ctrl_c_in_the_join_leaves_nothing_placed(fp8_checkpoint("llama", (32, 32)), monkeypatch, at=3)


def test_bad_quantization_is_refused(tiny_checkpoint, fp8_checkpoint, tmp_path):
    """Each refused before any weight loads, or (tensors) while loading, naming the problem."""
    path, fp8 = tiny_checkpoint("llama"), fp8_checkpoint("llama", (32, 32))
    with pytest.raises(ValueError, match=r"quantization='int3' is not supported by jaxvllm; choose from None, 'fp8'"):
        LLM(path, quantization="int3", **ENGINE)
    with pytest.raises(ValueError, match=r"quantization='awq' does not match the checkpoint's quant_method 'fp8' in "
                                         r"config.json"):
        LLM(fp8, quantization="awq", **ENGINE)
    with pytest.raises(ValueError, match=r"quantization='gptq' names a quantized checkpoint's method, but config.json "
                                         r"has no quantization_config"):
        LLM(path, quantization="gptq", **ENGINE)
    # As vLLM's: a checkpoint's own method (or vLLM's marlin names for it) reads it as it is.
    assert online_method("fp8", SimpleNamespace(quant_method="fp8")) is None
    assert online_method("gptq_marlin", SimpleNamespace(quant_method="gptq")) is None
    assert online_method("compressed-tensors", SimpleNamespace(quant_method="compressed-tensors")) is None
    assert online_method("fp8", SimpleNamespace(quant_method=None)) == "fp8"
    cases = [
        (dict(quant_method="bitsandbytes"), r"quant_method 'bitsandbytes' in config.json is not supported; jaxvllm "
                                            r"reads fp8 \(quant_method 'fp8': blocks .* GPTQ .* AWQ"),
        (dict(quant_method="gptq", bits=2), r"2-bit GPTQ is not supported; jaxvllm reads 4- and 8-bit GPTQ and "
                                            r"4-bit AWQ"),
        # without weight_block_size, per-tensor scales: `weight_scale`, which a block checkpoint lacks
        (dict(weight_block_size=None), r"missing tensor\(s\): model.layers.0.self_attn.q_proj.weight_scale"),
        (dict(weight_block_size=[128, 0]), r"weight_block_size must be two positive ints .* got \[128, 0\]"),
        (dict(activation_scheme="static"), r"activation_scheme 'static' with weight_block_size is not supported "
                                           r"\(only 'dynamic'\)"),
        # one layer's o_proj kept in full precision (vLLM reads such a mix; jaxvllm's layers are alike)
        (dict(modules_to_not_convert=["model.layers.1.self_attn.o_proj"]),
         r"o_proj: the checkpoint keeps model.layers.1.self_attn.o_proj.weight in full precision \(its "
         r"quantization_config's ignore list, or its tensors\) but not every layer's, part's or expert's o_proj; "
         r"jaxvllm needs all or none"),
        # the checkpoint's scales are [2, 2] per layer for blocks of 32 over 64; blocks of 16 imply [4, 4]
        (dict(weight_block_size=[16, 16]), r"tensor model.layers.0.self_attn.q_proj.weight_scale_inv in "
                                           r"model.safetensors has shape \(2, 2\), config.json implies \(4, 4\)"),
    ]
    for i, (changes, match) in enumerate(cases):
        live = len(jax.live_arrays())
        with pytest.raises(ValueError, match=match) as caught:
            LLM(_with_config(fp8, tmp_path / str(i), **changes), **ENGINE)
        # Nothing placed stays on the device while the error is kept (as Jupyter keeps the last
        # one): the wrong scales come after the embeddings and layer 0's values.
        assert len(jax.live_arrays()) == live, caught.value
    no_scales = _with_config(path, tmp_path / "no-scales", quant_method="fp8", weight_block_size=[32, 32],
                             activation_scheme="dynamic")
    with pytest.raises(ValueError, match=r"missing tensor\(s\): model.layers.0.self_attn.q_proj.weight_scale_inv"):
        LLM(no_scales, **ENGINE)
    with pytest.raises(ValueError, match=r"load_format='dummy' of a quantized checkpoint"):
        LLM(fp8, load_format="dummy", **ENGINE)


def test_bad_compressed_tensors_checkpoints_are_refused(compressed_checkpoint, tmp_path):
    """compressed-tensors schemes not read, and a static scale of the wrong shape or missing:
    each named, nothing left on the device."""
    from safetensors.torch import load_file, save_file

    static = compressed_checkpoint("llama", "fp8-static")
    group = json.loads((static / "config.json").read_text())["quantization_config"]["config_groups"]["group_0"]

    def scheme(weights=None, inputs=None):
        return {"group_0": dict(group, weights={**group["weights"], **(weights or {})},
                                input_activations={**group["input_activations"], **(inputs or {})})}

    cases = [
        (dict(config_groups=scheme(weights={"strategy": "group"})), r"compressed-tensors weights .*'strategy': "
                                                                    r"'group'.* are not supported"),
        (dict(config_groups=scheme(weights={"strategy": "block"})), r"compressed-tensors block_structure None of "
                                                                    r"'block' weights must be two positive ints"),
        # vLLM's block GEMM quantizes activations per token and group of the block's inputs, and nothing else
        (dict(config_groups=scheme(weights={"strategy": "block", "block_structure": [32, 32]})),
         r"input_activations .*'strategy': 'tensor'.* beside block weights are not supported; jaxvllm reads .*"
         r"'group_size': 32, 'dynamic': True"),
        (dict(config_groups=scheme(weights={"strategy": "block", "block_structure": [32, 32]},
                                   inputs={"strategy": "group", "group_size": 64, "dynamic": True})),
         r"input_activations .*'group_size': 64.* beside block weights are not supported"),
        (dict(config_groups=scheme(inputs={"strategy": "token"})),
         r"input_activations .* are not supported; jaxvllm reads symmetric 8-bit activations of the weights' type "
         r"\('float'\) quantized dynamically"),
        (dict(config_groups=scheme(inputs={"symmetric": False})),
         r"input_activations .*'symmetric': False.* are not supported; jaxvllm reads symmetric 8-bit"),
        # int8 activations beside fp8 weights were quantized to fp8 (llm-compressor writes such a custom scheme)
        (dict(config_groups=scheme(inputs={"type": "int"})),
         r"input_activations .*'type': 'int'.* are not supported; jaxvllm reads symmetric 8-bit activations of the "
         r"weights' type \('float'\)"),
        # an asymmetric KV cache scheme's zero points were left unread
        (dict(kv_cache_scheme={"num_bits": 8, "type": "float", "strategy": "tensor", "symmetric": False}),
         r"compressed-tensors kv_cache_scheme .* is not supported; jaxvllm reads symmetric 8-bit float \(fp8\) KV"),
        # llm-compressor's QuIP / Hadamard transforms: the stored weights hold the inverse; they ran without it
        (dict(transform_config={"config_groups": {"v": {"type": "hadamard", "apply": [
            {"location": "input", "inverse": False, "targets": ["Linear"], "ignore": ["lm_head"]}]}}}),
         r"compressed-tensors transform_config \(QuIP / Hadamard transforms applied online to the layers' inputs\) "
         r"is not supported"),
    ]
    for i, (changes, match) in enumerate(cases):
        with pytest.raises(ValueError, match=match):
            LLM(_with_config(static, tmp_path / str(i), **changes), **ENGINE)
    for name, change, match in [
            ("input_scale", lambda t: torch.ones(2), r"tensor model.layers.1.mlp.up_proj.input_scale has shape \(2,\); "
                                                     r"a static input scale has one value"),
            ("input_scale", None, r"missing tensor\(s\): model.layers.1.mlp.up_proj.input_scale"),
            ("weight_scale", lambda t: torch.ones(3), r"tensor model.layers.1.mlp.up_proj.weight_scale has shape "
                                                      r"\(3,\); a per-tensor scale has one value")]:
        broken = _with_config(static, tmp_path / f"{name}-{change is None}")
        tensors = load_file(str(broken / "model.safetensors"))
        key = f"model.layers.1.mlp.up_proj.{name}"
        if change is None:
            del tensors[key]
        else:
            tensors[key] = change(tensors[key])
        save_file(tensors, str(broken / "model.safetensors"), metadata={"format": "pt"})
        live = len(jax.live_arrays())
        with pytest.raises(ValueError, match=match) as caught:
            LLM(broken, **ENGINE)
        assert len(jax.live_arrays()) == live, caught.value

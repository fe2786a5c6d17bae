"""Write a quantized copy of a full-precision HF checkpoint, in a published format:

    python weights/make_quantized.py --src weights/smollm2-135m-instruct --out /tmp/smollm2-fp8 [--block 128 128]

Format "fp8" is transformers' FineGrainedFP8, as Qwen3-FP8 ships: every decoder linear
weight (q/k/v/o, gate/up/down) as float8_e4m3fn [out, in] with `weight_scale_inv`, float32
[ceil(out / rows), ceil(in / inputs)], one per block (the last block of an axis may be
partial), and `quantization_config` {"quant_method": "fp8", "weight_block_size": [rows,
inputs], "activation_scheme": "dynamic"}. Embeddings, norms and the lm_head are copied as
they are. transformers quantizes to this format only on a GPU; on a CPU it reads it by
dequantizing, which is how tests use it as the oracle.

`make_compressed` writes the compressed-tensors format as llm-compressor does for its
FP8_DYNAMIC, W8A8 int8, FP8 and FP8_BLOCK schemes, `make_w4a16` its 4- and 8-bit
pack-quantized ones, and `make_mixed` a mixed-precision recipe of those (transformers reads
them through the compressed-tensors library, the tests' oracle).
`make_gptq` and `make_awq` write AutoGPTQ's (4- or 8-bit) and AutoAWQ's 4-bit packings, from weights
quantized to the nearest grid point (the tests' oracle unpacks them as those libraries
do). Tests import them all.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path

# Decoder linear weights, experts' included (Qwen3-MoE's mlp.experts.{j}.*_proj, Mixtral's w1/w2/w3).
LINEAR = re.compile(r"model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(experts\.\d+\.)?(gate|up|down)_proj|"
                    r"block_sparse_moe\.experts\.\d+\.w[123])\.weight")
FP8_MAX = 448.0


def quantize_blocks(weight, block: tuple[int, int]):
    """(float8 values, float32 scales per block) of a [out, in] torch weight: each block
    scaled so that its largest magnitude is 448 (by multiplying, as jaxvllm does)."""
    import torch

    rows, cols = weight.shape
    br, bc = block
    padded = torch.nn.functional.pad(weight.float(), (0, -cols % bc, 0, -rows % br))
    blocks = padded.reshape(padded.shape[0] // br, br, padded.shape[1] // bc, bc)
    amax = blocks.abs().amax(dim=(1, 3), keepdim=True).clamp(min=torch.finfo(torch.float32).tiny)
    values = (blocks * (FP8_MAX / amax)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    values = values.reshape(padded.shape)[:rows, :cols].contiguous()
    return values, (amax / FP8_MAX).reshape(amax.shape[0], amax.shape[2]).contiguous()


def make_fp8(src: str | Path, out: str | Path, block: tuple[int, int] | None = (128, 128),
             ignore: tuple[str, ...] = (), static: bool = False) -> Path:
    """`src` with its decoder linear weights in HF's block fp8 (those whose module name ends
    in one of `ignore` kept as they are, and listed in modules_to_not_convert). `block` None:
    vLLM's (and AutoFP8's) per-tensor fp8 instead, `weight_scale` [] per weight and, `static`,
    a calibrated `input_scale` [] (`calibrate_inputs`) with activation_scheme "static"."""
    kept = []
    input_amax = calibrate_inputs(src) if static else {}

    def quantize(name: str, tensor) -> dict:
        module = name.removesuffix(".weight")
        if any(module.endswith(i) for i in ignore):
            kept.append(module)
            return {name: tensor}
        if block is not None:
            value, scale = quantize_blocks(tensor, block)
            return {name: value, f"{name}_scale_inv": scale}
        return per_tensor_fp8(name, tensor, input_amax.get(module), ())

    return _write_quantized(src, out, quantize, lambda: {
        "quant_method": "fp8", "activation_scheme": "static" if static else "dynamic",
        **({"weight_block_size": list(block)} if block is not None else {}), "modules_to_not_convert": kept or None})


def quantize_rows(weight, kind: str):
    """(values, float32 scales [out, 1]) of a [out, in] torch weight, one scale per row:
    "fp8" float8_e4m3fn (largest magnitude to 448), "int8" symmetric int8 (to 127.5, rounded
    and clamped to [-128, 127], as compressed-tensors computes its scales)."""
    import torch

    w = weight.float()
    amax = w.abs().amax(dim=1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny)
    if kind == "fp8":
        return (w * (FP8_MAX / amax)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), amax / FP8_MAX
    return torch.round(w * (127.5 / amax)).clamp(-128, 127).to(torch.int8), amax / 127.5


def per_tensor_fp8(name: str, tensor, input_amax: float | None, scale_shape: tuple[int, ...]) -> dict:
    """A weight in fp8 with one `weight_scale` (largest magnitude to 448) and, given the
    calibrated `input_amax`, a static `input_scale`, both of `scale_shape` (AutoFP8 writes
    [], compressed-tensors [1])."""
    import torch

    module = name.removesuffix(".weight")
    value, scale = quantize_rows(tensor.reshape(1, -1), "fp8")
    out = {name: value.reshape(tensor.shape), f"{module}.weight_scale": scale.reshape(scale_shape)}
    if input_amax is not None:
        out[f"{module}.input_scale"] = torch.tensor(input_amax / FP8_MAX, dtype=torch.float32).reshape(scale_shape)
    return out


def make_compressed(src: str | Path, out: str | Path, kind: str = "fp8", block: tuple[int, int] = (128, 128)) -> Path:
    """`src` as llm-compressor writes its FP8_DYNAMIC ("fp8"), W8A8 int8 ("int8", "int8-static"),
    FP8 ("fp8-static") and FP8_BLOCK ("fp8-block") schemes in the compressed-tensors format:
    every decoder linear weight per channel (`weight`, `weight_scale` [out, 1]) with
    activations dynamic per token, or ("int8-static") with a static `input_scale` [1] per
    module, or ("fp8-static") per tensor (`weight_scale` [1]) with a static `input_scale` [1],
    or ("fp8-block") per `block` of (rows, inputs) (`weight_scale` [ceil(out / rows),
    ceil(in / inputs)], the last block of an axis may be partial) with activations dynamic
    per token and group of `inputs`; static scales calibrated on random tokens (the largest
    input magnitude over them, to 448 or 127.5); the lm_head ignored."""
    quantize, group, fmt = eight_bit_scheme(src, kind, block)
    return _write_compressed(src, out, quantize, group, fmt)


def eight_bit_scheme(src: str | Path, kind: str, block: tuple[int, int] = (128, 128)):
    """(quantize(name, tensor) -> tensors, config group, format) of `make_compressed`'s `kind`."""
    import torch

    static = kind.endswith("-static")
    input_amax = calibrate_inputs(src) if static else {}

    def quantize(name: str, tensor) -> dict:
        module = name.removesuffix(".weight")
        if kind == "fp8-static":
            return per_tensor_fp8(name, tensor, input_amax[module], (1,))
        if kind == "fp8-block":
            value, scale = quantize_blocks(tensor, block)
            return {name: value, f"{module}.weight_scale": scale}
        value, scale = quantize_rows(tensor, kind.removesuffix("-static"))
        out = {name: value, f"{module}.weight_scale": scale}
        if static:  # (int8: compressed-tensors' symmetric range, 127.5 a side)
            out[f"{module}.input_scale"] = torch.tensor([input_amax[module] / 127.5], dtype=torch.float32)
        return out

    kind_name = "int" if kind.startswith("int8") else "float"
    scheme = {"num_bits": 8, "type": kind_name, "symmetric": True}
    inputs = {"strategy": "tensor", "dynamic": False} if static else {"strategy": "token", "dynamic": True}
    weights = {"strategy": "tensor" if kind == "fp8-static" else "channel"}
    if kind == "fp8-block":
        weights = {"strategy": "block", "block_structure": list(block)}
        inputs = {"strategy": "group", "group_size": block[1], "dynamic": True}
    group = {"targets": ["Linear"], "weights": {**scheme, **weights, "dynamic": False},
             "input_activations": {**scheme, **inputs}}
    return quantize, group, f"{kind_name}-quantized"


def make_mixed(src: str | Path, out: str | Path, schemes: dict[str, tuple]) -> Path:
    """`src` as llm-compressor writes a mixed-precision recipe ("format": "mixed-precision"):
    `schemes` maps a regex of module names ("re:" target) to the scheme of the modules it
    matches, the first that does: ("w4a16" | "w8a16", group, symmetric) as `make_w4a16`
    writes it, or an 8-bit kind of `make_compressed` ("fp8", "int8", "fp8-block", ...); each
    config group has its own "format". A module no regex matches is kept as it is (and not
    listed in `ignore`: a checkpoint vLLM refuses)."""
    groups, quantizers = {}, []
    for i, (pattern, scheme) in enumerate(schemes.items()):
        kind, *args = scheme
        if kind in ("w4a16", "w8a16"):
            quantize, group, fmt = packed_scheme(*args, bits=4 if kind == "w4a16" else 8)
        else:
            quantize, group, fmt = eight_bit_scheme(src, kind, *args)
        groups[f"group_{i}"] = {**group, "targets": [f"re:{pattern}"], "format": fmt}
        quantizers.append((re.compile(pattern), quantize))

    def quantize(name: str, tensor) -> dict:
        module = name.removesuffix(".weight")
        own = next((q for pattern, q in quantizers if pattern.match(module)), None)
        return {name: tensor} if own is None else own(name, tensor)

    return _write_quantized(src, out, quantize, lambda: {
        "quant_method": "compressed-tensors", "format": "mixed-precision", "quantization_status": "compressed",
        "config_groups": groups, "ignore": ["lm_head"]})


def _write_compressed(src: str | Path, out: str | Path, quantize, group: dict, fmt: str) -> Path:
    """`src` written with one compressed-tensors config group (the lm_head ignored)."""
    return _write_quantized(src, out, quantize, lambda: {
        "quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
        "config_groups": {"group_0": group}, "ignore": ["lm_head"]})


def calibrate_inputs(src: str | Path, num_tokens: int = 256, seed: int = 0) -> dict[str, float]:
    """The largest input magnitude of each decoder linear layer of `src` (transformers,
    float32) over `num_tokens` random tokens: what llm-compressor's static activation
    observer records over its calibration set."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).eval()
    amax: dict[str, float] = {}

    def record(name):
        def hook(_, args):
            amax[name] = max(amax.get(name, 0.0), float(args[0].abs().max()))
        return hook

    for name, module in model.named_modules():
        if LINEAR.fullmatch(f"{name}.weight"):
            module.register_forward_pre_hook(record(name))
    tokens = torch.randint(3, model.config.vocab_size, (1, num_tokens), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        model(tokens)
    return amax


def quantize_groups(weight, group: int, symmetric: bool, bits: int = 4):
    """Round-to-nearest `bits`-bit of a [out, in] torch weight per group of `group` inputs (0:
    the whole row), as GPTQ's and AWQ's quantizers grid it: (unsigned values [out, in] in
    0..2^bits - 1 (15 for 4 bits), float16 scales [out, groups], zero points [out, groups] in
    that range, 2^(bits - 1) when `symmetric`), with `(value - zero) * scale` the weight."""
    import torch

    out_dim, in_dim = weight.shape
    size, top = group or in_dim, 2**bits - 1
    w = weight.float().reshape(out_dim, -1, size)
    lo, hi = w.amin(dim=2).clamp(max=0), w.amax(dim=2).clamp(min=0)
    if symmetric:
        scale, zero = torch.maximum(-lo, hi) * 2 / top, torch.full_like(lo, 2 ** (bits - 1))
    else:
        scale = (hi - lo) / top
        zero = torch.round(-lo / scale.clamp(min=1e-10)).clamp(0, top)
    scale = scale.clamp(min=1e-6).half()
    value = torch.round(w / scale.float()[..., None] + zero[..., None]).clamp(0, top)
    return value.reshape(out_dim, in_dim).to(torch.int32), scale, zero.to(torch.int32)


def pack_words(values, order=None, bits: int = 4):
    """Unsigned `bits`-bit values [..., n] (numpy ints, n a multiple of k = 32 / bits: 8 for 4
    bits, 4 for 8) as int32 words [..., n / k]: value k w + order[j] of each row in slot j of
    word w (bits j * bits and up, low slot first; `order` default: in order)."""
    import numpy as np

    per_word = 32 // bits
    order = range(per_word) if order is None else order
    values = np.asarray(values, dtype=np.uint32).reshape(*np.shape(values)[:-1], -1, per_word)
    words = np.zeros(values.shape[:-1], dtype=np.uint32)
    for slot, position in enumerate(order):
        words |= values[..., position] << np.uint32(bits * slot)
    return words.view(np.int32)


# AutoAWQ's pack order: nibble k of a word holds the value of column AWQ_ORDER[k] of its 8.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def make_gptq(src: str | Path, out: str | Path, group: int = 128, symmetric: bool = True,
              checkpoint_format: str = "gptq", desc_act: bool = False, bits: int = 4) -> Path:
    """`src` in AutoGPTQ's packing of `bits` (4 or 8) bits, k = 32 / bits values to an int32
    word, low bits first (round-to-nearest rather than GPTQ's solver: the layout is what is
    read): `qweight` int32 [in / k, out], packed along in; `qzeros` int32 [groups, out / k],
    packed along out, each zero point less one in the "gptq" (v1) checkpoint format (zero
    point 2^(bits - 1) when symmetric); `scales` float16 [groups, out]; `g_idx` [in], each
    input's group. `desc_act`: act-order,
    the inputs grouped in an order of their own, so that `g_idx` is not sorted (here a fixed
    shuffle per input size; GPTQ's comes from the Hessian of the inputs, so modules with the
    same inputs, q/k/v or gate/up, share it here too)."""
    import torch

    def quantize(name: str, tensor) -> dict:
        in_dim = tensor.shape[1]
        shuffle = torch.randperm(in_dim, generator=torch.Generator().manual_seed(in_dim))
        order = shuffle if desc_act else torch.arange(in_dim)
        value, scale, zero = quantize_groups(tensor[:, order], group, symmetric, bits)
        value = torch.empty_like(value).index_copy_(1, order, value)  # back in the inputs' order
        g_idx = torch.empty(in_dim, dtype=torch.int32).index_copy_(
            0, order, torch.arange(in_dim, dtype=torch.int32) // (group or in_dim))
        stored_zero = (zero - 1).clamp(min=0) if checkpoint_format == "gptq" else zero
        module = name.removesuffix(".weight")
        return {f"{module}.qweight": torch.from_numpy(pack_words(value.numpy(), bits=bits).T.copy()),
                f"{module}.qzeros": torch.from_numpy(pack_words(stored_zero.T.numpy(), bits=bits)),
                f"{module}.scales": scale.T.contiguous(), f"{module}.g_idx": g_idx}

    return _write_quantized(src, out, quantize, lambda: {
        "quant_method": "gptq", "bits": bits, "group_size": group or -1, "desc_act": desc_act, "sym": symmetric,
        "checkpoint_format": checkpoint_format})


def make_awq(src: str | Path, out: str | Path, group: int = 128) -> Path:
    """`src` in AutoAWQ's GEMM packing (round-to-nearest, asymmetric): `qweight` int32 [in,
    out / 8] and `qzeros` int32 [groups, out / 8], both packed along out in AWQ's order;
    `scales` float16 [groups, out]."""
    import torch

    def quantize(name: str, tensor) -> dict:
        value, scale, zero = quantize_groups(tensor, group, symmetric=False)
        module = name.removesuffix(".weight")
        return {f"{module}.qweight": torch.from_numpy(pack_words(value.T.numpy(), AWQ_ORDER)),
                f"{module}.qzeros": torch.from_numpy(pack_words(zero.T.numpy(), AWQ_ORDER)),
                f"{module}.scales": scale.T.contiguous()}

    return _write_quantized(src, out, quantize, lambda: {
        "quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"})


def make_w4a16(src: str | Path, out: str | Path, group: int = 128, symmetric: bool = True, bits: int = 4) -> Path:
    """`src` as llm-compressor writes its W4A16 (`symmetric`), W4A16_ASYM and (`bits` 8) W8A16
    schemes in the compressed-tensors pack-quantized format, packed by the compressed-tensors
    library itself: `weight_packed` int32 [out, in / (32 / bits)], `weight_scale` [out,
    groups], `weight_zero_point` int32 [out / (32 / bits), groups] when asymmetric,
    `weight_shape`; the lm_head ignored."""
    return _write_compressed(src, out, *packed_scheme(group, symmetric, bits))


def packed_scheme(group: int = 128, symmetric: bool = True, bits: int = 4):
    """(quantize(name, tensor) -> tensors, config group, format) of `make_w4a16`'s scheme."""
    import torch
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    half = 2 ** (bits - 1)

    def quantize(name: str, tensor) -> dict:
        value, scale, zero = quantize_groups(tensor, group, symmetric, bits)
        module = name.removesuffix(".weight")
        # compressed-tensors' ints are signed: values and zero points 2^(bits - 1) less than the unsigned grid's
        out = {f"{module}.weight_packed": pack_to_int32((value - half).to(torch.int8), bits),
               f"{module}.weight_scale": scale.to(tensor.dtype), f"{module}.weight_shape": torch.tensor(tensor.shape)}
        if not symmetric:
            out[f"{module}.weight_zero_point"] = pack_to_int32((zero - half).to(torch.int8), bits, packed_dim=0)
        return out

    strategy = {"strategy": "group", "group_size": group} if group else {"strategy": "channel"}
    return quantize, {"targets": ["Linear"], "input_activations": None, "weights": {
        "num_bits": bits, "type": "int", "symmetric": symmetric, "dynamic": False, **strategy}}, "pack-quantized"


def _write_quantized(src: str | Path, out: str | Path, quantize, quantization_config) -> Path:
    """`src` copied to `out` (one safetensors file) with each decoder linear weight replaced
    by `quantize(name, tensor)`'s tensors, and config.json given `quantization_config()`
    (called once every weight is through)."""
    from safetensors.torch import load_file, save_file

    src, out = Path(src), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for file in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    written = {}
    for name, tensor in tensors.items():
        written.update(quantize(name, tensor) if LINEAR.fullmatch(name) else {name: tensor})
    save_file(written, str(out / "model.safetensors"), metadata={"format": "pt"})
    for file in src.iterdir():
        if file.is_file() and not file.name.endswith(".safetensors") and file.name != "model.safetensors.index.json":
            shutil.copy(file, out / file.name)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = quantization_config()
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--src", required=True, help="a full-precision HF checkpoint folder")
    parser.add_argument("--out", required=True)
    parser.add_argument("--block", type=int, nargs=2, default=(128, 128), metavar=("ROWS", "INPUTS"))
    args = parser.parse_args()
    print(make_fp8(args.src, args.out, tuple(args.block)))


if __name__ == "__main__":
    main()

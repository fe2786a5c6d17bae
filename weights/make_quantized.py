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
FP8_DYNAMIC and W8A8 int8 schemes (transformers reads it through the compressed-tensors
library, the tests' oracle). Tests import both.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path

LINEAR = re.compile(r"model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight")
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


def make_fp8(src: str | Path, out: str | Path, block: tuple[int, int] = (128, 128),
             ignore: tuple[str, ...] = ()) -> Path:
    """`src` with its decoder linear weights in HF's block fp8 (those whose module name ends
    in one of `ignore` kept as they are, and listed in modules_to_not_convert)."""
    kept = []

    def quantize(name: str, tensor) -> dict:
        module = name.removesuffix(".weight")
        if any(module.endswith(i) for i in ignore):
            kept.append(module)
            return {name: tensor}
        value, scale = quantize_blocks(tensor, block)
        return {name: value, f"{name}_scale_inv": scale}

    return _write_quantized(src, out, quantize, lambda: {
        "quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": list(block),
        "modules_to_not_convert": kept or None})


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


def make_compressed(src: str | Path, out: str | Path, kind: str = "fp8") -> Path:
    """`src` as llm-compressor writes its FP8_DYNAMIC ("fp8") and W8A8 int8 ("int8") schemes
    in the compressed-tensors format: every decoder linear weight per channel (`weight`,
    `weight_scale` [out, 1]), activations dynamic per token, the lm_head ignored."""

    def quantize(name: str, tensor) -> dict:
        value, scale = quantize_rows(tensor, kind)
        return {name: value, name.removesuffix(".weight") + ".weight_scale": scale}

    kind_name = "float" if kind == "fp8" else "int"
    scheme = {"num_bits": 8, "type": kind_name, "symmetric": True}
    return _write_quantized(src, out, quantize, lambda: {
        "quant_method": "compressed-tensors", "format": f"{kind_name}-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"],
                                      "weights": {**scheme, "strategy": "channel", "dynamic": False},
                                      "input_activations": {**scheme, "strategy": "token", "dynamic": True}}},
        "ignore": ["lm_head"]})


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

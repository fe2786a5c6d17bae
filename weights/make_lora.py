"""Write a random PEFT LoRA adapter for a checkpoint, with HF PEFT itself, no downloads:

    python weights/make_lora.py weights/tiny-llama /tmp/lora-a --rank 8 --seed 1

or from Python (tests import it as `weights.make_lora`):

    from weights.make_lora import make_lora
    make_lora("weights/tiny-llama", "/tmp/lora-a", rank=8, seed=1)

B is random too (PEFT's `init_lora_weights=False`; a fresh adapter's B is zeros and
would change nothing), scaled so that the adapter visibly moves the logits without
swamping the base model.
"""

from __future__ import annotations

import argparse
from pathlib import Path

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_lora(model: str | Path, out: str | Path, *, rank: int = 8, alpha: float | None = None,
              targets: tuple[str, ...] = ALL_TARGETS, seed: int = 0, use_rslora: bool = False,
              magnitude: float = 0.1, **config) -> Path:
    """Save a random LoRA adapter of `model` to `out` (adapter_config.json and
    adapter_model.safetensors); `config` adds LoraConfig fields (use_dora, bias, ...)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    lora = LoraConfig(r=rank, lora_alpha=alpha if alpha is not None else 2 * rank, target_modules=list(targets),
                      init_lora_weights=False, use_rslora=use_rslora, task_type="CAUSAL_LM", **config)
    peft_model = get_peft_model(base, lora)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn_like(param) * magnitude)
    peft_model.save_pretrained(out)
    return Path(out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("out")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--alpha", type=float, default=None)
    parser.add_argument("--targets", nargs="+", default=list(ALL_TARGETS))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(make_lora(args.model, args.out, rank=args.rank, alpha=args.alpha, targets=tuple(args.targets),
                    seed=args.seed))


if __name__ == "__main__":
    main()

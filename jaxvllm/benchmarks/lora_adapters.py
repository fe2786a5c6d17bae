"""LoRA adapters for `bench throughput --num-loras K`: the user's (`--lora-modules
name=path`), completed with random ones in PEFT's layout where fewer are given, so that
any model (a `dummy:` one too) can be measured with K adapters and no download."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from jaxvllm.loader import load_config
from jaxvllm.lora.adapter import CONFIG_FILE, PEFT_PREFIX, WEIGHTS_FILE, lora_targets
from jaxvllm.lora.request import LoRARequest
from jaxvllm.models import MODELS


def write_random_adapter(model: str | Path, out: Path, rank: int, seed: int = 0) -> Path:
    """A random rank-`rank` adapter on every linear layer weight of the model's layers
    (float32, alpha 2 * rank, values small enough to leave the model coherent)."""
    cfg = load_config(model)
    rng = np.random.default_rng(seed)
    tensors, modules = {}, set()
    for target in lora_targets(MODELS[cfg.architecture].param_specs(cfg)):
        for row in target.modules:
            for module, (out_size, in_size) in zip(row, target.part_hf):
                modules.add(module.rsplit(".", 1)[-1])
                key = f"{PEFT_PREFIX}{module}"
                tensors[f"{key}.lora_A.weight"] = (rng.standard_normal((rank, in_size)) / np.sqrt(in_size)
                                                  ).astype(np.float32)
                tensors[f"{key}.lora_B.weight"] = (rng.standard_normal((out_size, rank)) * 0.01).astype(np.float32)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / WEIGHTS_FILE))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": sorted(modules),
              "bias": "none", "task_type": "CAUSAL_LM"}
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=1))
    return out


def bench_adapters(model: str | Path, given: list[str], num_loras: int, rank: int, folder: Path) -> list[LoRARequest]:
    """`num_loras` LoRARequests: the `given` "name=path" ones first, then random ones in `folder`."""
    requests = []
    for i, item in enumerate(given):
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules takes name=path entries, got {item!r}")
        requests.append(LoRARequest(name, i + 1, path))
    for i in range(len(requests), num_loras):
        requests.append(LoRARequest(f"random-{i}", i + 1, str(write_random_adapter(model, folder / f"lora-{i}", rank,
                                                                                   seed=i))))
    return requests[: max(num_loras, len(given))]

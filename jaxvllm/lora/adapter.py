"""PEFT LoRA adapters on the host: which of the model's weights an adapter may target,
reading and checking an adapter folder, and one adapter as the arrays of a device slot.

A PEFT folder holds `adapter_config.json` (rank `r`, `lora_alpha`, `use_rslora`, ...)
and `adapter_model.safetensors` with, for each adapted linear module M,
`base_model.model.{M}.lora_A.weight` [r, in] and `...lora_B.weight` [out, r], in HF's
[out, in] convention: the module's weight becomes W + scale * B A, scale = alpha / r
(alpha / sqrt(r) with rsLoRA; r and alpha per module where `rank_pattern` and
`alpha_pattern` say).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from jaxvllm.loader import open_safetensors
from jaxvllm.lora.request import LoRARequest
from jaxvllm.models.common import ParamSpec
from jaxvllm.quantization import QUANTIZED

PEFT_PREFIX = "base_model.model."
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
_KEY = re.compile(r"^(.*)\.lora_(A|B)\.weight$")


@dataclass(frozen=True)
class LoRATarget:
    """A weight of the model an adapter may change: `name` in params["layers"], and per
    row of its stack the HF modules of its parts (q, k, v of a merged qkv_proj: three).
    `out` and `inputs` are the weight's own axes; `part_out` each part's out axes and
    `part_hf` its HF [out, in]."""

    name: str
    modules: tuple[tuple[str, ...], ...]
    out: tuple[int, ...]
    inputs: tuple[int, ...]
    part_out: tuple[tuple[int, ...], ...]
    part_hf: tuple[tuple[int, int], ...]
    merge: str

    def slot_shapes(self, rank: int) -> tuple[tuple[int, ...], tuple[tuple[int, ...], ...]]:
        """One slot's shapes over every row: A [rows, P R, *in] and B [rows, *part out, R]
        per part (`jaxvllm.lora.weights`)."""
        rows = len(self.modules)
        return (rows, len(self.part_out) * rank, *self.inputs), tuple((rows, *out, rank) for out in self.part_out)


def lora_targets(specs: list[ParamSpec]) -> list[LoRATarget]:
    """The model's linear layer weights (`quantization.QUANTIZED`: q/k/v, o, gate/up, down,
    merged or not) from its param specs, in the layout the step runs with."""
    targets = []
    for spec in specs:
        if spec.path[0] != "layers" or spec.path[-1] not in QUANTIZED or not spec.layers:
            continue
        member = spec.layers[0]
        parts = member.parts or (member,)
        n_in = next(k for k in range(1, len(member.shape)) if math.prod(member.shape[-k:]) == parts[0].hf_shape[1])
        targets.append(LoRATarget(
            spec.path[-1],
            tuple(tuple(p.hf_name.removesuffix(".weight") for p in (m.parts or (m,))) for m in spec.layers),
            member.shape[:-n_in], member.shape[-n_in:],
            tuple(p.shape[: len(p.shape) - n_in] for p in parts), tuple(tuple(p.hf_shape) for p in parts),
            member.merge))
    return targets


@dataclass(frozen=True)
class LoRAAdapter:
    """A read adapter: per HF module, (A [r, in], B [out, r] times the scale), float32."""

    request: LoRARequest
    weights: dict[str, tuple[np.ndarray, np.ndarray]]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def read_adapter(request: LoRARequest, targets: list[LoRATarget], max_rank: int, kv_repeats: int = 1) -> LoRAAdapter:
    """Read and check a PEFT folder against the model: every refusal names what is not
    supported (the tensor and both shapes for one that does not fit). `kv_repeats`: how
    many times the model repeats each checkpoint KV head (over devices), which the
    k_proj / v_proj weights (and their slots) have and the adapter's do not."""
    folder, label = Path(request.lora_path), f"LoRA adapter {request.lora_name!r} ({request.lora_path})"
    if not (folder / CONFIG_FILE).is_file():
        raise ValueError(f"{label}: no {CONFIG_FILE} there (a PEFT adapter folder is expected)")
    try:
        config = json.loads((folder / CONFIG_FILE).read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{label}: {CONFIG_FILE} is not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{label}: {CONFIG_FILE} holds a {type(config).__name__}, not a JSON object")
    _check_config(config, label, max_rank)
    if not (folder / WEIGHTS_FILE).is_file():
        if (folder / "adapter_model.bin").is_file():
            raise ValueError(f"{label}: adapter_model.bin (a pickled torch file) is not supported; save the adapter "
                             f"with safetensors (PEFT's save_pretrained(..., safe_serialization=True), the default)")
        raise ValueError(f"{label}: no {WEIGHTS_FILE} there")
    tensors: dict[str, dict[str, np.ndarray]] = {}
    with open_safetensors(folder / WEIGHTS_FILE) as f:
        for key in f.keys():
            module, which = _module_of(key, label)
            tensors.setdefault(module, {})[which] = f.get_tensor(key).astype(np.float32)
    known = {module: hf for t in targets for row in t.modules for module, hf in zip(row, t.part_hf)}
    weights = {}
    for module, pair in tensors.items():
        if module not in known:
            raise ValueError(f"{label}: target module {module!r} is not one the model has an adapter slot for "
                             f"(the layers' q/k/v/o and gate/up/down projections)")
        missing = {"A", "B"} - set(pair)
        if missing:
            raise ValueError(f"{label}: module {module!r} has no lora_{missing.pop()}.weight")
        rank = _per_module(config, "rank_pattern", module, config["r"])
        alpha = _per_module(config, "alpha_pattern", module, config["lora_alpha"])
        scale = alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
        weights[module] = (pair["A"], pair["B"] * np.float32(scale))
        out, inputs = known[module]
        if module.endswith(("k_proj", "v_proj")):
            out //= kv_repeats
        _check_shapes(module, *weights[module], (out, inputs), rank, label)
    if not weights:
        raise ValueError(f"{label}: {WEIGHTS_FILE} holds no lora_A / lora_B weights")
    return LoRAAdapter(request, weights)


def _check_config(config: dict, label: str, max_rank: int) -> None:
    # (vLLM's PEFTHelper needs these three; a missing lora_alpha is PEFT's 8, not r)
    if missing := [key for key in ("r", "lora_alpha", "target_modules") if key not in config]:
        raise ValueError(f"{label}: {CONFIG_FILE} lacks {missing}: vLLM's required fields are r, lora_alpha and "
                         "target_modules (Missing required configuration fields)")
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{label}: peft_type {config['peft_type']!r} is not supported (LoRA only)")
    if config.get("use_dora"):
        raise ValueError(f"{label}: DoRA (use_dora=True) is not supported")
    if config.get("bias", "none") != "none":
        raise ValueError(f"{label}: bias={config['bias']!r} is not supported (only 'none')")
    if config.get("modules_to_save"):
        raise ValueError(f"{label}: modules_to_save {config['modules_to_save']} (whole trained modules) is not "
                         "supported")
    for rank in (config.get("r"), *(config.get("rank_pattern") or {}).values()):
        if not isinstance(rank, int) or rank < 1:
            raise ValueError(f"{label}: rank r={rank!r} in adapter_config.json is not a positive int")
        if rank > max_rank:
            raise ValueError(f"{label}: rank {rank} is above max_lora_rank={max_rank}; start the engine with "
                             f"max_lora_rank={rank} or more")


def _per_module(config: dict, key: str, module: str, default):
    """PEFT's rank_pattern / alpha_pattern: the first key that matches the module name's end."""
    for pattern, value in (config.get(key) or {}).items():
        if re.match(rf"(.*\.)?({pattern})$", module):
            return value
    return default


def _module_of(key: str, label: str) -> tuple[str, str]:
    """(HF module name, "A" or "B") of a PEFT tensor name; refuses what is not plain LoRA."""
    name = key.removeprefix(PEFT_PREFIX)
    if "lora_embedding" in name or re.search(r"(^|\.)(embed_tokens|lm_head)\.", name):
        raise ValueError(f"{label}: adapters on embed_tokens / lm_head are not supported ({key})")
    if "lora_magnitude_vector" in name:
        raise ValueError(f"{label}: DoRA (lora_magnitude_vector, {key}) is not supported")
    match = _KEY.match(name)
    if match is None:
        raise ValueError(f"{label}: tensor {key!r} is not a LoRA A or B weight (only plain LoRA, bias 'none')")
    if ".experts." in match.group(1):
        raise ValueError(f"{label}: LoRA on a mixture of experts' expert weights ({key}) is not supported yet")
    return match.group(1), match.group(2)


def _check_shapes(module: str, a: np.ndarray, b: np.ndarray, hf: tuple[int, int], rank: int, label: str) -> None:
    out, inputs = hf
    for which, tensor, want in (("A", a, (rank, inputs)), ("B", b, (out, rank))):
        if tensor.shape != want:
            raise ValueError(f"{label}: {PEFT_PREFIX}{module}.lora_{which}.weight has shape {tuple(tensor.shape)}; "
                             f"the base model's {module} needs {want}")


def slot_arrays(adapter: LoRAAdapter, targets: list[LoRATarget], rank: int, dtype) -> dict[str, tuple]:
    """The adapter as one device slot's arrays: per target, (A, (B per part)) as
    `LoRATarget.slot_shapes` says, zeros where it adapts nothing."""
    out = {}
    for t in targets:
        a_shape, b_shapes = t.slot_shapes(rank)
        a, bs = np.zeros(a_shape, np.float32), [np.zeros(shape, np.float32) for shape in b_shapes]
        for row, modules in enumerate(t.modules):
            for p, module in enumerate(modules):
                if module not in adapter.weights:
                    continue
                lora_a, lora_b = adapter.weights[module]
                r = lora_a.shape[0]
                a[row, p * rank : p * rank + r] = lora_a.reshape(r, *t.inputs)
                repeats = t.part_hf[p][0] // lora_b.shape[0]  # (K/V heads repeated over devices)
                heads = lora_b.reshape(t.part_out[p][0] // repeats, *t.part_out[p][1:], r)
                bs[p][row, ..., :r] = np.repeat(heads, repeats, axis=0)
        out[t.name] = (a.astype(dtype), tuple(b.astype(dtype) for b in bs))
    return out

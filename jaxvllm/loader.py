"""Load a local HF checkpoint (config.json + safetensors) into a params pytree of jax arrays."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import re
from functools import partial
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P, SingleDeviceSharding
from safetensors import SafetensorError, safe_open

from jaxvllm.config import DTYPES, LOAD_FORMATS
from jaxvllm.dummy import missing_model_message
from jaxvllm.interrupts import ProgressBar
from jaxvllm.layers import InputMajorWeight
from jaxvllm.model_config import SIDE_BY_SIDE, ModelConfig
from jaxvllm.models import MODELS
from jaxvllm.models.common import ParamSpec, merge_parts, merged
from jaxvllm.quantization import (EXPERTS, QUANTIZED, CheckpointFormat, QuantizedWeight, check_expert_format,
                                  checkpoint_format, in_axes, online_method, quantize_in_place, quantize_params,
                                  single_device_kernels)
from jaxvllm.sharding import kv_repeats, param_shardings, replicated, sharded_config
from jaxvllm.stored_tensors import RAW_DTYPES, RawSlice, RowRepeat, act_order, packed_view, safetensors_header

logger = logging.getLogger(__name__)

# The engine's dtype names (config.DTYPES) as JAX dtypes.
JNP_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
_INDEX_FILE = "model.safetensors.index.json"


# vLLM reads EAGLE heads in the `speculators` library's format (config.json's speculators_config;
# RedHatAI's *-speculator.eagle3), also given as the model itself; jaxvllm does not yet.
SPECULATORS_FORMAT = ("{!r} is an EAGLE head in the speculators format (config.json has speculators_config), which "
                      "jaxvllm does not read: give the target as the model and a head in the EAGLE authors' layout as "
                      "speculative_config={{'method': 'eagle3', 'model': ...}}")


def load_config(model: str | Path, hf_overrides: dict[str, Any] | Callable | None = None) -> ModelConfig:
    """Read `config.json` with transformers' AutoConfig; never touches the network.
    `hf_overrides` (vLLM's): fields set on the HF config (a dict value updates a nested
    config such as text_config field by field), or a function from config to config."""
    from transformers import AutoConfig

    path = Path(model)
    if not path.is_dir():
        raise FileNotFoundError(missing_model_message(str(path)))
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"no config.json in {str(path)!r}")
    if b'"speculators_config"' in (path / "config.json").read_bytes():
        raise ValueError(SPECULATORS_FORMAT.format(str(path)))
    try:
        hf_config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    except Exception as e:  # transformers raises several types for a bad or unknown config
        raise ValueError(f"cannot read {path / 'config.json'}: {e}") from e
    if getattr(hf_config, "quantization_config", None) is None and (quant := quantization_config(path)) is not None:
        hf_config.quantization_config = quant
    if callable(hf_overrides):
        hf_config = hf_overrides(hf_config)
    elif hf_overrides:
        _override(hf_config, hf_overrides)
    return ModelConfig.from_hf(hf_config)


def quantization_config(path: Path) -> dict | None:
    """A checkpoint's quantization config: config.json's `quantization_config`, else the file
    that older AutoGPTQ (quantize_config.json) and AutoAWQ (quant_config.json) uploads keep
    it in, which vLLM reads too; its method, where the file does not say it, is its writer's
    (AutoAWQ's names its fields w_bit, q_group_size, zero_point)."""
    quant = json.loads((path / "config.json").read_text()).get("quantization_config")
    if quant is not None:
        return quant
    for name in ("quantize_config.json", "quant_config.json"):
        if (path / name).is_file():
            try:
                quant = json.loads((path / name).read_text())
            except ValueError as e:
                raise ValueError(f"{path / name} is not valid JSON: {e}") from e
            if not isinstance(quant, dict):
                raise ValueError(f"{path / name} must hold a JSON object, got {quant!r}")
            if "quant_method" not in quant:
                awq = name == "quant_config.json" or {"w_bit", "q_group_size", "zero_point"} & set(quant)
                quant = {**quant, "quant_method": "awq" if awq else "gptq"}
            return quant
    return None


def _override(hf_config, overrides: dict[str, Any]) -> None:
    from transformers import PretrainedConfig

    for key, value in overrides.items():
        nested = getattr(hf_config, key, None)
        if isinstance(nested, PretrainedConfig) and isinstance(value, dict):
            _override(nested, value)
        elif key in ("rope_theta", "rope_scaling", "rope_parameters") and \
                isinstance(getattr(hf_config, "rope_parameters", None), dict):
            _override_rope(hf_config, key, value)
        else:
            setattr(hf_config, key, value)


def _override_rope(hf_config, key: str, value: Any) -> None:
    """vLLM's RoPE overrides on a transformers 5 config, which keeps theta and scaling in one
    `rope_parameters` dict (one per layer type for Gemma 3: the overrides are the global
    layers'): `rope_theta` sets the theta, and `rope_scaling` / `rope_parameters` replace the
    scaling and keep the theta unless they give one. (Set as attributes, the first was
    ignored and the others lost the theta.)"""
    params = {k: dict(v) if isinstance(v, dict) else v for k, v in hf_config.rope_parameters.items()}
    per_layer_type = "full_attention" in params or "sliding_attention" in params
    if per_layer_type and key == "rope_parameters" and isinstance(value, dict) and \
            ("full_attention" in value or "sliding_attention" in value):
        for layer_type, given in value.items():
            params[layer_type] = {"rope_theta": params.get(layer_type, {}).get("rope_theta"), **given}
        hf_config.rope_parameters = params
        return
    target = params.setdefault("full_attention", {}) if per_layer_type else params
    if key == "rope_theta":
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise ValueError(f"hf_overrides rope_theta must be a positive number, got {value!r}")
        target["rope_theta"] = value
    else:
        scaling = {"rope_theta": target.get("rope_theta"), **(value or {})}
        if "rope_type" not in scaling and "type" not in scaling:
            scaling["rope_type"] = "default"
        target.clear()
        target.update(scaling)
    hf_config.rope_parameters = params


def resolve_dtype(dtype: str, cfg: ModelConfig):
    name = cfg.dtype if dtype == "auto" else dtype
    if name not in DTYPES:
        what = f"the checkpoint's dtype {name!r} (dtype='auto')" if dtype == "auto" else f"dtype {dtype!r}"
        raise ValueError(f"{what} is not supported; choose from 'auto', {', '.join(DTYPES)}")
    return JNP_DTYPES[name]


def load_model(
    model: str | Path,
    *,
    dtype: str = "auto",
    load_format: str = "auto",
    seed: int = 0,
    mesh: Mesh | None = None,
    device=None,
    expert_parallel: bool = False,
    stack_layers: bool | None = None,
    quantization: str | None = None,
    hf_overrides: dict[str, Any] | Callable | None = None,
    use_tqdm: bool = True,
) -> tuple[ModelConfig, dict]:
    """Return (config, params) with params in `dtype` ("auto" = the checkpoint's dtype),
    split over `mesh` as `jaxvllm.sharding` says (None: all on `device`, default the first); the
    config is the one the split model runs with (KV heads repeated up to the device count
    when fewer; a mixture of experts' experts split whole over the mesh if `expert_parallel`).

    load_format "dummy" builds random weights from config.json alone, for benchmarks.
    `stack_layers` (`ModelConfig.stack_layers`; None: as `stacks_layers` says for the
    devices): each kind of layer weight one array over the layers, or one per layer, and
    then q/k/v and gate/up merged (`ModelConfig.merge_projections`). `quantization` "fp8":
    the layers' linear weights quantized as they load (`jaxvllm.quantization`).
    `hf_overrides`: as `load_config`'s.
    """
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format {load_format!r} is not supported; choose from {LOAD_FORMATS}")
    cfg = load_config(model, hf_overrides)
    quantization = online_method(quantization, cfg)
    fmt = None
    if cfg.quant_method is not None:
        if load_format == "dummy":
            raise ValueError(f"load_format='dummy' of a quantized checkpoint ({model}) is not supported; for random "
                             f"fp8 weights, load a full-precision config with quantization='fp8'")
        fmt = checkpoint_format(quantization_config(Path(model)), str(model))
        check_expert_format(cfg, fmt)
        if fmt.value_name == "qweight":
            fmt = _stored_unquantized(fmt, tensor_files(Path(model)), model)
    target = device or (mesh.devices.flat[0] if mesh is not None else jax.devices()[0])
    stack = stacks_layers(target) if stack_layers is None else stack_layers
    cfg = dataclasses.replace(cfg, stack_layers=stack, merge_projections=not stack)  # (the CPU layout: both)
    jdtype = resolve_dtype(dtype, cfg)
    run_cfg = sharded_config(cfg, 1 if mesh is None else mesh.size, expert_parallel)
    if fmt is not None:  # quantized values, their scales (and zero points), joined into QuantizedWeights once placed
        specs = quantized_specs(MODELS[cfg.architecture].param_specs(cfg), fmt)
        _check_expert_blocks(cfg, specs, fmt, 1 if mesh is None else mesh.size, expert_parallel)
        run_specs = quantized_specs(MODELS[cfg.architecture].param_specs(run_cfg), fmt)
        shardings = _param_shardings(run_cfg, mesh, device, run_specs)
        extra = module_tensors(Path(model), fmt)
        leaves = layer_leaves(specs, extra, fmt)
        params = load_safetensors(Path(model), cfg, jdtype, shardings, kv_repeats(cfg, run_cfg), specs, fmt=fmt,
                                  perms=extra.get("perm"), use_tqdm=use_tqdm)
        with _freed_on_failure(params):
            params = join_quantized(params, specs, fmt, leaves)
            return run_cfg, single_device_kernels(params) if mesh is None else params
    shardings, repeats = _param_shardings(run_cfg, mesh, device), kv_repeats(cfg, run_cfg)
    # The CPU layout's layer matrices inputs first (not those the online quantizer takes).
    input_major = not stack and quantization is None
    if load_format == "dummy":
        params = dummy_params(cfg, jdtype, seed, shardings, repeats, input_major=input_major, use_tqdm=use_tqdm)
    else:
        params = load_safetensors(Path(model), cfg, jdtype, shardings, repeats, input_major=input_major,
                                  use_tqdm=use_tqdm)
    if quantization is not None:
        with _freed_on_failure(params):  # (the dict is quantized in place: what it holds at the failure goes)
            params = quantize_params(params, MODELS[cfg.architecture].param_specs(cfg),
                                     partial(quantize_in_place, method=quantization))
            params = single_device_kernels(params) if mesh is None else params
    return run_cfg, params


def _stored_unquantized(fmt: CheckpointFormat, files: dict[str, Path], model: str | Path) -> CheckpointFormat:
    """GPTQ and AWQ: the modules a checkpoint stores as a plain `weight` (no `qweight`) stay
    full precision, the others are read quantized: the files decide, as vLLM decides GPTQ's
    from their dtypes (optimum's modules_in_block_to_quantize, GPTQModel's skipped modules),
    whatever AWQ's modules_to_not_convert says (its writer and vLLM match it as a part of the
    name: "gate" is also every gate_proj). A checkpoint with no `qweight` at all is refused."""
    if not any(name.endswith(".qweight") for name in files):
        raise ValueError(f"{model}: the checkpoint's quantization config is {fmt.method.upper()}, but it holds "
                         f"no quantized weight (no *.qweight tensor)")
    return dataclasses.replace(fmt, unquantized=frozenset(
        name.removesuffix(".weight") for name in files
        if name.endswith(".weight") and name.removesuffix(".weight") + ".qweight" not in files))


def _check_expert_blocks(cfg: ModelConfig, specs: list[ParamSpec], fmt: CheckpointFormat, tp: int,
                         expert_parallel: bool) -> None:
    """Block scales of the experts' down projection (`specs`: the quantized checkpoint's),
    whose inputs each device holds a slice of under tensor parallelism (not expert
    parallelism), must not straddle two devices' slices."""
    down = next((spec for spec in specs if spec.path[-1] == "experts_down_scale"), None)
    size = 0 if down is None else spec_format(down, fmt).block[1]
    if tp > 1 and not expert_parallel and size and (cfg.moe_intermediate_size // tp) % size:
        raise ValueError(f"experts_down: blocks of {size} inputs straddle the split of moe_intermediate_size "
                         f"{cfg.moe_intermediate_size} over {tp} devices ({cfg.moe_intermediate_size // tp} each); "
                         f"use enable_expert_parallel, or a tensor_parallel_size that splits whole blocks")


def stacks_layers(device) -> bool:
    """Whether layer weights are stacked on `device`'s platform: not on a CPU, where XLA
    copies each layer's slice out of the stack on every step, which costs more than the
    dispatch the stacks save (docs/design.md has the figures)."""
    return device.platform != "cpu"


def tensor_files(path: Path) -> dict[str, Path]:
    """Map each tensor name to its file, from the index (sharded) or the files' headers."""
    index = path / _INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
                raise ValueError("its weight_map must map each tensor name to a file name")
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{index} is not a valid safetensors index: {e!r}") from e
        files = {name: path / file for name, file in weight_map.items()}
        for file in sorted(set(files.values())):
            if not file.is_file():
                raise FileNotFoundError(f"{index} lists {file.name}, which is missing from {path}")
        return files
    shards = sorted(path.glob("*.safetensors"))
    if not shards:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    files = {}
    for file in shards:
        with open_safetensors(file) as f:
            files.update(dict.fromkeys(f.keys(), file))
    return files


def checkpoint_tensors(path: str | Path) -> list[tuple[str, np.ndarray]]:
    """Every tensor of a folder of safetensors files, as (HF name, host array) pairs: a
    trainer's save, to push into a running engine."""
    by_file: dict[Path, list[str]] = {}
    for name, file in tensor_files(Path(path)).items():
        by_file.setdefault(file, []).append(name)
    pairs = []
    for file, names in by_file.items():
        with open_safetensors(file) as f:
            pairs += [(name, f.get_tensor(name)) for name in names]
    return pairs


def open_safetensors(file: Path):
    try:  # numpy (bfloat16 through ml_dtypes): slices stay on the host until placed on their device
        return safe_open(str(file), framework="numpy")
    except (SafetensorError, OSError) as e:
        raise ValueError(f"cannot read safetensors file {file}: {e}") from e


def load_safetensors(path: Path, cfg: ModelConfig, dtype, shardings: dict, repeats: int = 1,
                     specs: list | None = None, read_elsewhere: frozenset = frozenset(),
                     fmt: CheckpointFormat | None = None, perms: dict | None = None,
                     input_major: bool = False, use_tqdm: bool = True) -> dict:
    """Each device reads only its slice of each tensor (safetensors `get_slice`), so no
    tensor is ever whole on one device, nor in host memory when it is split; a stack of
    layers is read layer by layer into each device's block. `specs`: the params to read
    (default: those of `cfg`'s architecture); `read_elsewhere`: other tensors the caller
    knows of (not reported as unused); `fmt`: a quantized checkpoint's format, whose packed
    tensors are read through `stored_tensors.packed_view` (`perms`: act-order modules');
    `input_major`: the layers' matrices kept in lists (`QUANTIZED`, when not stacked) as
    `InputMajorWeight`s, each block transposed as it is read."""
    specs = specs or MODELS[cfg.architecture].param_specs(cfg)
    files = tensor_files(path)
    tensors = [m for s in specs if s.init != "rows" for m in (s.layers or (s,))]  # one per HF tensor (or expert set)
    # transformers 5's own layout where the checkpoint has it (experts fused), else HF's usual one.
    fused = {s.path for s in tensors if s.fused_name in files and s.hf_names()[0] not in files}
    names = {s.path: [s.fused_name] if s.path in fused else s.hf_names() for s in tensors}
    missing = [name for s in tensors for name in names[s.path] if name not in files]
    quantized = [n for n in missing if fmt is not None and n.endswith(".weight")
                 and any(n.removesuffix(".weight") + f".{f.value_name}" in files for f in fmt.formats())]
    if quantized:  # (a GPTQ lm_head whose config does not say so, say)
        raise ValueError(f"{path}: {quantized[0].removesuffix('.weight')} is quantized in the checkpoint, which jaxvllm "
                         f"does not read for that weight ({len(quantized)} such tensor(s)); it reads quantized linear "
                         f"layers and expert stacks")
    if missing:
        raise ValueError(f"checkpoint {path} is missing tensor(s): {', '.join(missing[:5])}" + (" ..." if len(missing) > 5 else ""))
    unused = set(files) - {name for s in tensors for name in names[s.path]} - {"lm_head.weight"} - read_elsewhere
    unused = {name for name in unused if not KV_SCALE_NAME.fullmatch(name)  # an fp8 KV cache's: load_kv_scales
              and not (fmt is not None and name.endswith(fmt.unused))}  # a format's bookkeeping
    # A scale or index the loader does not read belongs to a weight it reads wrong (a quantized
    # router read as plain values, an act-order it does not apply): refused, not ignored.
    unread = sorted(name for name in unused if name.endswith(_QUANTIZATION_TENSORS))
    if fmt is not None and unread:
        raise ValueError(f"{path}: quantization tensors jaxvllm does not read: {unread[:5]} ({len(unread)} in all); "
                         f"the weights they belong to are not supported quantized")
    if unused:
        logger.warning("ignoring %d tensor(s) not used by %s: %s", len(unused), cfg.architecture, sorted(unused)[:5])
    params: dict = {}
    with contextlib.ExitStack() as stack, ProgressBar(total=len(specs), desc="Loading safetensors",
                                                      dynamic_ncols=True, disable=not use_tqdm) as bar:
        opened: dict[Path, Any] = {}  # each file opened once, when a tensor in it is first read
        headers: dict[Path, tuple[int, dict]] = {}  # (float8 tensors) each file's header parsed once

        def checked_slice(name: str, hf_shape: tuple[int, ...], row_block: int = 0):
            file = files[name]
            if file not in opened:
                opened[file] = stack.enter_context(open_safetensors(file))
            try:
                tensor_slice = opened[file].get_slice(name)
                shape = tuple(tensor_slice.get_shape())
                if tensor_slice.get_dtype() in RAW_DTYPES:
                    if file not in headers:
                        headers[file] = safetensors_header(file)
                    tensor_slice = RawSlice(file, name, *headers[file])
            except SafetensorError as e:
                raise ValueError(f"cannot read tensor {name} from {file}: {e}") from e
            want = (-(-hf_shape[0] // row_block), *hf_shape[1:]) if row_block else hf_shape
            if fmt is not None:  # (a packed tensor checks its stored shape itself)
                tensor_slice = packed_view(fmt.of(name.rsplit(".", 1)[0], strict=False), name, tensor_slice, want, perms)
                shape = tuple(tensor_slice.get_shape())
            if shape != want:
                raise ValueError(f"tensor {name} in {file.name} has shape {shape}, config.json implies {want}")
            return RowRepeat(tensor_slice, row_block, hf_shape[0]) if row_block else tensor_slice

        def reader(spec) -> tuple[tuple[int, ...], Callable]:
            """(global shape, block of an index) of one tensor, or one layer's."""
            # Stacked experts: one HF tensor per expert, from whichever files hold them, or one fused tensor.
            hf_shape = spec.fused_shape if spec.path in fused else spec.hf_shape
            # (a merged parameter's parts: each its own HF shape)
            hf_shapes = [part.hf_shape for part in spec.parts] or [hf_shape] * len(names[spec.path])
            row_blocks = [part.row_block for part in spec.parts] or [spec.row_block] * len(names[spec.path])
            slices = [checked_slice(*args) for args in zip(names[spec.path], hf_shapes, row_blocks)]
            kept = jnp.dtype(spec.dtype) if spec.dtype else dtype  # (a quantized checkpoint's values and scales)
            if spec.parts:
                shape, block = _merged_block(slices, spec, kept, repeats)
            elif spec.stacked and spec.path in fused:
                shape, block = spec.shape, _fused_block(slices[0], spec, kept)
            elif spec.stacked:
                shape, block = spec.shape, _stacked_block(slices, spec, kept)
            else:
                shape, block = _sharded_block(slices[0], spec, kept, repeats if repeated_kv(spec) else 1)
            one = len(slices) == 1
            name = names[spec.path][0] if one else spec.hf_name.format("*")
            where = f" from {files[name]}" if one else ""

            def read(index):
                try:
                    return block(index)
                except SafetensorError as e:
                    raise ValueError(f"cannot read tensor {name}{where}: {e}") from e

            return shape, read

        with _freed_on_failure(params):
            for spec in specs:
                if spec.init == "rows":
                    rows = np.arange(spec.shape[0], dtype=np.int32)
                    value = _placed((spec.shape, rows.__getitem__), shardings[spec.path])
                elif spec.layers and spec.stack:
                    value = _layer_stack([reader(m) for m in spec.layers], shardings[spec.path])
                elif spec.layers and input_major and spec.path[-1] in QUANTIZED:
                    value = [_input_major(reader(m), shardings[m.path], in_axes(m.shape, m.hf_shape))
                             for m in spec.layers]
                elif spec.layers:
                    value = [_placed(reader(m), shardings[m.path]) for m in spec.layers]
                else:
                    value = _placed(reader(spec), shardings[spec.path])
                _put(params, spec.path, value)
                bar.update(1)
    return params


@contextlib.contextmanager
def _freed_on_failure(params: dict):
    """A bad tensor or a Ctrl-C while `params` fills: what was placed is deleted now, not
    when the traceback goes (a notebook keeps the last one)."""
    try:
        yield
    except BaseException:
        for array in jax.tree.leaves(params):
            array.delete()
        raise


def _placed(reader: tuple, sharding) -> jax.Array:
    """One array placed by `sharding` from its reader ((shape, block of an index))."""
    shape, block = reader
    return jax.make_array_from_callback(shape, sharding, block)


def _input_major(reader: tuple, sharding, num_in: int) -> InputMajorWeight:
    """A layer matrix ([*out, *in], from its reader) placed inputs first: each device's
    block read as the weight's own and transposed on the host, so the device never holds
    the weight in both orders."""
    shape, block = reader
    axes, weight_axes = InputMajorWeight.axes(len(shape), num_in), InputMajorWeight.weight_axes(len(shape), num_in)

    def value_block(index: tuple[slice, ...]) -> np.ndarray:
        return np.ascontiguousarray(block(tuple(index[a] for a in weight_axes)).transpose(axes))

    value_shape = tuple(shape[a] for a in axes)
    return InputMajorWeight(jax.make_array_from_callback(value_shape, _permuted(sharding, axes), value_block), num_in)


def _permuted(sharding, axes: tuple[int, ...]):
    """The sharding of an array whose axes are another's in the order `axes`."""
    if not isinstance(sharding, NamedSharding):
        return sharding
    spec = (*sharding.spec, *[None] * (len(axes) - len(sharding.spec)))
    return NamedSharding(sharding.mesh, P(*(spec[a] for a in axes)))


def _layer_stack(readers: list, sharding) -> jax.Array:
    """One array [layers, ...] placed by `sharding` (never split on its layer axis), each
    device's block read layer by layer from `readers` ((shape, block) of each layer)."""
    shape = (len(readers), *readers[0][0])

    def block(index: tuple[slice, ...]) -> np.ndarray:
        lo, hi = index[0].indices(shape[0])[:2]
        return np.stack([readers[j][1](index[1:]) for j in range(lo, hi)])

    return jax.make_array_from_callback(shape, sharding, block)


def _param_shardings(cfg: ModelConfig, mesh: Mesh | None, device=None, specs: list | None = None) -> dict:
    specs = specs or MODELS[cfg.architecture].param_specs(cfg)
    if mesh is None:
        single = SingleDeviceSharding(device or jax.devices()[0])
        return {path: single for spec in specs for path in (spec.path, *(m.path for m in spec.layers))}
    return param_shardings(specs, cfg, mesh)


def repeated_kv(spec) -> bool:
    """K/V projections (and their scales and zero points) are repeated per KV head when there
    are fewer KV heads than devices."""
    return spec.path[-1].removesuffix("_scale").removesuffix("_zero") in ("k_proj", "v_proj", "k_bias", "v_bias")


def _sharded_block(tensor_slice, spec, dtype, repeats: int) -> tuple[tuple[int, ...], Callable]:
    """(global shape, block of an index) of a parameter, each device's block read from the
    file alone.

    Our shape is the HF shape with at most one axis split into (heads, head_dim), heads
    first (see `param_specs`): heads [a:b] are HF rows (or columns) [a*hd : b*hd]. With
    `repeats` > 1 the first axis counts repeated KV heads: our head h is checkpoint head
    h // repeats."""
    shape = spec.shape
    global_shape = (shape[0] * repeats, *shape[1:])
    split = next((j for j, (a, b) in enumerate(zip(shape, spec.hf_shape)) if a != b), None)

    def block(index: tuple[slice, ...]) -> np.ndarray:
        ranges = [sl.indices(n)[:2] for sl, n in zip(index, global_shape)]
        lo, hi = ranges[0]
        ranges[0] = (lo // repeats, (hi - 1) // repeats + 1)  # the checkpoint's rows of the first axis
        hf_index, local_shape = [], []
        for axis, (a, b) in enumerate(ranges):
            if axis == split:  # heads of a (heads, head_dim) pair: whole head_dim rows of HF's axis
                unit = shape[split + 1]
                hf_index.append(slice(a * unit, b * unit))
            elif split is not None and axis == split + 1:
                if (a, b) != (0, shape[axis]):
                    raise ValueError(f"{spec.hf_name}: head_dim cannot be split")
            else:
                hf_index.append(slice(a, b))
            local_shape.append(b - a)
        local = np.asarray(tensor_slice[tuple(hf_index)]).reshape(local_shape)
        if repeats > 1:
            local = local[np.arange(lo, hi) // repeats - ranges[0][0]]
        return local.astype(dtype)

    return global_shape, block


def _merged_block(slices: list, spec, dtype, repeats: int) -> tuple[tuple[int, ...], Callable]:
    """(global shape, block of an index) of a parameter of several HF tensors (`slices`, one
    per part): each part's block read as its own parameter's would be, then joined."""
    readers = [_sharded_block(s, part, dtype, repeats if repeated_kv(part) else 1) for s, part in zip(slices, spec.parts)]
    if spec.merge == SIDE_BY_SIDE:  # [parts, ...]
        shape = (len(readers), *readers[0][0])

        def block(index: tuple[slice, ...]) -> np.ndarray:
            lo, hi = index[0].indices(shape[0])[:2]
            return merge_parts(spec.merge, [readers[j][1](index[1:]) for j in range(lo, hi)])

        return shape, block
    (q_shape, q_block), (k_shape, k_block), (_, v_block) = readers  # KV_GROUPS
    heads = k_shape[0]  # (repeated up to the devices when fewer: each then has fewer query heads)
    group = q_shape[0] // heads
    shape = (heads, group + 2, *q_shape[1:])

    def block(index: tuple[slice, ...]) -> np.ndarray:
        lo, hi = index[0].indices(heads)[:2]
        if index[1].indices(shape[1])[:2] != (0, shape[1]):
            raise ValueError(f"{spec.hf_name}: a KV head's group cannot be split")
        rest = index[2:]
        return merge_parts(spec.merge, [q_block((slice(lo * group, hi * group), *rest)),
                                        k_block((slice(lo, hi), *rest)), v_block((slice(lo, hi), *rest))])

    return shape, block


def _stacked_block(slices: list, spec, dtype) -> Callable:
    """A block of stacked experts [E, in, out] from HF's per-expert [out, in] tensors
    (`slices`, one per expert): each device reads its experts' blocks only."""

    def block(index: tuple[slice, ...]) -> np.ndarray:
        ranges = [sl.indices(n)[:2] for sl, n in zip(index, spec.shape)]
        (lo, hi), rest = ranges[0], [slice(a, b) for a, b in ranges[1:]]
        hf_index = tuple(reversed(rest))  # our axes (in, out) are HF's (out, in) reversed
        return np.stack([np.asarray(slices[j][hf_index]).T for j in range(lo, hi)]).astype(dtype)

    return block


def _fused_block(tensor_slice, spec, dtype) -> Callable:
    """A block of stacked experts [E, in, out] from transformers 5's fused [E, out (of
    every part), in] tensor, whose rows from `spec.fused_row` are ours: each device reads
    its block only."""

    def block(index: tuple[slice, ...]) -> np.ndarray:
        (e0, e1), (i0, i1), (o0, o1) = [sl.indices(n)[:2] for sl, n in zip(index, spec.shape)]
        row = spec.fused_row
        return np.asarray(tensor_slice[e0:e1, row + o0 : row + o1, i0:i1]).transpose(0, 2, 1).astype(dtype)

    return block


def quantized_specs(specs: list[ParamSpec], fmt: CheckpointFormat) -> list[ParamSpec]:
    """The params of a quantized checkpoint: each linear weight of the layers (`QUANTIZED`, and
    a GPTQ / AWQ router stored quantized), unless `fmt` ignores it, read as its quantized
    type, and beside it its scales (`{name}_scale`) and zero points (`{name}_zero`,
    asymmetric formats) in the weight's layout; `join_quantized` pairs them once loaded."""
    out = []
    for spec in specs:
        members = [p for m in (spec.layers or (spec,)) for p in (m.parts or (m,))]
        names = [name for m in members for name in m.hf_names()]  # (an expert stack's: each expert's)
        ignored = [name for name in names if fmt.ignores(name)]
        router = spec.path[-1] == "router" and fmt.value_name == "qweight"  # (AutoAWQ's Qwen3-MoE: stored so)
        if (spec.path[0] != "layers" or (spec.path[-1] not in QUANTIZED + EXPERTS and not router)
                or len(ignored) == len(names)):
            out.append(spec)
            continue
        if ignored:
            raise ValueError(f"{spec.path[-1]}: the checkpoint keeps {ignored[0]} in full precision (its "
                             f"quantization_config's ignore list, or its tensors) but not every layer's, part's or expert's "
                             f"{spec.path[-1]}; jaxvllm needs all or none of them")
        own = spec_format(spec, fmt)
        size = own.block[1]
        if own.packing in ("gptq", "gptq_v2", "awq") and size and spec.hf_shape[-1] % size:
            raise ValueError(f"{members[0].hf_name}: group_size {size} does not divide its {spec.hf_shape[-1]} "
                             f"inputs, which {own.method.upper()} requires")
        out += [_quantized_values(spec, own), _per_group(spec, own, "scale", own.scale_name)]
        if own.zero_name:
            out.append(_per_group(spec, own, "zero", own.zero_name))
    return out


def spec_format(spec: ParamSpec, fmt: CheckpointFormat) -> CheckpointFormat:
    """The format a quantized param's tensors are stored in: its modules' (`CheckpointFormat.of`;
    in a mixed-precision checkpoint, one for all of its layers, parts and experts)."""
    if not fmt.groups:
        return fmt
    names = [n for m in (spec.layers or (spec,)) for p in (m.parts or (m,)) for n in p.hf_names()]
    found: dict[CheckpointFormat, str] = {}  # each format, and the first name stored in it
    for name in names:
        found.setdefault(fmt.of(name.rsplit(".", 1)[0]), name)
    if len(found) > 1:
        first, other = list(found.values())[:2]
        raise ValueError(f"{spec.path[-1]}: the checkpoint stores {first} and {other} in different quantization "
                         f"schemes (its config_groups); jaxvllm needs one for every layer, part and expert of a weight")
    return next(iter(found))


def _quantized_values(spec: ParamSpec, fmt: CheckpointFormat) -> ParamSpec:
    hf_name = spec.hf_name.replace(".weight", f".{fmt.value_name}")
    return dataclasses.replace(spec, dtype=fmt.value_dtype, hf_name=hf_name,
                               layers=tuple(_quantized_values(m, fmt) for m in spec.layers),
                               parts=tuple(_quantized_values(p, fmt) for p in spec.parts))


def _per_group(spec: ParamSpec, fmt: CheckpointFormat, leaf: str, tensor: str) -> ParamSpec:
    """The spec of a weight's scales or zero points (`leaf`, stored as `{module}.{tensor}`):
    float32 [*out, groups] where the weight is [*out, *in]."""
    path = (*spec.path[:-1], f"{spec.path[-1]}_{leaf}")
    hf_name = spec.hf_name.replace(".weight", f".{tensor}")
    block = (fmt.block[0] or spec.hf_shape[0], fmt.block[1])  # (rows 0: one scale for all of them)
    if spec.parts:
        return dataclasses.replace(merged(path, [_per_group(p, fmt, leaf, tensor) for p in spec.parts], spec.merge),
                                   dtype="float32")
    groups = math.ceil(spec.hf_shape[-1] / block[1]) if block[1] else 1
    if spec.layers:
        layers = tuple(_per_group(m, fmt, leaf, tensor) for m in spec.layers)
        shape = (len(layers), *layers[0].shape) if spec.stack else layers[0].shape
        return dataclasses.replace(spec, path=path, hf_name=hf_name, hf_shape=(spec.hf_shape[0], groups), shape=shape,
                                   layers=layers, dtype="float32", row_block=block[0])
    if spec.stacked:  # an expert stack [E, in, out], read from HF's per-expert [out, in]: [E, groups, out]
        return dataclasses.replace(spec, path=path, hf_name=hf_name, hf_shape=(spec.hf_shape[0], groups),
                                   shape=(spec.shape[0], groups, spec.hf_shape[0]), init="ones", dtype="float32",
                                   row_block=block[0], fused_name=None)
    out = spec.shape[: len(spec.shape) - in_axes(spec.shape, spec.hf_shape)]
    return dataclasses.replace(spec, path=path, hf_name=hf_name, hf_shape=(spec.hf_shape[0], groups),
                               shape=(*out, groups), init="ones", dtype="float32", row_block=block[0])


def module_tensors(path: Path, fmt: CheckpointFormat) -> dict[str, dict[str, np.ndarray]]:
    """A format's small per-module tensors, read whole before the weights, by kind and module
    name: "perm", GPTQ act-order's input permutation (`stored_tensors.act_order`, from
    `g_idx`); "input_scale", a static activation scale ([] float32)."""
    static = next((f.input_scale_name for f in fmt.formats() if f.input_scale_name), None)
    suffixes = {"perm": ".g_idx" if fmt.act_order else None, "input_scale": f".{static}" if static else None}
    out: dict[str, dict[str, np.ndarray]] = {kind: {} for kind, suffix in suffixes.items() if suffix}
    wanted: dict[Path, list[tuple[str, str]]] = {}  # file -> (kind, name), so each file opens once
    for name, file in tensor_files(path).items() if out else ():
        for kind, suffix in suffixes.items():
            if suffix and name.endswith(suffix):
                wanted.setdefault(file, []).append((kind, name))
    for file, names in wanted.items():
        with open_safetensors(file) as f:
            for kind, name in names:
                tensor, module = f.get_tensor(name), name.removesuffix(suffixes[kind])
                out[kind][module] = (act_order(tensor, fmt.block[1], name) if kind == "perm" else
                                     _one_scale(tensor, name))
    return out


def _one_scale(tensor: np.ndarray, name: str) -> np.ndarray:
    if tensor.size != 1:
        raise ValueError(f"tensor {name} has shape {tuple(tensor.shape)}; a static input scale has one value")
    return np.float32(tensor.reshape(()))


def layer_leaves(specs: list[ParamSpec], extra: dict, fmt: CheckpointFormat) -> dict[str, dict[str, list]]:
    """Each quantized weight's act-order permutations and static input scales (`module_tensors`),
    one per layer, by weight name and kind, where its format has them; checked before any
    weight loads (a merged weight's parts must share their permutation, as GPTQ gives
    modules with the same inputs, and take the largest of their input scales, as vLLM does)."""
    out: dict[str, dict[str, list]] = {}
    for spec in specs:
        name = spec.path[-1].removesuffix("_scale")
        if spec.path[0] != "layers" or name == spec.path[-1] or not extra:
            continue
        own = spec_format(spec, fmt)
        kinds = {kind: table for kind, table in extra.items()
                 if (kind == "perm" and own.act_order) or (kind == "input_scale" and own.input_scale_name)}
        layers = spec.layers or (spec,)
        out[name] = {kind: [_layer_leaf(m, kind, table) for m in layers] for kind, table in kinds.items()}
    return out


def _layer_leaf(spec: ParamSpec, kind: str, table: dict):
    modules = [p.hf_name.rsplit(".", 1)[0] for p in (spec.parts or (spec,))]
    missing = [m for m in modules if m not in table]
    if missing:
        raise ValueError(f"checkpoint is missing tensor(s): {missing[0]}.{'g_idx' if kind == 'perm' else kind}")
    if kind == "input_scale":
        return max(table[m] for m in modules)
    for module in modules[1:]:
        if not np.array_equal(table[module], table[modules[0]]):
            raise ValueError(f"{module}.g_idx orders its inputs unlike {modules[0]}.g_idx; jaxvllm merges their "
                             f"weights and needs one act order for them")
    return table[modules[0]]


def join_quantized(params: dict, specs: list[ParamSpec], fmt: CheckpointFormat, leaves: dict | None = None) -> dict:
    """Each quantized weight, its scales and zero points (`quantized_specs`) as one
    `QuantizedWeight`, with its act-order permutation and static input scale (`layer_leaves`)
    placed beside its values, replicated (marked `weight_only` where the format is: 8-bit GPTQ)."""
    layers, leaves = params["layers"], leaves or {}
    for spec in specs:
        name = spec.path[-1].removesuffix("_scale")
        if spec.path[0] != "layers" or name == spec.path[-1]:
            continue
        # (the scales leave `layers` only once the joined weight holds them, and what is placed
        # for the join waits in `layers` too: a Ctrl-C in a device_put here leaves them all
        # where the caller's `_freed_on_failure` deletes them)
        value, scale, zero = layers[name], layers[spec.path[-1]], layers.get(f"{name}_zero")
        own = spec_format(spec, fmt)
        join = partial(QuantizedWeight, group_size=own.block[1], weight_only=own.weight_only)
        more, placing = leaves.get(name, {}), layers.setdefault(f"{name}_placing", [])

        def place(x, like):
            placing.append(jax.device_put(x, _replicated(like)))
            return placing[-1]

        if isinstance(value, list):
            zero = zero or [None] * len(value)
            layers[name] = [join(v, s, zero=z, **{kind: place(per_layer[i], v) for kind, per_layer in more.items()})
                            for i, (v, s, z) in enumerate(zip(value, scale, zero))]
        else:
            placed = {kind: place(np.stack(per_layer) if spec.layers else per_layer[0], value)
                      for kind, per_layer in more.items()}
            layers[name] = join(value, scale, zero=zero, **placed)
        del layers[spec.path[-1]], layers[f"{name}_placing"]
        layers.pop(f"{name}_zero", None)
    return params


def _replicated(array: jax.Array):
    sharding = array.sharding
    return replicated(sharding.mesh) if isinstance(sharding, NamedSharding) else sharding


def dummy_values(key: jax.Array, shape: tuple[int, ...], scale) -> jax.Array:
    """float32 values of mean 0 and standard deviation `scale`, uniform, each a hash of the
    key and its element's index: about ten times cheaper than `jax.random.normal` on a
    CPU (the weights of a dummy model are most of its start-up there), and like it the same
    whatever the split, since every shard's iota counts from its global offset."""
    seed = jax.random.key_data(key).astype(jnp.uint32)
    index = jnp.zeros(shape, jnp.uint32)
    stride = 1
    for axis in reversed(range(len(shape))):  # the row-major index, modulo 2**32
        index = index + jax.lax.broadcasted_iota(jnp.uint32, shape, axis) * jnp.uint32(stride % 2**32)
        stride *= shape[axis]
    x = index * jnp.uint32(0x9E3779B1) + seed[0]  # murmur3's finalizer, the key's second word mixed in
    x = (x ^ (x >> 16)) * jnp.uint32(0x85EBCA6B) ^ seed[1]
    x = (x ^ (x >> 13)) * jnp.uint32(0xC2B2AE35)
    x = x ^ (x >> 16)
    uniform = (x >> 8).astype(jnp.float32) * (1.0 / 2**24) - 0.5  # [-0.5, 0.5): standard deviation 12 ** -0.5
    return uniform * (scale * math.sqrt(12.0))


def _random_param(key, scale, *, shape, dtype, init: str, repeats: int, parts: tuple = (), merge: str = ""):
    """One dummy parameter (jitted by `dummy_params` per placement); a stack of layers'
    from a key per layer (`key` [layers], `shape` one layer's); a merged one's from a key
    per part (`parts`: each one's (shape, init, repeats))."""
    if key.ndim:
        one = partial(_random_param, shape=shape, dtype=dtype, init=init, repeats=repeats, parts=parts, merge=merge)
        return jax.vmap(one, in_axes=(0, None))(key, scale)
    if parts:
        keys = jax.random.split(key, len(parts))
        return merge_parts(merge, [_random_param(k, scale, shape=s, dtype=dtype, init=i, repeats=r)
                                   for k, (s, i, r) in zip(keys, parts)])
    if init == "rows":  # the stacks' row indices (`models.common.stack_layers`)
        return jnp.arange(shape[0], dtype=jnp.int32)
    if init == "normal":
        value = dummy_values(key, shape, scale).astype(dtype)
    else:
        value = (jnp.ones if init == "ones" else jnp.zeros)(shape, dtype)
    return jnp.repeat(value, repeats, axis=0) if repeats > 1 else value


def dummy_params(cfg: ModelConfig, dtype, seed: int = 0, shardings: dict | None = None,
                 repeats: int = 1, specs: list | None = None, input_major: bool = False,
                 use_tqdm: bool = True) -> dict:
    """Random weights of the right shapes (`dummy_values` of the config's initializer_range), made
    on their devices as `shardings` places them (default: one device), the same values
    whatever the split or layout (`input_major`: as `load_safetensors`)."""
    key = jax.random.key(seed)
    params: dict = {}
    specs = specs or MODELS[cfg.architecture].param_specs(cfg)
    shardings = shardings or _param_shardings(cfg, None, specs=specs)
    by_sharding = {}  # one jitted initializer per placement (each caches its shapes)

    def random(key, spec, path, shape):
        sharding = shardings[path]
        if sharding not in by_sharding:
            by_sharding[sharding] = jax.jit(_random_param, out_shardings=sharding,
                                            static_argnames=("shape", "dtype", "init", "repeats", "parts", "merge"))
        parts = tuple((p.shape, p.init, repeats if repeated_kv(p) else 1) for p in spec.parts)
        return by_sharding[sharding](key, cfg.initializer_range, shape=shape, dtype=dtype, init=spec.init,
                                     repeats=repeats if repeated_kv(spec) else 1, parts=parts, merge=spec.merge)

    with _freed_on_failure(params):
        for i, spec in enumerate(ProgressBar(specs, desc="Initializing dummy weights", dynamic_ncols=True, disable=not use_tqdm)):
            key_i = jax.random.fold_in(key, i)
            if spec.layers and spec.stack:  # a key per layer
                keys = jax.vmap(partial(jax.random.fold_in, key_i))(jnp.arange(len(spec.layers)))
                value = random(keys, spec.layers[0], spec.path, spec.shape[1:])
            elif spec.layers:
                value = [random(jax.random.fold_in(key_i, j), m, m.path, m.shape) for j, m in enumerate(spec.layers)]
                if input_major and spec.path[-1] in QUANTIZED:
                    value = [_moved_inputs_first(w, in_axes(m.shape, m.hf_shape), shardings[m.path])
                             for w, m in zip(value, spec.layers)]
            else:
                value = random(key_i, spec, spec.path, spec.shape)
            _put(params, spec.path, value)
    return params


def _moved_inputs_first(weight: jax.Array, num_in: int, sharding) -> InputMajorWeight:
    """A placed layer matrix as an `InputMajorWeight` on its devices (the old array freed)."""
    axes = InputMajorWeight.axes(weight.ndim, num_in)
    value = jax.device_put(jnp.transpose(weight, axes), _permuted(sharding, axes))
    weight.delete()
    return InputMajorWeight(value, num_in)


def _put(params: dict, path: tuple, value) -> None:
    """Set params[path] where int path parts index the list of layers."""
    node = params
    for part, nxt in zip(path[:-1], path[1:]):
        if isinstance(part, str):
            default = [] if isinstance(nxt, int) else {}
            node = node.setdefault(part, default)
        else:  # a layer index: layers are appended in order
            while len(node) <= part:
                node.append({})
            node = node[part]
    node[path[-1]] = value


# The tensors of a quantized checkpoint that say how to read a weight (scales, zero points, group indices).
_QUANTIZATION_TENSORS = (".weight_scale", ".weight_scale_inv", ".scales", ".qzeros", ".g_idx", ".weight_g_idx",
                         ".weight_zero_point")

# The names of an fp8 KV cache's per-layer scales in a checkpoint (float32: one value, or one
# per KV head), as vLLM reads them: its own, ModelOpt's, a merged qkv_proj's, llm-compressor's
# and AutoFP8's (the k/v projections' output scales), and the older kv_scale, for both.
KV_SCALE_NAME = re.compile(r"model\.layers\.(\d+)\.self_attn\.(k_scale|v_scale|kv_scale|k_proj\.k_scale|v_proj\.v_scale|"
                       r"qkv_proj\.k_scale|qkv_proj\.v_scale|k_proj\.output_scale|v_proj\.output_scale)")


def _kv_scale_columns(suffix: str) -> tuple[int, ...]:
    """Which of (k, v) a scale of `KV_SCALE_NAME`'s suffix sets."""
    return (0, 1) if suffix == "kv_scale" else (0,) if suffix.startswith(("k_", "qkv_proj.k")) else (1,)


def load_kv_scales(model: str | Path, run_cfg: ModelConfig) -> tuple[np.ndarray, int]:
    """An fp8 KV cache's scales, float32 [num_layers, num_kv_heads, 2] for the config the
    model runs with (`load_model`'s: KV heads repeated under a mesh with more devices): each
    layer's and KV head's (k_scale, v_scale), from the checkpoint's
    `model.layers.{i}.self_attn.k_scale` / `v_scale` (or another name vLLM reads: `KV_SCALE_NAME`)
    where it has them, else 1.0 (vLLM's default); a layer with only one of them has it for
    both, as vLLM's quantized checkpoints do. A scale holds one value (per tensor) or one per
    KV head of the checkpoint. Returns the scales and how many tensors were read."""
    cfg = load_config(model)
    heads = cfg.num_kv_heads
    scales = np.ones((run_cfg.num_layers, heads, 2), np.float32)
    given = np.zeros((run_cfg.num_layers, 2), bool)
    found = {}
    for name, file in tensor_files(Path(model)).items():
        m = KV_SCALE_NAME.fullmatch(name)
        if m and int(m.group(1)) < run_cfg.num_layers:
            found.setdefault(file, []).append((name, int(m.group(1)), _kv_scale_columns(m.group(2))))
    for file, names in found.items():
        with open_safetensors(file) as f:
            for name, layer, columns in names:
                value = np.asarray(f.get_tensor(name), np.float32).reshape(-1)
                if value.size not in (1, heads):
                    raise ValueError(f"{name} in {file.name} has {value.size} values: a KV cache scale has one, "
                                     f"or one per KV head ({heads})")
                if not (np.isfinite(value) & (value > 0)).all():
                    raise ValueError(f"{name} in {file.name} is {value.tolist()}: a KV cache scale must be positive")
                for column in columns:
                    scales[layer, :, column] = value
                    given[layer, column] = True
    for layer in np.flatnonzero(given.sum(axis=1) == 1).tolist():
        scales[layer, :, ~given[layer]] = scales[layer, :, given[layer]]
    # A repeated KV head keeps its scales (our head h is checkpoint head h // repeats).
    return np.repeat(scales, kv_repeats(cfg, run_cfg), axis=1), sum(map(len, found.values()))

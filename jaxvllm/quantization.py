"""Quantized linear weights: how the params hold them, the checkpoint formats read,
quantizing at load (vLLM's online `quantization="fp8"`), and the matmul that reads them
(`layers.linear` hands them here).

Checkpoint formats read (`CheckpointFormat`): HF's block fp8, compressed-tensors 8-bit
(fp8 or int8 per channel). A quantized weight is a `QuantizedWeight` in the place of the weight: `value` in the
weight's own layout ([*out, *in], heads explicit, as `layers.linear` reads any weight;
stacked [layers, ...] where the weights are) and `scale`, float32 [*out, groups]: one per
output row (channel) and group of `group_size` inputs (one group: the whole row), so a
split of the output axes under tensor parallelism splits the scales alike. A checkpoint's
block scales ([out / 128, in / 128] for HF's fp8) are repeated over their block's rows
when read, so that every format is this one layout.

Online fp8 is W8A8 as vLLM's: weights in float8_e4m3fn, activations quantized per token
on the fly, the product an fp8 x fp8 matmul accumulated in float32, scaled per token and
per channel afterwards. Weights are scaled per channel rather than per tensor (vLLM's
online default): the scale then costs nothing more in the matmul (it multiplies output
columns), and one outlier row no longer coarsens every other row's grid. Embeddings,
norms, biases, the lm_head and the router stay as they were, as in vLLM.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from functools import partial
from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

FP8 = jnp.float8_e4m3fn
FP8_MAX = float(jnp.finfo(FP8).max)  # 448
INT8_HALF_RANGE = 127.5  # (127 - -128) / 2
_TINY = float(jnp.finfo(jnp.float32).tiny)  # (a row of zeros keeps a positive scale)
# The linear weights quantized (any of them a model has; merged or not).
QUANTIZED = ("qkv_proj", "q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj", "gate_proj", "up_proj", "down_proj")


@partial(jax.tree_util.register_dataclass, data_fields=["value", "scale"], meta_fields=["group_size"])
@dataclass(frozen=True)
class QuantizedWeight:
    """A linear weight as fp8 values [*out, *in] and float32 scales [*out, groups] (see the
    module docstring); `value * scale` (each scale over its group) is the weight it stands
    for. `group_size` 0: one scale per row, activations quantized per token; G: a scale per
    G inputs (the last group may be partial), activations quantized per token and group."""

    value: jax.Array
    scale: jax.Array
    group_size: int = 0

    @property
    def shape(self) -> tuple[int, ...]:
        return self.value.shape

    @property
    def ndim(self) -> int:
        return self.value.ndim

    def dequantized(self, dtype=jnp.float32) -> jax.Array:
        """The weight it stands for (tests and oracles; the matmul never builds it)."""
        out = self.scale.shape[:-1]
        value = self.value.reshape(*out, -1).astype(jnp.float32)
        scale = jnp.repeat(self.scale, self.group_size or value.shape[-1], axis=-1)[..., : value.shape[-1]]
        return (value * scale).reshape(self.value.shape).astype(dtype)


@dataclass(frozen=True)
class CheckpointFormat:
    """How a quantized checkpoint stores its linear weights (config.json's
    `quantization_config`): each weight as `value_dtype` [out, in] with float32 scales
    (`{module}.{scale_name}`), one per `block` = (rows, inputs) of the weight (inputs 0: the
    whole row), activations quantized on the fly per token and group of `block[1]` inputs
    (0: per token); the linear layers `ignore` names ("re:" entries are regexes of module
    names) stay full precision.
    - HF fp8 (`quant_method: "fp8"`, transformers' FineGrainedFP8): float8_e4m3fn,
      `weight_scale_inv` per `weight_block_size` block.
    - compressed-tensors `float-quantized` / `int-quantized` (llm-compressor's FP8_DYNAMIC and
      W8A8 int8): float8_e4m3fn or int8, `weight_scale` per channel (block (1, 0))."""

    method: str
    block: tuple[int, int]
    value_dtype: str = "float8_e4m3fn"
    scale_name: str = "weight_scale_inv"
    ignore: tuple[str, ...] = ()

    def ignores(self, hf_name: str) -> bool:
        """Whether the weight `hf_name` stays full precision (its module, or one above it, is ignored)."""
        module = hf_name.removesuffix(".weight")
        return any(re.fullmatch(m[3:], module) if m.startswith("re:") else
                   module == m or module.startswith(m + ".") or module.endswith("." + m) for m in self.ignore)


SUPPORTED_CHECKPOINTS = ("HF fp8 (quant_method 'fp8' with weight_block_size and dynamic activations) and "
                         "compressed-tensors float-quantized / int-quantized (8-bit, weights per channel, "
                         "activations dynamic per token)")


def checkpoint_format(quant_config: dict, model: str) -> CheckpointFormat:
    """The format of a checkpoint's `quantization_config`, or an error naming what is not read."""
    method = quant_config.get("quant_method")
    if method == "compressed-tensors":
        return _compressed_tensors_format(quant_config, model)
    if method != "fp8":
        raise ValueError(f"{model}: quant_method {method!r} in config.json is not supported; jaxvllm reads "
                         f"{SUPPORTED_CHECKPOINTS}")
    block = quant_config.get("weight_block_size")
    if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise ValueError(f"{model}: an fp8 checkpoint's weight_block_size must be two positive ints [rows, inputs], "
                         f"got {block!r} (per-tensor fp8 checkpoints are not read yet)")
    scheme = quant_config.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise ValueError(f"{model}: activation_scheme {scheme!r} is not supported (only 'dynamic')")
    return CheckpointFormat("fp8", (block[0], block[1]), ignore=tuple(quant_config.get("modules_to_not_convert") or ()))


def _compressed_tensors_format(quant_config: dict, model: str) -> CheckpointFormat:
    fmt = quant_config.get("format")
    if fmt not in ("float-quantized", "int-quantized"):
        raise ValueError(f"{model}: compressed-tensors format {fmt!r} is not supported; jaxvllm reads "
                         f"{SUPPORTED_CHECKPOINTS}")
    groups = list((quant_config.get("config_groups") or {}).values())
    if len(groups) != 1:
        raise ValueError(f"{model}: compressed-tensors with {len(groups)} config_groups; jaxvllm reads one")
    weights, inputs = groups[0].get("weights") or {}, groups[0].get("input_activations")
    kind = "float" if fmt == "float-quantized" else "int"
    want = {"num_bits": 8, "type": kind, "strategy": "channel", "symmetric": True}
    got = {key: weights.get(key) for key in want}
    if got != want:
        raise ValueError(f"{model}: compressed-tensors weights {got} are not supported; jaxvllm reads {want}")
    if not inputs or inputs.get("strategy") != "token" or not inputs.get("dynamic") or inputs.get("num_bits") != 8:
        raise ValueError(f"{model}: compressed-tensors input_activations {inputs} are not supported; jaxvllm reads "
                         f"8-bit activations quantized dynamically per token (strategy 'token', dynamic true)")
    return CheckpointFormat("compressed-tensors", (1, 0), "float8_e4m3fn" if kind == "float" else "int8",
                            "weight_scale", tuple(quant_config.get("ignore") or ()))


def check_quantization(quantization: str | None, cfg) -> None:
    """Refuse, before any weight loads, online quantization of a checkpoint that is quantized
    already, and quantized expert stacks (not covered yet)."""
    if cfg.quant_method is not None and quantization is not None:
        raise ValueError(f"quantization={quantization!r}: this checkpoint is quantized already (quant_method "
                         f"{cfg.quant_method!r} in config.json); leave quantization unset to run it as it is")
    if (quantization is not None or cfg.quant_method is not None) and any(cfg.moe_layers):
        raise ValueError(f"{cfg.architecture}: quantized expert stacks are not supported yet; load it without "
                         f"quantization, from a full-precision checkpoint")


def in_axes(shape: tuple[int, ...], hf_shape: tuple[int, ...]) -> int:
    """How many trailing axes of a weight of `shape` make HF's input axis (`hf_shape`
    [out, in]): 1, or 2 where heads are explicit on the input side (o_proj [hidden,
    heads, head_dim])."""
    for n in range(1, len(shape) + 1):
        if math.prod(shape[-n:]) == hf_shape[-1]:
            return n
    raise ValueError(f"a weight of shape {shape} does not end in HF's input axis of {hf_shape}")


def quantize_fp8(weight: jax.Array, num_in: int) -> QuantizedWeight:
    """Per-channel fp8: each output row scaled so that its largest magnitude is fp8's 448."""
    out = weight.shape[: weight.ndim - num_in]
    value, scale = quantize_rows(weight.reshape(*out, -1))
    return QuantizedWeight(value.reshape(weight.shape), scale)


def _scale_sharding(sharding, ndim: int, num_in: int):
    """A weight's scales split as its output axes are (whole along the input's)."""
    if not isinstance(sharding, NamedSharding):
        return sharding
    spec = tuple(sharding.spec) + (None,) * (ndim - len(sharding.spec))
    return NamedSharding(sharding.mesh, P(*spec[: ndim - num_in], None))


def quantize_in_place(weight: jax.Array, num_in: int) -> QuantizedWeight:
    """`quantize_fp8` on the weight's devices, split as it is; the weight is freed."""
    placed = QuantizedWeight(weight.sharding, _scale_sharding(weight.sharding, weight.ndim, num_in))
    quantized = jax.device_put(_jit_quantize_fp8(weight, num_in), placed)
    weight.delete()
    return quantized


_jit_quantize_fp8 = jax.jit(quantize_fp8, static_argnums=1)


def quantize_params(params: dict, specs: list, quantize: Callable = quantize_in_place) -> dict:
    """Online fp8 (`quantization="fp8"`): every linear weight of the layers (`QUANTIZED`) as a
    `QuantizedWeight`, by `quantize(weight, num_in)` (`quantize_fp8` itself for abstract
    params, as the sm_90a check traces them)."""
    layers = params.get("layers", {})
    for spec in specs:
        name = spec.path[-1]
        if spec.path[0] != "layers" or name not in QUANTIZED:
            continue
        num_in = in_axes(spec.shape, spec.hf_shape)
        stack = layers[name]
        layers[name] = [quantize(w, num_in) for w in stack] if isinstance(stack, list) else quantize(stack, num_in)
    return params


def quantize_rows(x: jax.Array, dtype=FP8) -> tuple[jax.Array, jax.Array]:
    """Dynamic quantization of x [..., n] to `dtype` (fp8, or int8 symmetric and rounded): each
    row scaled so that its largest magnitude is half the type's range (448; 127.5 for int8,
    as compressed-tensors defines it, where vLLM's kernels take 127); the rows and their
    float32 scales [..., 1]. The arithmetic is each oracle's, to the last bit, since a last
    bit can move a value across a rounding jump: fp8 multiplies by 448 / amax (XLA may turn
    x / s into x * (1 / s)), int8 divides as compressed-tensors does."""
    x = x.astype(jnp.float32)
    amax = jnp.maximum(jnp.max(jnp.abs(x), axis=-1, keepdims=True), _TINY)
    if jnp.dtype(dtype) == jnp.int8:
        # True divisions, as compressed-tensors computes them: a row's most negative extreme
        # lands on the tie -127.5, which the last bit decides, and XLA turns a division by a
        # constant or a broadcast into a multiplication by its reciprocal unless the divisor
        # is hidden from it.
        scale = amax / jax.lax.optimization_barrier(jnp.full_like(amax, INT8_HALF_RANGE))
        divisor = jax.lax.optimization_barrier(jnp.broadcast_to(scale, x.shape))
        return jnp.clip(jnp.round(x / divisor), -128, 127).astype(jnp.int8), scale
    return jnp.clip(x * (FP8_MAX / amax), -FP8_MAX, FP8_MAX).astype(FP8), amax / FP8_MAX


def quantized_matmul(x2: jax.Array, weight: QuantizedWeight, out_rows: int) -> jax.Array:
    """x2 [T, in] (any float) times a quantized weight, as [T, out_rows] float32: x
    quantized to fp8 per token (and per group of `group_size` inputs), an fp8 x fp8 matmul
    accumulated in float32 per group, each product scaled by its token's and its row's
    scales, the groups summed."""
    wq = weight.value.reshape(out_rows, -1)
    # fp8 products accumulate in float32; int8 ones exactly, in int32
    accumulate = jnp.int32 if wq.dtype == jnp.int8 else jnp.float32
    if not weight.group_size:
        xq, x_scale = quantize_rows(x2, wq.dtype)
        out = jax.lax.dot_general(xq, wq, (((1,), (1,)), ((), ())), preferred_element_type=accumulate)
        return out.astype(jnp.float32) * x_scale * weight.scale.reshape(1, out_rows)
    size, groups = weight.group_size, weight.scale.shape[-1]
    pad = groups * size - wq.shape[-1]  # a partial last group: zeros, which add nothing
    xq, x_scale = quantize_rows(jnp.pad(x2, ((0, 0), (0, pad))).reshape(x2.shape[0], groups, size), wq.dtype)
    wq = jnp.pad(wq, ((0, 0), (0, pad))).reshape(out_rows, groups, size)
    out = jax.lax.dot_general(xq, wq, (((2,), (2,)), ((1,), (1,))), preferred_element_type=accumulate)  # [G, T, O]
    out = out.astype(jnp.float32)
    w_scale = weight.scale.reshape(out_rows, groups).T[:, None, :]
    return jnp.sum(out * jnp.moveaxis(x_scale, 1, 0) * w_scale, axis=0)

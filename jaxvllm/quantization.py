"""Quantized linear weights: how the params hold them, quantizing at load (vLLM's online
`quantization="fp8"`), and the matmul that reads them (`layers.linear` hands them here).

A quantized weight is a `QuantizedWeight` in the place of the weight: `value` in the
weight's own layout ([*out, *in], heads explicit, as `layers.linear` reads any weight;
stacked [layers, ...] where the weights are) and `scale`, float32 [*out, 1]: one per
output row (channel), so a split of the output axes under tensor parallelism splits the
scales alike, and a split of the input axes leaves them whole.

Online fp8 is W8A8 as vLLM's: weights in float8_e4m3fn, activations quantized per token
on the fly, the product an fp8 x fp8 matmul accumulated in float32, scaled per token and
per channel afterwards. Weights are scaled per channel rather than per tensor (vLLM's
online default): the scale then costs nothing more in the matmul (it multiplies output
columns), and one outlier row no longer coarsens every other row's grid. Embeddings,
norms, biases, the lm_head and the router stay as they were, as in vLLM.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

FP8 = jnp.float8_e4m3fn
FP8_MAX = float(jnp.finfo(FP8).max)  # 448
_TINY = float(jnp.finfo(jnp.float32).tiny)  # (a row of zeros keeps a positive scale)
# The linear weights quantized (any of them a model has; merged or not).
QUANTIZED = ("qkv_proj", "q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj", "gate_proj", "up_proj", "down_proj")


@partial(jax.tree_util.register_dataclass, data_fields=["value", "scale"], meta_fields=[])
@dataclass(frozen=True)
class QuantizedWeight:
    """A linear weight as fp8 values [*out, *in] and float32 scales [*out, 1] (see the module
    docstring); `value * scale` is the weight it stands for."""

    value: jax.Array
    scale: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        return self.value.shape

    @property
    def ndim(self) -> int:
        return self.value.ndim

    def dequantized(self, dtype=jnp.float32) -> jax.Array:
        """The weight it stands for (tests and oracles; the matmul never builds it)."""
        scale = self.scale.reshape(self.scale.shape[:-1] + (1,) * (self.value.ndim - self.scale.ndim + 1))
        return (self.value.astype(jnp.float32) * scale).astype(dtype)


def check_quantization(quantization: str | None, cfg) -> None:
    """Refuse, before any weight loads, a checkpoint that is quantized already (not read
    yet: its method is named) and online fp8 of expert stacks (not covered yet)."""
    if cfg.quant_method is not None:
        raise ValueError(f"this checkpoint is quantized (quant_method {cfg.quant_method!r} in config.json): jaxvllm "
                         f"does not read quantized checkpoints yet; load its full-precision original "
                         f"(with quantization='fp8' for fp8 weights)")
    if quantization is not None and any(cfg.moe_layers):
        raise ValueError(f"quantization={quantization!r}: {cfg.architecture}'s expert stacks cannot be quantized "
                         f"yet; load it without quantization")


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
    w = weight.astype(jnp.float32)
    amax = jnp.maximum(jnp.max(jnp.abs(w), axis=tuple(range(w.ndim - num_in, w.ndim))), _TINY)
    value = (w * (FP8_MAX / amax).reshape(amax.shape + (1,) * num_in)).astype(FP8)
    return QuantizedWeight(value, (amax / FP8_MAX)[..., None])


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


def quantized_matmul(x2: jax.Array, weight: QuantizedWeight, out_rows: int) -> jax.Array:
    """x2 [T, in] (any float) times a quantized weight, as [T, out_rows] float32: x
    quantized to fp8 per token (its largest magnitude to 448), an fp8 x fp8 matmul
    accumulated in float32, then each product scaled by its token's and its row's scales."""
    x = x2.astype(jnp.float32)
    amax = jnp.maximum(jnp.max(jnp.abs(x), axis=-1, keepdims=True), _TINY)
    xq = jnp.clip(x * (FP8_MAX / amax), -FP8_MAX, FP8_MAX).astype(FP8)
    x_scale = amax / FP8_MAX
    wq = weight.value.reshape(out_rows, -1)
    out = jax.lax.dot_general(xq, wq, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    return out * x_scale * weight.scale.reshape(1, out_rows)

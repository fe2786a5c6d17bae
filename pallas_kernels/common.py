"""What the Pallas kernels share: interpret-mode choice, the mask value, tile-size rules.

The kernels are written for Pallas' Triton GPU backend (`jax.experimental.pallas` plus
`jax.experimental.pallas.triton` for masked loads and stores). On a CPU they run in
interpret mode, which executes the same kernel body with XLA, one grid step at a time:
slow, but exact enough to test against the plain-jnp references.
"""

from __future__ import annotations

import math
import os

import jax
import jax.numpy as jnp
import numpy as np

# Finite, so that a row whose keys are all masked in one KV tile never produces
# inf - inf = NaN in the online softmax (the same choice as JAX's own Pallas ops).
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)

LOG2_E = math.log2(math.e)
LN_2 = math.log(2.0)

INTERPRET_ENV = "JAXVLLM_PALLAS_INTERPRET"

# tl.dot needs every dimension of its operands to be at least 16 on NVIDIA GPUs.
MIN_DOT_DIM = 16


def default_interpret() -> bool:
    """Interpret unless the default backend is a GPU; `JAXVLLM_PALLAS_INTERPRET=0/1` overrides.

    The override lets the GPU machine run the kernel tests compiled (=0), or debug a
    kernel in interpret mode on a GPU (=1).
    """
    env = os.environ.get(INTERPRET_ENV, "").strip().lower()
    if env in ("0", "false", "no", "off"):
        return False
    if env in ("1", "true", "yes", "on"):
        return True
    return jax.default_backend() not in ("gpu", "cuda", "rocm")


def resolve_interpret(interpret: bool | None) -> bool:
    return default_interpret() if interpret is None else bool(interpret)


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def is_power_of_2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def check_power_of_2(name: str, value: int, interpret: bool) -> None:
    """Triton tensors have power-of-2 sizes; interpret mode does not care."""
    if not interpret and not is_power_of_2(value):
        raise ValueError(f"{name} must be a power of 2 for the compiled Triton kernel, got {value}")


KERNEL_DTYPES = ("float32", "bfloat16", "float16")

# An fp8 KV cache: float8_e4m3fn (vLLM's kv_cache_dtype="fp8") or float8_e5m2 ("fp8_e5m2":
# 2 mantissa bits, a range of +-57344), each value stored as x / scale (k and v scales per
# tensor or per KV head, float32), clipped to the type's finite range.
FP8_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))


def is_fp8(dtype) -> bool:
    return jnp.dtype(dtype) in FP8_DTYPES


def fp8_max(dtype) -> float:
    """The largest finite value of an fp8 type (448 for e4m3, 57344 for e5m2)."""
    return float(jnp.finfo(dtype).max)


def bits_dtype(dtype):
    """The unsigned int type of a narrow float's width (bf16 and f16: uint16, fp8: uint8);
    None for any other type."""
    dtype = jnp.dtype(dtype)
    if not jnp.issubdtype(dtype, jnp.floating) or dtype.itemsize >= 4:
        return None
    return jnp.dtype(f"uint{8 * dtype.itemsize}")


def as_bits(x: jax.Array) -> jax.Array:
    """A narrow float array (`bits_dtype`) as unsigned ints of its width; others as they are.

    XLA:CPU has no 16-bit or 8-bit float scatter or gather: it converts the operand to a
    wider float, and when that operand is the whole KV cache the conversion copies all of
    it, every layer and step. A same-width bitcast is free, so cache writes and page
    gathers move bits instead.
    """
    bits = bits_dtype(x.dtype)
    return x if bits is None else jax.lax.bitcast_convert_type(x, bits)


def from_bits(x: jax.Array, dtype) -> jax.Array:
    """The inverse of `as_bits`: `x` back as `dtype`."""
    return x if x.dtype == jnp.dtype(dtype) else jax.lax.bitcast_convert_type(x, dtype)


def check_dtypes(q, k_cache) -> None:
    """tl.dot multiplies operands of one element type: the cache is q's dtype, or fp8,
    which the kernels convert to q's dtype after each load."""
    if q.dtype != k_cache.dtype and not is_fp8(k_cache.dtype):
        raise ValueError(f"q dtype {q.dtype} != cache dtype {k_cache.dtype} (the cache may also be float8_e4m3fn "
                         "or float8_e5m2)")
    if q.dtype.name not in KERNEL_DTYPES:
        raise ValueError(f"dtype {q.dtype} is not supported; use one of {KERNEL_DTYPES}")


def dot_dtype(q_dtype, cache_dtype):
    """The element type of the decode kernel's dots: q's, except for an fp8 cache under
    bf16 queries, which dots in float16. Every e4m3 and e5m2 value is exact in float16, and
    the sm_90a conversion is one instruction per pair (cvt.rn.f16x2.e4m3x2), where bfloat16
    takes two more (cvt.bf16.f16 per value): with a tile's bytes halved, decode spends its
    time converting. (The ragged kernel, compute-bound, keeps q's dtype: at head_dim 256
    float16 tiles spill there.) Queries go through `to_dot_dtype`."""
    if is_fp8(cache_dtype) and jnp.dtype(q_dtype) == jnp.dtype(jnp.bfloat16):
        return jnp.float16
    return q_dtype


def to_dot_dtype(x, dtype):
    """x in the dots' dtype; bf16 values beyond float16's range are clipped (not inf)."""
    if x.dtype == dtype:
        return x
    if dtype == jnp.float16:
        top = float(jnp.finfo(jnp.float16).max)
        x = jnp.clip(x.astype(jnp.float32), -top, top)
    return x.astype(dtype)


def per_head_scale(scale, num_kv_heads: int, name: str = "scale") -> jax.Array:
    """float32 [num_kv_heads]: a dequantization scale of the cache given per tensor (a
    scalar, traced or not; None: 1.0) or per KV head ([num_kv_heads])."""
    scale = jnp.asarray(1.0 if scale is None else scale, jnp.float32)
    if scale.size not in (1, num_kv_heads) or scale.ndim > 1:
        raise ValueError(f"{name} must be a scalar or [{num_kv_heads}] (one per KV head), got shape {scale.shape}")
    return jnp.broadcast_to(scale.reshape(-1), (num_kv_heads,))


def kv_scales(k_scale, v_scale, num_kv_heads: int) -> jax.Array:
    """float32 [num_kv_heads, 2]: each KV head's (k_scale, v_scale), the dequantization
    scales of the cache (stored value times scale = K/V). Each program of a kernel reads its
    head's row and folds them in: k_scale into the softmax scale (q . (s k) = s (q . k)),
    v_scale into the output (sum p (s v) = s sum p v)."""
    return jnp.stack([per_head_scale(k_scale, num_kv_heads, "k_scale"),
                      per_head_scale(v_scale, num_kv_heads, "v_scale")], axis=1)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# Default tiles, checked on sm_90a by `python -m pallas_kernels.aot_check` (ptxas: no
# spills, shared memory under 227 KiB). A 16 KiB K tile (64 keys of head_dim 128 in bf16)
# with num_stages=3 keeps two K and two V tiles in flight per program and three programs
# per SM; float32 (exact dots, no tensor cores, for parity tests) spills beyond that tile
# and with a third stage.
KV_TILE_BYTES = 16384


def default_block_kv(head_dim: int, dtype, most: int = 128) -> int:
    """Keys per inner step: as many as fit KV_TILE_BYTES, a power of 2 in [16, most]."""
    fit = KV_TILE_BYTES // (head_dim * np.dtype(dtype).itemsize)
    return max(MIN_DOT_DIM, min(most, 1 << max(int(fit).bit_length() - 1, 0)))


def default_num_stages(dtype) -> int:
    """Software-pipeline depth of the KV loop: 3 for 16-bit inputs, 2 for float32."""
    return 2 if np.dtype(dtype).itemsize >= 4 else 3

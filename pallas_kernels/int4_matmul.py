"""W4A16 matmul: activations times 4-bit weights dequantized in registers.

Layout:
  x       [m, k]             float32, bfloat16 or float16
  packed  [n, k // 2] uint8  an int4 weight [n, k], two values a byte: input 2j in the low
                             nibble, 2j + 1 in the high one, two's complement. That is what
                             `jax.lax.bitcast_convert_type(w.reshape(n, k // 2, 2), uint8)`
                             makes of an int4 array: a bitcast, no copy, on a GPU.
  scale   [n, groups] float32   one per output row and group of `group_size` inputs
                                (group_size 0: one group, the whole row)
  zero    [n, groups] float32, or None (zero points 0)
  out     [m, n] float32     x @ ((w - zero) * scale).T

Kernel: grid (m tile, n tile). Each program loops over k in `block_k` steps (a step never
crosses a group: block_k divides group_size). A step loads x's even and odd columns
[block_m, block_k / 2] each and the packed tile [block_n, block_k / 2], splits each byte
into its two nibbles, sign-extends them, dequantizes with the step's group scale and zero
point into x's type, and adds two dots (even inputs, odd inputs) to a float32
accumulator. The weight's bytes stay 4-bit until the registers. Written for Pallas'
Triton backend; `interpret=True` (default on CPU) runs the same body.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import (
    KERNEL_DTYPES,
    MIN_DOT_DIM,
    cdiv,
    check_power_of_2,
    default_num_stages,
    next_power_of_2,
    resolve_interpret,
)

# Default tiles (sm_90a: no spills, `python -m pallas_kernels.aot_check`). Decode has few
# rows: block_m follows m (a power of 2 in [16, 64]) so the weights are read once per
# 64 rows; block_k 128 is GPTQ's and AWQ's usual group.
BLOCK_M_MAX = 64
BLOCK_N = 64
BLOCK_K = 128
NUM_WARPS = 4


def pack_int4(w: jax.Array) -> jax.Array:
    """int4 [n, k] (k even) as the kernel's uint8 [n, k // 2]; any int4 [..., c] (c even) as
    uint8 [..., c // 2] alike, two values a byte along the last axis (`grouped_int4_matmul`'s)."""
    return lax.bitcast_convert_type(w.reshape(*w.shape[:-1], w.shape[-1] // 2, 2), jnp.uint8)


def _signed_nibbles(byte: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(low, high) two's-complement int4 values of uint8 bytes, as int32."""
    b = byte.astype(jnp.int32)
    lo, hi = b & 15, (b >> 4) & 15
    return lo - ((lo >> 3) << 4), hi - ((hi >> 3) << 4)


def _int4_kernel(x_ref, w_ref, scale_ref, *rest, m: int, n: int, group_size: int, block_m: int, block_n: int,
                 block_k: int, steps: int, asymmetric: bool):
    zero_ref, out_ref = rest if asymmetric else (None, rest[0])
    rows = pl.program_id(0) * block_m + jnp.arange(block_m)
    cols = pl.program_id(1) * block_n + jnp.arange(block_n)
    row_ok = None if m % block_m == 0 else (rows < m)[:, None]
    col_ok = None if n % block_n == 0 else cols < n
    half = jnp.arange(block_k // 2)
    precision = lax.Precision.HIGHEST if x_ref.dtype == jnp.float32 else None

    def body(step, acc):
        k0 = step * block_k
        group = k0 // group_size
        x_even = plgpu.load(x_ref.at[rows[:, None], (k0 + 2 * half)[None, :]], mask=row_ok,
                            other=None if row_ok is None else 0)
        x_odd = plgpu.load(x_ref.at[rows[:, None], (k0 + 1 + 2 * half)[None, :]], mask=row_ok,
                           other=None if row_ok is None else 0)
        packed = plgpu.load(w_ref.at[cols[:, None], (k0 // 2 + half)[None, :]],
                            mask=None if col_ok is None else col_ok[:, None])
        scale = plgpu.load(scale_ref.at[cols, group], mask=col_ok, other=None if col_ok is None else 0)[:, None]
        lo, hi = _signed_nibbles(packed)
        lo, hi = lo.astype(jnp.float32), hi.astype(jnp.float32)
        if asymmetric:
            zero = plgpu.load(zero_ref.at[cols, group], mask=col_ok, other=None if col_ok is None else 0)[:, None]
            lo, hi = lo - zero, hi - zero
        w_even, w_odd = (lo * scale).astype(x_ref.dtype), (hi * scale).astype(x_ref.dtype)
        acc += plgpu.dot(x_even, w_even, trans_b=True, precision=precision)
        return acc + plgpu.dot(x_odd, w_odd, trans_b=True, precision=precision)

    acc = lax.fori_loop(0, steps, body, jnp.zeros((block_m, block_n), jnp.float32))
    mask = row_ok if col_ok is None else (col_ok[None, :] if row_ok is None else row_ok & col_ok[None, :])
    plgpu.store(out_ref.at[rows[:, None], cols[None, :]], acc, mask=mask)


def int4_matmul(
    x: jax.Array,
    packed: jax.Array,
    scale: jax.Array,
    zero: jax.Array | None = None,
    *,
    group_size: int = 0,
    block_m: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    interpret: bool | None = None,
) -> jax.Array:
    """x [m, k] @ the int4 weight that `packed` [n, k // 2], `scale` and `zero` [n, groups]
    stand for, transposed: float32 [m, n]; see the module docstring. group_size 0: one group
    a row. block_k (None: min(128, group)) must divide the group; tiles are powers of 2,
    compiled at least 16 (block_k 32: its halves are dots)."""
    interpret = resolve_interpret(interpret)
    if x.ndim != 2 or packed.ndim != 2 or scale.ndim != 2:
        raise ValueError(f"x must be [m, k], packed [n, k // 2] and scale [n, groups], got {x.shape}, "
                         f"{packed.shape} and {scale.shape}")
    m, k = x.shape
    n = packed.shape[0]
    if packed.dtype != jnp.uint8 or packed.shape[1] * 2 != k:
        raise ValueError(f"packed must be uint8 [{n}, {k // 2}] (two int4 inputs a byte) for x {x.shape}, got "
                         f"{packed.dtype}{list(packed.shape)}")
    group = group_size or k
    if k % group:
        raise ValueError(f"group_size {group_size} must divide k {k}")
    if scale.shape != (n, k // group) or (zero is not None and zero.shape != scale.shape):
        raise ValueError(f"scale (and zero) must be [{n}, {k // group}], got {scale.shape}"
                         + ("" if zero is None else f" and {zero.shape}"))
    if x.dtype.name not in KERNEL_DTYPES:
        raise ValueError(f"x dtype {x.dtype} is not supported; use one of {KERNEL_DTYPES}")
    if block_m is None:
        block_m = max(MIN_DOT_DIM, min(BLOCK_M_MAX, next_power_of_2(m)))
    if block_n is None:
        block_n = max(MIN_DOT_DIM, min(BLOCK_N, next_power_of_2(n)))
    if block_k is None:
        block_k = min(BLOCK_K, group)
    num_warps = NUM_WARPS if num_warps is None else num_warps
    num_stages = default_num_stages(x.dtype) if num_stages is None else num_stages
    for name, value in (("block_m", block_m), ("block_n", block_n), ("block_k", block_k)):
        check_power_of_2(name, value, interpret)
    if block_k % 2 or group % block_k:
        raise ValueError(f"block_k {block_k} must be even and divide the group of {group} inputs")
    if not interpret and min(block_m, block_n, block_k // 2) < MIN_DOT_DIM:
        raise ValueError(f"compiled: block_m ({block_m}), block_n ({block_n}) and block_k / 2 ({block_k // 2}) "
                         f"must be >= {MIN_DOT_DIM}")
    if m == 0 or n == 0:
        return jnp.zeros((m, n), jnp.float32)
    kernel = functools.partial(_int4_kernel, m=m, n=n, group_size=group, block_m=block_m, block_n=block_n,
                               block_k=block_k, steps=k // block_k, asymmetric=zero is not None)
    operands = [x, packed, scale.astype(jnp.float32)] + ([] if zero is None else [zero.astype(jnp.float32)])
    whole = [pl.BlockSpec(a.shape, lambda i, j: (0, 0)) for a in operands]
    return pl.pallas_call(
        kernel,
        grid=(cdiv(m, block_m), cdiv(n, block_n)),
        in_specs=whole,
        out_specs=pl.BlockSpec((m, n), lambda i, j: (0, 0)),
        out_shape=jax.ShapeDtypeStruct((m, n), jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="jaxvllm_int4_matmul",
    )(*operands)


def int4_matmul_reference(x: jax.Array, packed: jax.Array, scale: jax.Array, zero: jax.Array | None = None, *,
                          group_size: int = 0) -> jax.Array:
    """The contract in plain jnp: the weight unpacked and dequantized in float32, one matmul."""
    lo, hi = _signed_nibbles(packed)
    w = jnp.stack([lo, hi], axis=-1).reshape(packed.shape[0], -1).astype(jnp.float32)  # [n, k]
    group = group_size or w.shape[1]
    per_input = functools.partial(jnp.repeat, repeats=group, axis=1)
    if zero is not None:
        w = w - per_input(zero)
    w = w * per_input(scale)
    return jnp.dot(x.astype(jnp.float32), w.T, precision=lax.Precision.HIGHEST)

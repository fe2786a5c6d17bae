"""Grouped W4A16 matmul: the experts of a mixture of experts, 4-bit weights dequantized in registers.

The contract of `grouped_matmul` (`jax.lax.ragged_dot`'s: rows sorted by group, group g
owns the next group_sizes[g] rows, rows past the groups' sum are zeros) with the weights of
a weight-only quantized expert stack, as GPTQ, AWQ and compressed-tensors W4A16 store them:
  lhs          [m, k]                  float32, bfloat16 or float16, rows sorted by group
  rhs          [num_groups, k, n // 2] uint8: int4 values [num_groups, k, n], two a byte
                                       along n (column 2c in byte c's low nibble, 2c + 1 in its
                                       high one, two's complement): `pack_int4` of the int4
                                       stack, a bitcast (no copy) on a GPU, since XLA packs an
                                       int4 array's minor axis two a byte
               or [num_groups, k, n] int8: 8-bit values (8-bit GPTQ, W8A16), read as they are
  scale        [num_groups, k // group_size, n] float32   one per group of `group_size`
                                       inputs (0: one group, all k) and output column
  zero         the same shape, or None (zero points 0)
  group_sizes  [num_groups] integer
  out          [m, n] float32 (or `out_dtype`): row r of group g, lhs[r] @ ((w[g] - zero[g]) *
               scale[g]), each scale and zero point over its group of inputs

Kernel: `grouped_matmul`'s schedule of visits (`make_schedule`: a row tile meets only the
weights of the group(s) it intersects) and grid (visit, n tile). Each program loops over k
in block_k steps, block_k dividing group_size, so a step's inputs share one row of scales
and zero points. A step loads the lhs tile [block_m, block_k] once and the weight tile
[block_k, block_n / 2] bytes (int4; int8: [block_k, block_n]), splits each byte into its
two nibbles (sign-extended: the even and the odd columns), dequantizes each in float32
with its columns' scales and zero points, casts it to lhs' type and adds a dot per
nibble to its own float32 accumulator [block_m, block_n / 2]. The even and odd
accumulators are stored to columns 2c and 2c + 1 under the visit's row mask. The weight's
bytes stay 4-bit (8-bit) from memory to the registers: no float copy of the stack is
written. Written for Pallas' Triton backend; `interpret=True` (default on CPU) runs the
same body.
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
from pallas_kernels.grouped_matmul import INT32_MAX, default_block_m, grouped_matmul_reference, make_schedule
from pallas_kernels.int4_matmul import _signed_nibbles, pack_int4

__all__ = ["grouped_int4_matmul", "grouped_int4_matmul_reference", "pack_int4", "unpack_int4"]

# Default tiles for an H100/H200 in bf16 (sm_90a, `python -m pallas_kernels.aot_check
# --kind gmm_int4`: no spills). block_m as grouped_matmul's (the mean rows per group);
# 128 output columns a program (int4: 64 bytes of each of block_k weight rows, two dots
# of 64 columns); block_k 64, or the largest power of 2 dividing a smaller group.
BLOCK_N = 128
BLOCK_K = 64
NUM_WARPS = 4


def unpack_int4(packed: jax.Array) -> jax.Array:
    """uint8 [..., c] (`pack_int4`'s layout) as the int32 values [..., 2 c] it holds."""
    lo, hi = _signed_nibbles(packed)
    return jnp.stack([lo, hi], axis=-1).reshape(*packed.shape[:-1], 2 * packed.shape[-1])


def _gmm_int4_kernel(
    visit_ref,  # [4] int32   (group, row tile, lo, hi) of this visit
    lhs_ref,  # [m, k]
    rhs_ref,  # [num_groups * k, n // parts]   group g's values at rows g * k .. g * k + k - 1
    scale_ref,  # [num_groups * k_groups, n]  group g's at rows g * k_groups ..
    *rest,  # zero_ref (as scale_ref) when asymmetric, out_ref [m, n]
    k: int,
    stored: int,  # rhs' columns: n // parts
    k_groups: int,
    group_size: int,
    parts: int,  # values a byte: 2 (int4) or 1 (int8)
    block_m: int,
    block_n: int,  # rhs columns a program: its output columns / parts
    block_k: int,
    asymmetric: bool,
):
    zero_ref, out_ref = rest if asymmetric else (None, rest[0])
    group, tile, lo, hi = visit_ref[0], visit_ref[1], visit_ref[2], visit_ref[3]
    rows = tile * block_m + jnp.arange(block_m)
    row_ok = ((rows >= lo) & (rows < hi))[:, None]
    cols = pl.program_id(1) * block_n + jnp.arange(block_n)  # rhs columns (bytes for int4)
    col_ok = None if stored % block_n == 0 else cols < stored
    offsets = jnp.arange(block_k)
    first = jnp.maximum(group, 0) * k  # group -1 (zeros): no steps below
    first_scale = jnp.maximum(group, 0) * k_groups
    precision = lax.Precision.HIGHEST if lhs_ref.dtype == jnp.float32 else None

    def per_column(ref, row, part):  # [1, block_n] float32: a scale or zero point row of part's columns
        return plgpu.load(ref.at[row, parts * cols + part], mask=col_ok, other=None if col_ok is None else 0)[None, :]

    def body(step, accs):
        ks = step * block_k + offsets
        a = plgpu.load(lhs_ref.at[rows[:, None], ks[None, :]], mask=row_ok, other=0)
        # (masked columns hold whatever: their dots' columns are never stored)
        b = plgpu.load(rhs_ref.at[(first + ks)[:, None], cols[None, :]],
                       mask=None if col_ok is None else col_ok[None, :])
        row = first_scale + step * block_k // group_size
        values = _signed_nibbles(b) if parts == 2 else (b.astype(jnp.int32),)
        out = []
        for part, (acc, v) in enumerate(zip(accs, values)):
            w = v.astype(jnp.float32)
            if asymmetric:
                w = w - per_column(zero_ref, row, part)
            w = (w * per_column(scale_ref, row, part)).astype(lhs_ref.dtype)
            out.append(acc + plgpu.dot(a, w, precision=precision))
        return tuple(out)

    steps = jnp.where(group >= 0, jnp.int32(k // block_k), jnp.int32(0))
    zeros = tuple(jnp.zeros((block_m, block_n), jnp.float32) for _ in range(parts))
    accs = lax.fori_loop(jnp.int32(0), steps, body, zeros)
    mask = row_ok if col_ok is None else row_ok & col_ok[None, :]
    for part, acc in enumerate(accs):
        plgpu.store(out_ref.at[rows[:, None], (parts * cols + part)[None, :]], acc.astype(out_ref.dtype), mask=mask)


def _largest_power_of_2_dividing(n: int) -> int:
    return n & -n


def grouped_int4_matmul(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
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
    out_dtype=None,
) -> jax.Array:
    """lhs [m, k] (rows sorted by group) times the weight-only stack that `rhs` (uint8
    [num_groups, k, n // 2]: `pack_int4` of int4 values [num_groups, k, n]; or int8
    [num_groups, k, n]), `scale` and `zero` ([num_groups, k // group_size, n] float32)
    stand for, grouped as `jax.lax.ragged_dot`; see the module docstring. group_size 0: one
    group of all k inputs; it must divide k. Out [m, n] in `out_dtype` (None: float32),
    accumulated in float32; the weights are dequantized to lhs' dtype in registers.
    block_m: rows per tile (None: `grouped_matmul`'s, the mean rows per group, a power of 2
    in [16, 64]). block_n: output columns per program (None: 128, cut to n's next power of
    2; int4: even, two dots of block_n / 2). block_k: inputs per step (None: 64, or the
    largest power of 2 dividing the group); it must divide the group. num_warps: None = 4;
    num_stages: None = 3 for 16-bit lhs, 2 for float32. interpret: None = on CPU (or
    `JAXVLLM_PALLAS_INTERPRET=1`). Compiled, the tiles are powers of 2 and each dot's
    dimensions (block_m, block_k, block_n / 2 for int4) at least 16, and every operand
    below 2**31 elements (int32 offsets).
    """
    interpret = resolve_interpret(interpret)
    if lhs.ndim != 2 or rhs.ndim != 3 or scale.ndim != 3:
        raise ValueError(f"lhs must be [m, k], rhs [num_groups, k, n // 2] (or [num_groups, k, n] int8) and scale "
                         f"[num_groups, groups, n], got {lhs.shape}, {rhs.shape} and {scale.shape}")
    m, k = lhs.shape
    num_groups, rhs_k, stored = rhs.shape
    if rhs.dtype not in (jnp.uint8, jnp.int8):
        raise ValueError(f"rhs must be uint8 (int4 values two a byte, `pack_int4`) or int8, got {rhs.dtype}")
    parts = 2 if rhs.dtype == jnp.uint8 else 1
    n = parts * stored
    if rhs_k != k:
        raise ValueError(f"lhs has k={k} but rhs {rhs.shape} has k={rhs_k}")
    if num_groups < 1:
        raise ValueError("rhs must have at least one group")
    if group_sizes.shape != (num_groups,) or not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise ValueError(f"group_sizes must be integer [{num_groups}], got "
                         f"{group_sizes.dtype}{list(group_sizes.shape)}")
    group = group_size or k
    if group < 1 or k % group:
        raise ValueError(f"group_size {group_size} must divide k {k}")
    k_groups = k // group
    if scale.shape != (num_groups, k_groups, n) or (zero is not None and zero.shape != scale.shape):
        raise ValueError(f"scale (and zero) must be [{num_groups}, {k_groups}, {n}], got {scale.shape}"
                         + ("" if zero is None else f" and {zero.shape}"))
    if lhs.dtype.name not in KERNEL_DTYPES:
        raise ValueError(f"lhs dtype {lhs.dtype} is not supported; use one of {KERNEL_DTYPES}")
    out_dtype = jnp.dtype(out_dtype or jnp.float32)
    if out_dtype.name not in KERNEL_DTYPES:
        raise ValueError(f"out_dtype {out_dtype} is not supported; use one of {KERNEL_DTYPES}")
    if block_m is None:
        block_m = default_block_m(m, num_groups)
    if block_n is None:
        block_n = max(parts * MIN_DOT_DIM, min(BLOCK_N, next_power_of_2(n)))
    if block_k is None:
        block_k = min(BLOCK_K, _largest_power_of_2_dividing(group))
    num_warps = NUM_WARPS if num_warps is None else num_warps
    num_stages = default_num_stages(lhs.dtype) if num_stages is None else num_stages
    for name, value in (("block_m", block_m), ("block_n", block_n), ("block_k", block_k)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
        check_power_of_2(name, value, interpret)
    if block_n % parts:
        raise ValueError(f"block_n {block_n} must be even for int4 values (two columns a byte)")
    if group % block_k:
        raise ValueError(f"block_k {block_k} must divide the group of {group} inputs")
    if not interpret:
        if min(block_m, block_n // parts, block_k) < MIN_DOT_DIM:
            raise ValueError(f"compiled: block_m ({block_m}), block_n / {parts} ({block_n // parts}) and block_k "
                             f"({block_k}, dividing the group of {group}) must be >= {MIN_DOT_DIM}")
        if max(rhs.size, scale.size, lhs.size, m * n) > INT32_MAX:
            raise ValueError(f"rhs {rhs.shape}, scale {scale.shape}, lhs {lhs.shape} or out [{m}, {n}] has 2**31 "
                             "elements or more: the kernel's offsets are int32")
    if m == 0 or n == 0:
        return jnp.zeros((m, n), out_dtype)

    schedule = make_schedule(group_sizes, m, block_m)
    kernel = functools.partial(_gmm_int4_kernel, k=k, stored=stored, k_groups=k_groups, group_size=group, parts=parts,
                               block_m=block_m, block_n=block_n // parts, block_k=block_k,
                               asymmetric=zero is not None)
    per_group = [scale.reshape(num_groups * k_groups, n).astype(jnp.float32)]
    per_group += [] if zero is None else [zero.reshape(num_groups * k_groups, n).astype(jnp.float32)]
    operands = [lhs, rhs.reshape(num_groups * k, stored), *per_group]
    return pl.pallas_call(
        kernel,
        # Visits first: the programs that run together share a group's weight tile (L2).
        grid=(schedule.shape[0], cdiv(stored, block_n // parts)),
        in_specs=[pl.BlockSpec((None, 4), lambda v, j: (v, 0))]
        + [pl.BlockSpec(a.shape, lambda v, j: (0, 0)) for a in operands],
        out_specs=pl.BlockSpec((m, n), lambda v, j: (0, 0)),
        out_shape=jax.ShapeDtypeStruct((m, n), out_dtype),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="jaxvllm_grouped_int4_matmul",
    )(schedule, *operands)


def grouped_int4_matmul_reference(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, scale: jax.Array,
                                  zero: jax.Array | None = None, *, group_size: int = 0, out_dtype=None) -> jax.Array:
    """The contract in plain jnp: the stack unpacked and dequantized in float32, then
    `grouped_matmul_reference` of lhs in float32; float32 out unless `out_dtype` says."""
    values = unpack_int4(rhs) if rhs.dtype == jnp.uint8 else rhs.astype(jnp.int32)  # [num_groups, k, n]
    group = group_size or values.shape[1]
    per_input = functools.partial(jnp.repeat, repeats=group, axis=1)
    w = values.astype(jnp.float32)
    if zero is not None:
        w = w - per_input(zero)
    w = w * per_input(scale)
    out = grouped_matmul_reference(lhs.astype(jnp.float32), w, group_sizes)
    return out.astype(out_dtype or jnp.float32)

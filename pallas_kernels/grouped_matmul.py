"""Grouped matmul ("gmm", megablox-style): the experts of a mixture-of-experts layer.

Contract: that of `jax.lax.ragged_dot(lhs, rhs, group_sizes)`:
  lhs          [m, k]                    rows sorted by group
  rhs          [num_groups, k, n]        one weight matrix per group (expert)
  group_sizes  [num_groups] int32        group g owns the next group_sizes[g] rows of lhs
  out          [m, n] in lhs' dtype      row r of group g: lhs[r] @ rhs[g]; rows past
                                         sum(group_sizes) are zeros
(a sum above m is cut at m). XLA expands ragged_dot into a masked product over every group
on CPU and GPU (num_groups times the FLOPs, and [m, num_groups, n]-sized temporaries):
this kernel visits each row tile only with the weights of the group(s) it intersects.

Schedule (plain jnp, on device, `make_schedule`): the rows are cut into tiles of block_m.
A "visit" is (group, row tile, rows [lo, hi)): a tile that lies inside one group is
visited once; a tile that straddles group boundaries once per group it touches, each
visit owning the rows of its group only. The rows past the last group are one more
segment whose visits write zeros. Segments are contiguous, so consecutive segments share
at most one tile: at most cdiv(m, block_m) + num_groups visits, the static grid size;
the unused visits at the end own no rows and do nothing.

Kernel: grid (visit, n tile). Each program reads its visit's (group, tile, lo, hi) from a
small int32 array (as the attention kernels read block tables), loops over k in block_k
chunks (`fori_loop`, float32 accumulator, `num_stages`-deep software pipeline), and
stores its [block_m, block_n] tile with a row mask [lo, hi). Two visits to one tile own
disjoint rows, so their masked stores never touch the same element: no race under
Triton's programming model, and every row of out is written by exactly one program.
Written for Pallas' Triton backend; `interpret=True` (default on CPU) runs the same body.

8-bit operands (float8_e4m3fn or int8, both sides: a W8A8 expert stack and its quantized
rows) are read as they are, each tile converted to float16 in registers (every e4m3 value
and every int8 one is exact in float16) for a float16 dot accumulated in float32, and the
output is float32 (`out_dtype`), for the caller to scale: the weights' bytes stay 8-bit
all the way to the registers.

Block scales (a block-fp8 checkpoint's experts, as Qwen3-30B-A3B-FP8 ships them): with
`lhs_scale` [m, k_blocks] (each row's, per block of `scale_size` inputs: its dynamic
quantization) and `rhs_scale` [num_groups, k_blocks, n] (each group's, per block of
inputs and output column), out[r] = sum over blocks b of (lhs[r, b] @ rhs[g, b]) *
lhs_scale[r, b] * rhs_scale[g, b], float32. block_k divides scale_size, so a k step lies
in one block: its dot is scaled by one scale per row and per column before it is added
to the accumulator. One call does what would otherwise be one grouped matmul per block
(16 for k = 2048 in blocks of 128), each writing an [m, n] float32 partial sum.
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

# Default tiles for an H100/H200 in bf16 (checked on sm_90a by `python -m
# pallas_kernels.aot_check`: no spills). A visit reads a [k, block_n] slice of its group's
# weights whatever its row count, so with few rows per group (decode: T * top_k rows over
# 128 experts) the kernel is bound by weight bandwidth and a tall row tile only wastes
# work: block_m follows the mean rows per group, between 16 (tl.dot's minimum) and 64.
BLOCK_M_MAX = 64
BLOCK_N = 128
BLOCK_K = 64
NUM_WARPS = 4

INT32_MAX = 2**31 - 1
EIGHT_BIT_DTYPES = ("float8_e4m3fn", "int8")  # W8A8 operands (module docstring)


def default_block_m(m: int, num_groups: int) -> int:
    """Row tile: the mean rows per group as a power of 2, in [16, 64]."""
    return max(MIN_DOT_DIM, min(BLOCK_M_MAX, next_power_of_2(cdiv(m, max(num_groups, 1)))))


def max_visits(m: int, num_groups: int, block_m: int) -> int:
    """The static bound on visits: one per row tile plus one per group boundary."""
    return cdiv(m, block_m) + num_groups


def make_schedule(group_sizes: jax.Array, m: int, block_m: int) -> jax.Array:
    """int32 [max_visits, 4]: (group, row tile, lo, hi) of each visit, in row order.

    group -1: rows [lo, hi) past the last group (zeros), or an unused visit (lo = hi = 0).
    """
    num_groups = group_sizes.shape[0]
    ends = jnp.minimum(jnp.cumsum(group_sizes.astype(jnp.int32)), m)
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    # Segments: the groups, then the rows past them.
    seg_start = jnp.concatenate([starts, ends[-1:]])
    seg_end = jnp.concatenate([ends, jnp.full((1,), m, jnp.int32)])
    seg_group = jnp.concatenate([jnp.arange(num_groups, dtype=jnp.int32), jnp.full((1,), -1, jnp.int32)])
    first_tile = seg_start // block_m
    count = jnp.where(seg_end > seg_start, (seg_end - 1) // block_m - first_tile + 1, 0)
    done = jnp.cumsum(count)  # visits up to and including each segment
    v = jnp.arange(max_visits(m, num_groups, block_m), dtype=jnp.int32)
    seg = jnp.minimum(jnp.searchsorted(done, v, side="right", method="compare_all"), num_groups).astype(jnp.int32)
    used = v < done[-1]
    tile = first_tile[seg] + v - (done[seg] - count[seg])
    lo = jnp.maximum(seg_start[seg], tile * block_m)
    hi = jnp.minimum(seg_end[seg], tile * block_m + block_m)
    return jnp.stack([jnp.where(used, seg_group[seg], -1), jnp.where(used, tile, 0),
                      jnp.where(used, lo, 0), jnp.where(used, hi, 0)], axis=1)


def _gmm_kernel(
    visit_ref,  # [4] int32   (group, row tile, lo, hi) of this visit
    lhs_ref,  # [m, k]
    rhs_ref,  # [num_groups * k, n]   group g's weights at rows g * k .. g * k + k - 1
    *rest,  # lhs_scale_ref [m, k_blocks] and rhs_scale_ref [num_groups * k_blocks, n] when scaled, out_ref [m, n]
    k: int,
    n: int,
    block_m: int,
    block_n: int,
    block_k: int,
    scale_size: int,  # inputs a scale block (0: no scales)
):
    lhs_scale_ref, rhs_scale_ref, out_ref = rest if scale_size else (None, None, rest[0])
    group, tile, lo, hi = visit_ref[0], visit_ref[1], visit_ref[2], visit_ref[3]
    eight_bit = lhs_ref.dtype.itemsize == 1  # (converted in registers: see the module docstring)
    rows = tile * block_m + jnp.arange(block_m)
    row_ok = ((rows >= lo) & (rows < hi))[:, None]
    cols = pl.program_id(1) * block_n + jnp.arange(block_n)
    col_ok = None if n % block_n == 0 else (cols < n)[None, :]
    offsets = jnp.arange(block_k)
    first = jnp.maximum(group, 0) * k  # group -1 (zeros): no steps below
    first_block = jnp.maximum(group, 0) * cdiv(k, scale_size) if scale_size else 0
    precision = lax.Precision.HIGHEST if lhs_ref.dtype == jnp.float32 else None

    def both(a, b):
        return a if b is None else b if a is None else a & b

    def body(step, acc):
        ks = step * block_k + offsets
        k_ok = None if k % block_k == 0 else ks < k
        a_mask = both(row_ok, None if k_ok is None else k_ok[None, :])
        b_mask = both(None if k_ok is None else k_ok[:, None], col_ok)
        # (Triton cannot fill masked 8-bit lanes with a constant: they are zeroed once converted)
        a = plgpu.load(lhs_ref.at[rows[:, None], ks[None, :]], mask=a_mask, other=None if eight_bit else 0)
        b = plgpu.load(rhs_ref.at[(first + ks)[:, None], cols[None, :]], mask=b_mask,
                       other=None if b_mask is None or eight_bit else 0)
        if eight_bit:
            a = jnp.where(a_mask, a.astype(jnp.float16), 0)
            b = b.astype(jnp.float16) if b_mask is None else jnp.where(b_mask, b.astype(jnp.float16), 0)
        product = plgpu.dot(a, b, precision=precision)
        if scale_size:  # this step's block: one scale per row and per column
            block = step * block_k // scale_size
            row_scale = plgpu.load(lhs_scale_ref.at[rows, block], mask=row_ok[:, 0], other=0)
            col_scale = plgpu.load(rhs_scale_ref.at[first_block + block, cols],
                                   mask=None if col_ok is None else col_ok[0], other=None if col_ok is None else 0)
            product = product * row_scale[:, None] * col_scale[None, :]
        return acc + product

    steps = jnp.where(group >= 0, jnp.int32(cdiv(k, block_k)), jnp.int32(0))
    acc = lax.fori_loop(jnp.int32(0), steps, body, jnp.zeros((block_m, block_n), jnp.float32))
    plgpu.store(out_ref.at[rows[:, None], cols[None, :]], acc.astype(out_ref.dtype), mask=both(row_ok, col_ok))


def grouped_matmul(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    interpret: bool | None = None,
    out_dtype=None,
    lhs_scale: jax.Array | None = None,
    rhs_scale: jax.Array | None = None,
    scale_size: int = 0,
) -> jax.Array:
    """`jax.lax.ragged_dot(lhs, rhs, group_sizes)` as a grouped matmul; see the module docstring.

    lhs [m, k] and rhs [num_groups, k, n] of one dtype (float32, bfloat16, float16; or 8-bit,
    float8_e4m3fn or int8), group_sizes [num_groups] integer. Out [m, n] in `out_dtype`
    (None: lhs' dtype; float32 for 8-bit operands), accumulated in float32.
    lhs_scale [m, k_blocks] and rhs_scale [num_groups, k_blocks, n] (float32, 8-bit operands
    only, k_blocks = cdiv(k, scale_size)): block scales, applied to each block's product
    (module docstring); block_k must divide scale_size.
    block_m: rows per tile (None: the mean rows per group, a power of 2 in [16, 64]).
    block_n / block_k: output columns per program / k per inner step (None: 128 / 64,
    each cut to the next power of 2 of n / k, at least 16; with block scales, at most the
    largest power of 2 dividing scale_size). num_warps: None = 4.
    num_stages: None = 3 for 16-bit, 2 for float32. interpret: None = on CPU (or
    `JAXVLLM_PALLAS_INTERPRET=1`). Compiled, the tiles must be powers of 2 >= 16, and
    num_groups * k * n below 2**31 (int32 offsets).
    """
    interpret = resolve_interpret(interpret)
    if lhs.ndim != 2 or rhs.ndim != 3:
        raise ValueError(f"lhs must be [m, k] and rhs [num_groups, k, n], got {lhs.shape} and {rhs.shape}")
    m, k = lhs.shape
    num_groups, rhs_k, n = rhs.shape
    if rhs_k != k:
        raise ValueError(f"lhs has k={k} but rhs {rhs.shape} has k={rhs_k}")
    if group_sizes.shape != (num_groups,) or not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise ValueError(f"group_sizes must be integer [{num_groups}], got "
                         f"{group_sizes.dtype}{list(group_sizes.shape)}")
    if lhs.dtype != rhs.dtype:
        raise ValueError(f"lhs dtype {lhs.dtype} != rhs dtype {rhs.dtype}")
    if lhs.dtype.name not in KERNEL_DTYPES + EIGHT_BIT_DTYPES:
        raise ValueError(f"dtype {lhs.dtype} is not supported; use one of {KERNEL_DTYPES + EIGHT_BIT_DTYPES}")
    out_dtype = jnp.dtype(out_dtype or (jnp.float32 if lhs.dtype.name in EIGHT_BIT_DTYPES else lhs.dtype))
    if out_dtype.name not in KERNEL_DTYPES:
        raise ValueError(f"out_dtype {out_dtype} is not supported; use one of {KERNEL_DTYPES}")
    if num_groups < 1:
        raise ValueError("rhs must have at least one group")
    scales = _check_block_scales(lhs, rhs, lhs_scale, rhs_scale, scale_size)
    if m == 0 or n == 0:
        return jnp.zeros((m, n), out_dtype)
    if block_m is None:
        block_m = default_block_m(m, num_groups)
    if block_n is None:
        block_n = max(MIN_DOT_DIM, min(BLOCK_N, next_power_of_2(n)))
    if block_k is None:
        block_k = max(MIN_DOT_DIM, min(BLOCK_K, next_power_of_2(k)))
        block_k = min(block_k, scale_size & -scale_size) if scales else block_k
    if scales and scale_size % block_k:
        raise ValueError(f"block_k {block_k} must divide scale_size {scale_size}")
    if num_warps is None:
        num_warps = NUM_WARPS
    if num_stages is None:
        num_stages = default_num_stages(jnp.float16 if lhs.dtype.name in EIGHT_BIT_DTYPES else lhs.dtype)
    for name, value in (("block_m", block_m), ("block_n", block_n), ("block_k", block_k)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
        check_power_of_2(name, value, interpret)
    if not interpret:
        if min(block_m, block_n, block_k) < MIN_DOT_DIM:
            raise ValueError(f"compiled: block_m ({block_m}), block_n ({block_n}) and block_k ({block_k}) "
                             f"must be >= {MIN_DOT_DIM}")
        if max(rhs.size, lhs.size, m * n) > INT32_MAX:
            raise ValueError(f"rhs {rhs.shape}, lhs {lhs.shape} or out [{m}, {n}] has 2**31 elements or more: "
                             "the kernel's offsets are int32")

    schedule = make_schedule(group_sizes, m, block_m)
    kernel = functools.partial(_gmm_kernel, k=k, n=n, block_m=block_m, block_n=block_n, block_k=block_k,
                               scale_size=scale_size if scales else 0)
    whole = lambda shape: pl.BlockSpec(shape, lambda v, j: (0, 0))  # noqa: E731  (each program indexes it)
    in_specs = [pl.BlockSpec((None, 4), lambda v, j: (v, 0)), whole((m, k)), whole((num_groups * k, n))]
    operands = [schedule, lhs, rhs.reshape(num_groups * k, n)]
    if scales:
        k_blocks = lhs_scale.shape[1]
        in_specs += [whole((m, k_blocks)), whole((num_groups * k_blocks, n))]
        operands += [lhs_scale, rhs_scale.reshape(num_groups * k_blocks, n)]
    return pl.pallas_call(
        kernel,
        # Visits first: the programs that run together share a group's weight tile (L2).
        grid=(schedule.shape[0], cdiv(n, block_n)),
        in_specs=in_specs,
        out_specs=whole((m, n)),
        out_shape=jax.ShapeDtypeStruct((m, n), out_dtype),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="jaxvllm_grouped_matmul",
    )(*operands)


def _check_block_scales(lhs: jax.Array, rhs: jax.Array, lhs_scale: jax.Array | None, rhs_scale: jax.Array | None,
                        scale_size: int) -> bool:
    """Whether block scales are given, checked against the operands (`grouped_matmul`)."""
    if lhs_scale is None and rhs_scale is None:
        return False
    if lhs_scale is None or rhs_scale is None or scale_size < 1:
        raise ValueError("block scales need lhs_scale, rhs_scale and scale_size >= 1 together")
    if lhs.dtype.name not in EIGHT_BIT_DTYPES:
        raise ValueError(f"block scales are for 8-bit operands ({EIGHT_BIT_DTYPES}), got {lhs.dtype}")
    (m, k), (num_groups, _, n) = lhs.shape, rhs.shape
    k_blocks = cdiv(k, scale_size)
    if lhs_scale.shape != (m, k_blocks) or rhs_scale.shape != (num_groups, k_blocks, n):
        raise ValueError(f"lhs_scale must be [{m}, {k_blocks}] and rhs_scale [{num_groups}, {k_blocks}, {n}] "
                         f"(blocks of {scale_size} of k={k}), got {lhs_scale.shape} and {rhs_scale.shape}")
    if lhs_scale.dtype != jnp.float32 or rhs_scale.dtype != jnp.float32:
        raise ValueError(f"block scales must be float32, got {lhs_scale.dtype} and {rhs_scale.dtype}")
    return True


def grouped_matmul_reference(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, out_dtype=None,
                             lhs_scale: jax.Array | None = None, rhs_scale: jax.Array | None = None,
                             scale_size: int = 0) -> jax.Array:
    """The contract in plain jnp: every group's product, masked to its rows, summed.

    num_groups dense products (as XLA's ragged_dot): for tests, not for speed. 8-bit
    operands are taken as float32 (exact), the output float32 unless `out_dtype` says;
    with block scales, each operand times its scales (every input of a block takes the
    block's) before the product.
    """
    if lhs.dtype.itemsize == 1:
        lhs, rhs, out_dtype = lhs.astype(jnp.float32), rhs.astype(jnp.float32), out_dtype or jnp.float32
    if lhs_scale is not None:
        k = lhs.shape[1]
        lhs = lhs * jnp.repeat(lhs_scale, scale_size, axis=1)[:, :k]
        rhs = rhs * jnp.repeat(rhs_scale, scale_size, axis=1)[:, :k]
    m = lhs.shape[0]
    sizes = group_sizes.astype(jnp.int32)
    ends = jnp.cumsum(sizes)
    starts, ends = jnp.minimum(ends - sizes, m), jnp.minimum(ends, m)
    rows = jnp.arange(m)
    out = jnp.zeros((m, rhs.shape[2]), jnp.float32)
    for g in range(rhs.shape[0]):
        mine = (rows >= starts[g]) & (rows < ends[g])
        product = jnp.dot(lhs, rhs[g], precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
        out = out + jnp.where(mine[:, None], product, 0.0)
    return out.astype(out_dtype or lhs.dtype)

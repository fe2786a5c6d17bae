"""Paged decode attention: one query token per sequence, GQA, split-K (flash-decoding).

Decode is a KV-bandwidth problem: every step reads each sequence's whole context once.
The kernel reads each (sequence, KV head) context exactly once, for all G = q heads /
kv heads query heads of that KV head together ([G, D] x [D, block_kv] dots), and splits
the context into `num_splits` partitions so that a small batch still fills the GPU;
a small jnp step then merges the partitions by log-sum-exp (unsplit, the kernel writes
the output itself).

Layout (see `pallas_kernels/__init__.py`):
  q             [S, num_q_heads, head_dim]    query heads h*G .. h*G+G-1 share KV head h
  k/v_cache     [num_kv_heads, num_blocks, block_size, head_dim]
  seq_lens      [S] int32                     context length, the new token's K/V included
  block_tables  [S, max_blocks] int32         physical block ids in logical order
The query of sequence s sits at position `query_positions[s]` (default seq_lens - 1)
and sees keys j with j <= position, j < seq_len (and j > position - sliding_window).
A sequence with seq_len 0 (a padding row) gets zeros.

Grid: (KV head, partition, sequence), KV heads fastest, and sequences longest first:
program row i takes sequence `seq_order[i]` (default: seq_lens sorted descending). The
GPU starts programs in grid order as others finish, so the longest contexts start first
and short ones fill the tail. In a list-scheduling model (not a GPU measurement) of a
decode step of 256 sequences of 100-2048 tokens, 8 KV heads and 528 resident programs,
the step ends 4-6% after the ideal (work / slots), against 19-29% in (sequence, KV head)
order, where the longest contexts of the last heads could start last.

Each program walks its share of the sequence's KV tiles (`block_kv` tokens, any number
of pages) with an online softmax. Page ids are looked up per token inside the kernel
(scalar prefetch of block tables exists on TPU only), so block_size need not divide
block_kv. They are loaded one tile ahead and carried through the loop: a K/V address
that depends on a load in the same iteration keeps Triton's pipeliner from keeping more
than one tile in flight (seen in the sm_90a compile: shared memory stayed at one tile
whatever num_stages), while carried ids let num_stages=3 load the next tiles during the
current one's dots. Written for Pallas'
Triton backend; a Mosaic GPU variant would be another `_call_*` beside `_call_triton`,
same wrapper.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import (
    LN_2,
    LOG2_E,
    MASK_VALUE,
    MIN_DOT_DIM,
    cdiv,
    check_dtypes,
    check_power_of_2,
    default_block_kv,
    default_num_stages,
    dot_dtype,
    is_fp8,
    kv_scales,
    next_power_of_2,
    resolve_interpret,
    to_dot_dtype,
)
from pallas_kernels.ragged_paged_attention import ragged_paged_attention_reference

# Below SPLIT_BELOW_PROGRAMS (sequence x KV head) programs, split each sequence's context
# until about TARGET_PROGRAMS programs keep every SM of an H100/H200 (132 SMs) busy.
SPLIT_BELOW_PROGRAMS = 1024
TARGET_PROGRAMS = 4096
MAX_SPLITS = 16


def _decode_kernel(
    order_ref,  # [S]            the sequence each program row takes
    q_ref,  # [S, G, D]          every sequence's G query heads of this KV head
    k_ref,  # [num_slots, D]     this KV head's cache, slot = block * block_size + offset
    v_ref,  # [num_slots, D]
    bt_ref,  # [S, max_blocks]   the block tables
    len_ref,  # [S]              seq_lens
    pos_ref,  # [S]              query positions
    scale_ref,  # [2] f32        (k_scale, v_scale) of this KV head (1.0 unless fp8)
    o_ref,  # [S, G, D]          this partition's outputs, each normalized by its softmax sum
    #                            (f32; q's dtype when unsplit: then it is the output, no merge)
    m_ref,  # [S, G] f32         partition max score
    l_ref,  # [S, G] f32         partition softmax sum (0: empty partition)
    *,
    sm_scale: float,
    block_size: int,
    block_kv: int,
    block_h: int,
    num_splits: int,
    sliding_window: int | None,
):
    _, group, head_dim = q_ref.shape
    split = pl.program_id(1)
    seq = order_ref[pl.program_id(2)]
    seq_len = len_ref[seq]
    pos = pos_ref[seq]
    hi = jnp.minimum(seq_len, pos + 1)  # keys [lo, hi)
    lo = jnp.int32(0) if sliding_window is None else jnp.maximum(pos - (sliding_window - 1), 0)

    # This partition's share of the sequence's KV tiles, split evenly per sequence, so
    # that short and long sequences alike use every partition.
    first_tile = lax.div(lo, block_kv)
    num_tiles = jnp.maximum(pl.cdiv(hi, block_kv) - first_tile, 0)
    per_split = pl.cdiv(num_tiles, num_splits)
    start = first_tile + split * per_split
    stop = jnp.maximum(jnp.minimum(start + per_split, first_tile + num_tiles), start)

    rows = jnp.arange(block_h)
    dims = jnp.arange(head_dim)
    row_ok = (rows < group)[:, None]
    compute = dot_dtype(q_ref.dtype, k_ref.dtype)
    q = to_dot_dtype(plgpu.load(q_ref.at[seq, rows[:, None], dims[None, :]], mask=row_ok, other=0), compute)
    precision = lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    # Scores in base 2 (exp2 is one instruction), k_scale folded in: q . (s k) = s (q . k).
    # (Both scales read here: v_scale's address kept live through the loop costs registers.)
    k_scale, v_scale = scale_ref[0], scale_ref[1]
    scale = sm_scale * LOG2_E * k_scale
    offsets = jnp.arange(block_kv)

    def pages_of(tile):
        keys = tile * block_kv + offsets
        valid = (keys >= lo) & (keys < hi)
        return plgpu.load(bt_ref.at[seq, lax.div(keys, block_size)], mask=valid, other=0)

    def dequantize(x):  # an fp8 tile, converted in registers; a cache in q's dtype as it is
        return x if x.dtype == compute else x.astype(compute)

    kv_zero = 0.0 if is_fp8(k_ref.dtype) else 0  # Triton casts a float, not an int, to fp8

    def body(tile, carry):
        acc, m_prev, l_prev, page = carry
        keys = tile * block_kv + offsets
        valid = (keys >= lo) & (keys < hi)
        slots = (page * block_size + lax.rem(keys, block_size))[:, None]
        k = dequantize(plgpu.load(k_ref.at[slots, dims[None, :]], mask=valid[:, None], other=kv_zero))
        next_page = pages_of(tile + 1)
        s = plgpu.dot(q, k, trans_b=True, precision=precision) * scale  # [block_h, block_kv] f32
        s = jnp.where(valid[None, :], s, MASK_VALUE)
        m_next = jnp.maximum(m_prev, s.max(axis=1))
        correction = jnp.exp2(m_prev - m_next)
        p = jnp.exp2(s - m_next[:, None])
        l_next = l_prev * correction + p.sum(axis=1)
        v = dequantize(plgpu.load(v_ref.at[slots, dims[None, :]], mask=valid[:, None], other=kv_zero))
        if is_fp8(v_ref.dtype):
            # Keep the conversion where the tile was loaded: Triton otherwise moves it into
            # the dot's operand layout, and reads that transposed fp8 operand from shared
            # memory byte by byte (64 ld.shared.b8 per tile and thread on sm_90a). A select
            # after it is not moved, so V goes through shared memory as float16 and
            # ldmatrix.trans (1104 PTX instructions instead of 1475, 109 registers not 146).
            v = jnp.where(valid[:, None], v, 0)
        acc = acc * correction[:, None] + plgpu.dot(p.astype(v.dtype), v, precision=precision)
        return acc, m_next, l_next, next_page

    init = (
        jnp.zeros((block_h, head_dim), jnp.float32),
        jnp.full((block_h,), MASK_VALUE, jnp.float32),
        jnp.zeros((block_h,), jnp.float32),
        pages_of(start),
    )
    acc, m, l, _ = lax.fori_loop(start, stop, body, init)
    out = acc / jnp.where(l == 0.0, 1.0, l)[:, None] * v_scale  # sum p (s v) = s sum p v
    plgpu.store(o_ref.at[seq, rows[:, None], dims[None, :]], out.astype(o_ref.dtype), mask=row_ok)
    plgpu.store(m_ref.at[seq, rows], m * LN_2, mask=rows < group)  # back to natural log for the combine
    plgpu.store(l_ref.at[seq, rows], l, mask=rows < group)


def default_num_splits(num_seqs: int, num_kv_heads: int, max_tiles: int) -> int:
    """Partitions per sequence: none when (sequence, KV head) programs already fill the GPU,
    else enough for ~TARGET_PROGRAMS programs, never more than KV tiles. Measured on an H200
    (K1, 8 KV heads): 512 programs ran best split 8 ways (1.99 TB/s, 1.38 split 2 ways),
    2048 programs best unsplit (2.48 and 3.56 TB/s at 1024 and 4096 tokens)."""
    programs = max(num_seqs * num_kv_heads, 1)
    if programs >= SPLIT_BELOW_PROGRAMS:
        return 1
    want = next_power_of_2(cdiv(TARGET_PROGRAMS, programs))
    return max(1, min(want, MAX_SPLITS, max_tiles))


def _call_triton(order, q4, k_slots, v_slots, block_tables, seq_lens, positions, scales, *, num_splits, block_h,
                 num_warps, num_stages, interpret, **kernel_args):
    num_seqs, num_kv_heads, group, head_dim = q4.shape
    num_slots = k_slots.shape[1]
    max_blocks = block_tables.shape[1]
    kernel = functools.partial(_decode_kernel, num_splits=num_splits, block_h=block_h, **kernel_args)
    part = (num_seqs, num_kv_heads, num_splits, group)
    out_dtype = q4.dtype if num_splits == 1 else jnp.float32  # unsplit: the output itself
    whole = lambda shape: pl.BlockSpec(shape, lambda h, p, i: (0,) * len(shape))  # noqa: E731
    return pl.pallas_call(
        kernel,
        grid=(num_kv_heads, num_splits, num_seqs),  # in launch order, the first axis fastest
        in_specs=[
            whole((num_seqs,)),
            pl.BlockSpec((num_seqs, None, group, head_dim), lambda h, p, i: (0, h, 0, 0)),
            pl.BlockSpec((None, num_slots, head_dim), lambda h, p, i: (h, 0, 0)),
            pl.BlockSpec((None, num_slots, head_dim), lambda h, p, i: (h, 0, 0)),
            whole((num_seqs, max_blocks)),
            whole((num_seqs,)),
            whole((num_seqs,)),
            pl.BlockSpec((None, 2), lambda h, p, i: (h, 0)),
        ],
        out_specs=[
            pl.BlockSpec((num_seqs, None, None, group, head_dim), lambda h, p, i: (0, h, p, 0, 0)),
            pl.BlockSpec((num_seqs, None, None, group), lambda h, p, i: (0, h, p, 0)),
            pl.BlockSpec((num_seqs, None, None, group), lambda h, p, i: (0, h, p, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((*part, head_dim), out_dtype),
            jax.ShapeDtypeStruct(part, jnp.float32),
            jax.ShapeDtypeStruct(part, jnp.float32),
        ],
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="jaxvllm_paged_decode_attention",
    )(order, q4, k_slots, v_slots, block_tables, seq_lens, positions, scales)


def combine_partitions(o: jax.Array, m: jax.Array, l: jax.Array) -> jax.Array:
    """Merge split-K partitions [..., P, G, D] (each normalized by its own sum l) by log-sum-exp."""
    live = l > 0.0
    m_max = jnp.max(jnp.where(live, m, MASK_VALUE), axis=-2, keepdims=True)
    weight = jnp.where(live, l * jnp.exp(m - m_max), 0.0)  # each partition's share of the total sum
    total = weight.sum(axis=-2)
    out = jnp.einsum("...pg,...pgd->...gd", weight, jnp.where(live[..., None], o, 0.0))
    return out / jnp.where(total == 0.0, 1.0, total)[..., None]


def paged_decode_attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    seq_lens: jax.Array,
    block_tables: jax.Array,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    query_positions: jax.Array | None = None,
    k_scale: jax.Array | float | None = None,
    v_scale: jax.Array | float | None = None,
    seq_order: jax.Array | None = None,
    num_splits: int | None = None,
    block_kv: int | None = None,
    block_h: int | None = None,
    num_warps: int = 4,
    num_stages: int | None = None,
    interpret: bool | None = None,
) -> jax.Array:
    """Decode attention [S, num_q_heads, head_dim] in q's dtype; layout in the module docstring.

    The cache is q's dtype or float8_e4m3fn (an fp8 KV cache), whose tiles are converted
    after each load, to float16 under bf16 queries (`dot_dtype`: the dots then run in
    float16), else to q's dtype; k_scale / v_scale (float32, per tensor: scalars, traced
    or not, or per KV head: [num_kv_heads]; None: 1.0) dequantize it: K = stored * k_scale,
    V = stored * v_scale, folded into the softmax scale and the output.

    seq_order: int32 [S], a permutation of the sequences, the order in which programs take
    them (None: longest first, `jnp.argsort(-seq_lens)`; under jit, XLA computes it once
    for every layer's call on the same seq_lens).
    num_splits: KV partitions per sequence (None: `default_num_splits`, at most 16).
    block_kv: KV tokens per inner step (a power of 2; None: a 16 KiB tile, 64 keys of
    head_dim 128 in bf16, see `default_block_kv`). num_stages: pipeline depth (None: 3 for
    16-bit, 2 for float32). block_h: query rows of a dot,
    G padded up (None: 16 compiled, for tl.dot's minimum; the next power of 2 of G in
    interpret mode). interpret: None = on CPU (or `JAXVLLM_PALLAS_INTERPRET=1`).
    """
    interpret = resolve_interpret(interpret)
    num_seqs, num_q_heads, head_dim = q.shape
    num_kv_heads, num_blocks, block_size, cache_head_dim = k_cache.shape
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"k_cache {k_cache.shape} and v_cache {v_cache.shape} differ")
    if cache_head_dim != head_dim:
        raise ValueError(f"q head_dim {head_dim} != cache head_dim {cache_head_dim}")
    check_dtypes(q, k_cache)
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} q heads are not a multiple of {num_kv_heads} kv heads")
    if seq_lens.shape != (num_seqs,) or block_tables.ndim != 2 or block_tables.shape[0] != num_seqs:
        raise ValueError(
            f"q has {num_seqs} sequences but seq_lens is {seq_lens.shape} and block_tables {block_tables.shape}"
        )
    if query_positions is not None and query_positions.shape != (num_seqs,):
        raise ValueError(f"query_positions must be [{num_seqs}], got {query_positions.shape}")
    if seq_order is not None and seq_order.shape != (num_seqs,):
        raise ValueError(f"seq_order must be [{num_seqs}], got {seq_order.shape}")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
    group = num_q_heads // num_kv_heads
    if block_h is None:
        block_h = next_power_of_2(group) if interpret else max(MIN_DOT_DIM, next_power_of_2(group))
    if block_h < group:
        raise ValueError(f"block_h {block_h} < {group} query heads per KV head")
    if block_kv is None:  # interpret mode: one wide tile per step, whatever the dtype
        block_kv = 128 if interpret else default_block_kv(head_dim, q.dtype)
    if num_stages is None:
        num_stages = default_num_stages(q.dtype)
    check_power_of_2("head_dim", head_dim, interpret)
    check_power_of_2("block_kv", block_kv, False)
    check_power_of_2("block_h", block_h, False)
    if not interpret and min(block_h, block_kv, head_dim) < MIN_DOT_DIM:
        raise ValueError(
            f"compiled: block_h ({block_h}), block_kv ({block_kv}) and head_dim ({head_dim}) must be >= {MIN_DOT_DIM}"
        )
    max_tiles = cdiv(block_tables.shape[1] * block_size, block_kv)
    if num_splits is None:
        num_splits = default_num_splits(num_seqs, num_kv_heads, max_tiles)
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")

    seq_lens = seq_lens.astype(jnp.int32)
    positions = seq_lens - 1 if query_positions is None else query_positions.astype(jnp.int32)
    order = jnp.argsort(-seq_lens, stable=True) if seq_order is None else seq_order
    num_slots = num_blocks * block_size
    o, m, l = _call_triton(
        order.astype(jnp.int32),
        q.reshape(num_seqs, num_kv_heads, group, head_dim),
        k_cache.reshape(num_kv_heads, num_slots, head_dim),  # free: contiguous
        v_cache.reshape(num_kv_heads, num_slots, head_dim),
        block_tables.astype(jnp.int32),
        seq_lens,
        positions,
        kv_scales(k_scale, v_scale, num_kv_heads),
        num_splits=num_splits,
        block_h=block_h,
        num_warps=num_warps,
        num_stages=num_stages,
        interpret=interpret,
        sm_scale=float(sm_scale),
        block_size=block_size,
        block_kv=block_kv,
        sliding_window=sliding_window,
    )
    # Unsplit, each program's output is the answer (empty rows: zeros); else merge (one
    # fewer fusion or two per layer and step without the merge).
    out = o[:, :, 0] if num_splits == 1 else combine_partitions(o, m, l)  # [S, kv_heads, G, D]
    return out.reshape(num_seqs, num_q_heads, head_dim).astype(q.dtype)


def paged_decode_attention_reference(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    seq_lens: jax.Array,
    block_tables: jax.Array,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    query_positions: jax.Array | None = None,
    k_scale: jax.Array | float | None = None,
    v_scale: jax.Array | float | None = None,
) -> jax.Array:
    """The decode contract through the ragged reference (one query token per sequence).

    Rows with seq_len 0 are zeros, as in the kernel.
    """
    num_seqs = q.shape[0]
    positions = seq_lens - 1 if query_positions is None else query_positions
    out = ragged_paged_attention_reference(
        q, k_cache, v_cache, jnp.maximum(positions, 0).astype(jnp.int32),
        jnp.arange(num_seqs + 1, dtype=jnp.int32), seq_lens.astype(jnp.int32), block_tables,
        sm_scale=sm_scale, sliding_window=sliding_window, k_scale=k_scale, v_scale=v_scale,
    )
    return jnp.where((seq_lens > 0)[:, None, None], out, 0).astype(q.dtype)

"""Ragged paged attention: prefill, chunked prefill, decode and mixed batches in one call.

The batch is flat: T query tokens from S sequences, sequence `s` owning tokens
`query_start_loc[s]:query_start_loc[s+1]`. Each token attends causally to its own
sequence's context, read from the paged cache through `block_tables`, which must
already hold the K/V of the tokens being computed (the model writes, then attends).
A decode batch is the case where every sequence has one query token.

Layout: q [T, num_q_heads, head_dim]; k_cache / v_cache
[num_kv_heads, num_blocks, block_size, head_dim] (see `pallas_kernels/__init__.py`);
block_tables [S, max_blocks_per_seq] int32 of physical block ids in logical order.
Query heads `h * G : (h + 1) * G` share KV head `h` (GQA group G = q heads / kv heads).

This file holds the Pallas kernel (`ragged_paged_attention`) and the plain-jnp reference
(`ragged_paged_attention_reference`), the kernel's oracle.

Kernel: flash attention over query tiles of the flat token array. A tile is up to
`block_q` consecutive query tokens of ONE sequence, times the G query heads of one KV
head ([block_q * G, D] rows per dot). A small jnp step lists the tiles of every
sequence (`_tile_metadata`); the grid is (KV head, tile), KV heads fastest in launch
order, with a static upper bound on the tile count (cdiv(T, block_q) + S), idle tiles
exiting at once. Each program walks
its sequence's KV pages up to the causal limit of its last query with an online
softmax; tiles wholly below the diagonal skip the mask. Positions of one sequence's
query tokens are consecutive (the engine's chunks always are): the mask uses the
tile's first position plus the row offset. Page ids are looked up per key inside the
kernel (scalar prefetch is TPU-only), so any block_size works; they are loaded one
tile ahead and carried, so that Triton can pipeline the K/V loads (see the decode
kernel's docstring).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import (
    LOG2_E,
    MASK_VALUE,
    MIN_DOT_DIM,
    as_bits,
    cdiv,
    check_dtypes,
    check_power_of_2,
    default_block_kv,
    default_num_stages,
    from_bits,
    is_fp8,
    kv_scales,
    next_power_of_2,
    per_head_scale,
    resolve_interpret,
)


def _check_shapes(q, k_cache, v_cache, positions, query_start_loc, seq_lens, block_tables):
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, _, _, cache_head_dim = k_cache.shape
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"k_cache {k_cache.shape} and v_cache {v_cache.shape} differ")
    if cache_head_dim != head_dim:
        raise ValueError(f"q head_dim {head_dim} != cache head_dim {cache_head_dim}")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} q heads are not a multiple of {num_kv_heads} kv heads")
    if positions.shape != (num_tokens,):
        raise ValueError(f"positions must be [{num_tokens}], got {positions.shape}")
    num_seqs = seq_lens.shape[0]
    if query_start_loc.shape != (num_seqs + 1,) or block_tables.shape[0] != num_seqs:
        raise ValueError(
            f"query_start_loc {query_start_loc.shape}, seq_lens {seq_lens.shape} and "
            f"block_tables {block_tables.shape} disagree on the number of sequences"
        )


# The reference's working set: query rows per step of its loop over the batch, and keys
# (rounded to whole pages) per step of each chunk's loop over the block-table columns.
# Static loops take 128 tokens a step; XLA:CPU's loops (`dynamic_kv_steps`) take 16 tokens
# (their gathered pages stay in a core's cache) or 128 rows of query blocks (16 blocks of 8).
_REF_QUERY_CHUNK = 128
_REF_CPU_QUERY_CHUNK = 16
_REF_CPU_BLOCK_ROWS = 128
_REF_KV_CHUNK = 128


def ragged_paged_attention_reference(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    positions: jax.Array,
    query_start_loc: jax.Array,
    seq_lens: jax.Array,
    block_tables: jax.Array,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    k_scale: jax.Array | float | None = None,
    v_scale: jax.Array | float | None = None,
    logits_soft_cap: float | None = None,
    dynamic_kv_steps: bool = False,
    query_block: int = 1,
) -> jax.Array:
    """Attention output [T, num_q_heads, head_dim] in q's dtype (softmax in float32).

    Token t (position p in its sequence) sees cache positions j with j <= p and
    j < seq_len, and j > p - sliding_window when a window is set. Rows past
    `query_start_loc[-1]` are padding: their output is finite and meaningless.
    `logits_soft_cap` c turns each scaled score s into c * tanh(s / c) (Gemma's
    soft-capping; the reference only: the Pallas kernels have none).

    The cache is q's dtype or float8_e4m3fn (an fp8 KV cache): fp8 pages are converted to
    q's dtype as they are gathered, and k_scale / v_scale (float32, per tensor: scalars,
    or per KV head: [num_kv_heads]; None: 1.0) dequantize them, K = stored * k_scale and
    V = stored * v_scale, applied (as in the kernels) to the scores and to the output.

    Plain jnp with static loops (unless `dynamic_kv_steps`): `lax.map` over chunks of
    C = min(T, 128) query tokens, each a `lax.scan` over the block-table columns, P = min(max_blocks_per_seq,
    max(1, 128 // block_size)) pages (K = P * block_size keys) per step, with an online
    (running max and sum) float32 softmax. Each step gathers only that step's pages of
    each token's sequence, so the peak intermediates, independent of T and of
    max_blocks_per_seq, are the K and V tiles, 2 * kv_heads * C * K * head_dim elements
    of the cache dtype, plus float32 scores and accumulator,
    num_q_heads * C * (K + head_dim) elements; besides them, q padded to whole chunks
    and the output, T * num_q_heads * head_dim each. At T = 8192 tokens, 32 q / 8 KV
    heads, head_dim 128, block 16, bf16: 64 MiB of tiles + 4 MiB + 2 * 64 MiB
    (XLA:CPU reports 0.19 GiB of temporaries, for any max_model_len), where gathering
    every token's whole context, 2 * kv_heads * T * max_blocks_per_seq * block_size *
    head_dim, took 128 GiB at max_model_len 4096.

    `dynamic_kv_steps`: loops whose trip counts depend on the batch. Only the query chunks
    that hold a real token run, and each runs its KV loop only up to the last column its
    tokens see: a batch of short sequences skips the columns past their ends. For
    XLA:CPU only, which runs loops in its own runtime (no graphs, no host sync). Never on
    a GPU, where such a loop leaves the CUDA graph and syncs with the host every iteration.

    `query_block` B > 1 (with `dynamic_kv_steps`): the tokens run in blocks of up to B
    consecutive tokens of one sequence (`_query_blocks`: cdiv(T, B) + S of them at most),
    the used ones only. A block gathers its sequence's pages once for its B queries, where
    a token alone gathers them for itself: a prefill's gathers shrink B-fold, but a decode
    token, alone in its block, computes B rows for one.
    """
    return _chunked_reference(
        q, k_cache, v_cache, positions, query_start_loc, seq_lens, block_tables,
        sm_scale=sm_scale, sliding_window=sliding_window,
        query_chunk=_REF_CPU_QUERY_CHUNK if dynamic_kv_steps else _REF_QUERY_CHUNK,
        block_rows=_REF_CPU_BLOCK_ROWS, kv_chunk=_REF_KV_CHUNK, k_scale=k_scale, v_scale=v_scale,
        logits_soft_cap=logits_soft_cap, dynamic_kv_steps=dynamic_kv_steps, query_block=query_block,
    )


def _chunked_reference(
    q, k_cache, v_cache, positions, query_start_loc, seq_lens, block_tables,
    *, sm_scale, sliding_window, query_chunk: int, kv_chunk: int, block_rows: int = _REF_CPU_BLOCK_ROWS,
    k_scale=None, v_scale=None, logits_soft_cap: float | None = None, dynamic_kv_steps: bool = False,
    query_block: int = 1,
):
    """`ragged_paged_attention_reference` with the chunk sizes as parameters (tests shrink them)."""
    _check_shapes(q, k_cache, v_cache, positions, query_start_loc, seq_lens, block_tables)
    if query_block > 1 and not dynamic_kv_steps:
        raise ValueError("query_block > 1 needs dynamic_kv_steps (its loop skips the unused blocks)")
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, _, block_size, _ = k_cache.shape
    num_seqs, max_blocks = block_tables.shape
    group = num_q_heads // num_kv_heads

    # KV steps: P block-table columns (K keys) each, the table padded to whole steps with
    # page 0, whose keys lie at positions >= max_blocks * block_size >= seq_len (masked).
    pages_per_step = max(1, min(max_blocks, kv_chunk // block_size))
    num_steps = cdiv(max_blocks, pages_per_step)
    keys_per_step = pages_per_step * block_size
    tables = jnp.pad(block_tables, ((0, 0), (0, num_steps * pages_per_step - max_blocks)))
    step_tables = tables.reshape(num_seqs, num_steps, pages_per_step).transpose(1, 0, 2)
    step_starts = jnp.arange(num_steps) * keys_per_step

    # The softmax scale with the k_scale of an fp8 cache folded in: q . (s k) = s (q . k);
    # per KV head, [kv_heads, 1, 1, 1] against scores [kv_heads, C, B*G, K].
    score_scale = sm_scale if k_scale is None else sm_scale * per_head_scale(k_scale, num_kv_heads)[:, None, None, None]

    def attend_chunk(q_c, query_pos, seqs):
        """C blocks of B query tokens: q_c [C, B, num_q_heads, D], their positions [C, B] (-1:
        no query) and each block's sequence [C] -> out [C, B, num_q_heads, D]."""
        chunk, width = query_pos.shape
        rows = width * group  # query rows of a block per KV head: its B tokens' G query heads each
        # Head-major, [kv_heads, C, B*G, ...]: both products are plain matmuls batched over
        # (KV head, block), and nothing in the loop is transposed (XLA:CPU otherwise moves
        # the scores and V between layouts on every KV step).
        q_h = q_c.reshape(chunk, width, num_kv_heads, group, head_dim).transpose(2, 0, 1, 3, 4)
        q_h = q_h.reshape(num_kv_heads, chunk, rows, head_dim)
        row_pos = jnp.repeat(query_pos, group, axis=1)[None, :, :, None]  # [1, C, B*G, 1]
        context_len = seq_lens[seqs]

        def kv_step(carry, step):
            row_max, row_sum, acc = carry  # [kv_heads, C, B*G] x2, [kv_heads, C, B*G, D]; float32
            start, columns = step  # first key position of this step, [num_seqs, P] page ids
            # This step's pages of every block's sequence: [kv_heads, C, K, D].
            pages = columns[seqs]
            k = _gather_pages(k_cache, pages, start, q.dtype).reshape(num_kv_heads, chunk, keys_per_step, head_dim)
            v = _gather_pages(v_cache, pages, start, q.dtype).reshape(num_kv_heads, chunk, keys_per_step, head_dim)
            scores = jnp.einsum("hcqd,hckd->hcqk", q_h, k, preferred_element_type=jnp.float32)
            scores = scores * score_scale
            if logits_soft_cap is not None:
                scores = logits_soft_cap * jnp.tanh(scores / logits_soft_cap)

            key_pos = start + jnp.arange(keys_per_step)
            mask = (key_pos <= row_pos) & (key_pos < context_len[None, :, None, None])
            if sliding_window is not None:
                mask &= key_pos > row_pos - sliding_window
            scores = jnp.where(mask, scores, -jnp.inf)

            # Online softmax: rescale what was summed so far to the new running max. A row
            # that has seen no key yet keeps max -inf; subtracting 0 instead keeps it NaN-free.
            new_max = jnp.maximum(row_max, scores.max(-1))
            shift = jnp.where(new_max == -jnp.inf, 0.0, new_max)
            probs = jnp.exp(scores - shift[..., None])
            rescale = jnp.exp(row_max - shift)
            row_sum = row_sum * rescale + probs.sum(-1)
            pv = jnp.einsum("hcqk,hckd->hcqd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
            return (new_max, row_sum, acc * rescale[..., None] + pv), None

        init = (
            jnp.full((num_kv_heads, chunk, rows), -jnp.inf, jnp.float32),
            jnp.zeros((num_kv_heads, chunk, rows), jnp.float32),
            jnp.zeros((num_kv_heads, chunk, rows, head_dim), jnp.float32),
        )
        if dynamic_kv_steps:  # up to the last column any query of the chunk sees
            last = jnp.max(jnp.minimum(query_pos, context_len[:, None] - 1))
            steps = jnp.clip(last // keys_per_step + 1, 0, num_steps)
            _, row_sum, acc = lax.fori_loop(
                0, steps, lambda i, carry: kv_step(carry, (step_starts[i], step_tables[i]))[0], init)
        else:
            (_, row_sum, acc), _ = lax.scan(kv_step, init, (step_starts, step_tables))
        # A row that saw no key (padding) has sum 0: output zeros, not 0/0.
        out = acc / jnp.where(row_sum > 0, row_sum, 1.0)[..., None]
        if v_scale is not None:
            out = out * per_head_scale(v_scale, num_kv_heads)[:, None, None, None]
        out = out.reshape(num_kv_heads, chunk, width, group, head_dim).transpose(1, 2, 0, 3, 4)
        return out.reshape(chunk, width, num_q_heads, head_dim).astype(q.dtype)

    def per_token():
        """Chunks of C tokens, each token its sequence's pages gathered for it alone. With
        `dynamic_kv_steps`, only the chunks that hold a real token run."""
        # The sequence of each token; padding tokens fall on the last sequence.
        seq_of_token = jnp.searchsorted(query_start_loc[1:], jnp.arange(num_tokens), side="right")
        seq_of_token = jnp.minimum(seq_of_token, num_seqs - 1)
        chunk = min(num_tokens, query_chunk)
        num_chunks = cdiv(num_tokens, chunk)
        pad = num_chunks * chunk - num_tokens
        qg = jnp.pad(q, ((0, pad), (0, 0), (0, 0))).reshape(num_chunks, chunk, 1, num_q_heads, head_dim)
        chunk_positions = jnp.pad(positions, (0, pad), constant_values=-1).reshape(num_chunks, chunk, 1)
        chunk_seqs = jnp.pad(seq_of_token, (0, pad)).reshape(num_chunks, chunk)
        if not dynamic_kv_steps:
            out = lax.map(lambda args: attend_chunk(*args), (qg, chunk_positions, chunk_seqs))
        else:
            def body(i, out):
                return lax.dynamic_update_index_in_dim(out, attend_chunk(qg[i], chunk_positions[i], chunk_seqs[i]), i, 0)
            used = cdiv(query_start_loc[-1], chunk)
            out = lax.fori_loop(0, used, body, jnp.zeros(qg.shape, q.dtype))
        return out.reshape(num_chunks * chunk, num_q_heads, head_dim)[:num_tokens]

    def in_blocks():
        """Blocks of up to B consecutive tokens of one sequence, `block_rows` // B a loop
        step, the used ones only: a block gathers its sequence's pages once for its B
        tokens. Each step scatters its rows that hold a query to their tokens."""
        token_of_slot, slot_pos, block_seqs, used_blocks = _query_blocks(positions, query_start_loc, query_block)
        chunk = max(1, min(len(block_seqs), block_rows // query_block, cdiv(num_tokens, query_block)))
        num_chunks = cdiv(len(block_seqs), chunk)
        pad = num_chunks * chunk - len(block_seqs)
        token_of_slot = jnp.pad(token_of_slot, ((0, pad), (0, 0))).reshape(num_chunks, chunk, query_block)
        slot_pos = jnp.pad(slot_pos, ((0, pad), (0, 0)), constant_values=-1).reshape(num_chunks, chunk, query_block)
        block_seqs = jnp.pad(block_seqs, (0, pad)).reshape(num_chunks, chunk)
        target = jnp.where(slot_pos >= 0, token_of_slot, num_tokens)  # (no query: dropped)

        def body(i, out):
            rows = attend_chunk(q[token_of_slot[i]], slot_pos[i], block_seqs[i])
            return out.at[target[i]].set(rows, mode="drop")

        out = jnp.zeros_like(q)
        return lax.fori_loop(0, cdiv(used_blocks, chunk), body, out)

    return per_token() if query_block == 1 else in_blocks()


def _query_blocks(positions: jax.Array, query_start_loc: jax.Array, block: int):
    """The tokens in blocks of up to `block` consecutive tokens of one sequence, each
    sequence's blocks in turn, the unused ones last; at most cdiv(T, block) + S of them
    (each sequence leaves at most one block part-full), and never more than T.

    Returns (token_of_slot [N, block], position_of_slot [N, block] (-1: no query),
    sequence_of_block [N], the number of used blocks) for N blocks."""
    num_tokens, num_seqs = positions.shape[0], query_start_loc.shape[0] - 1
    num_blocks = min(num_tokens, cdiv(num_tokens, block) + num_seqs)
    starts = query_start_loc[:-1]
    lens = query_start_loc[1:] - starts
    blocks = (lens + block - 1) // block
    ends = jnp.cumsum(blocks)
    first = ends - blocks  # each sequence's first block
    b = jnp.arange(num_blocks)
    seq = jnp.minimum(jnp.searchsorted(ends, b, side="right"), num_seqs - 1)
    offset = (b - first[seq])[:, None] * block + jnp.arange(block)[None, :]  # within the sequence
    live = (offset < lens[seq][:, None]) & (b < ends[-1])[:, None]
    token = jnp.where(live, starts[seq][:, None] + offset, 0)
    position = jnp.where(live, positions[token], -1)
    return token, position, seq, ends[-1]


def _gather_pages(cache: jax.Array, pages: jax.Array, step: jax.Array, dtype=None) -> jax.Array:
    """cache[:, pages] inside a loop whose step counter is `step`, converted to `dtype` (an
    fp8 cache: dequantized pages, before the scale).

    The gather moves bits (`as_bits`): XLA:CPU gathers a narrow float in a wider one,
    converting the gather's whole operand, and with the cache loop-invariant it hoists
    that conversion out of the loop and keeps a converted copy of the entire cache. Tying
    the cache to the step (a no-op barrier) keeps what remains inside the loop, on the
    pages read only.
    """
    bits, _ = lax.optimization_barrier((as_bits(cache), step))
    pages = from_bits(bits[:, pages], cache.dtype)
    return pages if dtype is None or pages.dtype == dtype else pages.astype(dtype)


# -- Pallas kernel ------------------------------------------------------------------------

# Per-tile metadata columns (int32 [num_tiles, 8]; 8 keeps the row a power of 2).
_TOK, _NQ, _POS, _LEN, _BT = range(5)
_META_COLS = 8


def _ragged_kernel(
    meta_ref,  # [8] int32          this tile: first token, query count (0 = idle), first position, seq_len, bt offset
    q_ref,  # [T, G, D]             every token's query heads of this KV head
    k_ref,  # [num_slots, D]        this KV head's cache, slot = block * block_size + offset
    v_ref,  # [num_slots, D]
    bt_ref,  # [S * max_blocks]     every block table, flattened
    scale_ref,  # [2] f32           (k_scale, v_scale) of this KV head (1.0 unless fp8)
    o_ref,  # [T, G, D]
    *,
    sm_scale: float,
    block_size: int,
    block_q: int,
    block_h: int,
    block_kv: int,
    sliding_window: int | None,
):
    _, group, head_dim = q_ref.shape
    tok0, num_q, pos0, seq_len, bt0 = (meta_ref[i] for i in (_TOK, _NQ, _POS, _LEN, _BT))

    # Row r of the tile is query token r // block_h, query head r % block_h of the group.
    rows = jnp.arange(block_q * block_h)
    qi, g = lax.div(rows, block_h), lax.rem(rows, block_h)
    row_ok = ((qi < num_q) & (g < group))[:, None]
    dims = jnp.arange(head_dim)
    index = ((tok0 + qi)[:, None], g[:, None], dims[None, :])
    q = plgpu.load(q_ref.at[index], mask=row_ok, other=0)
    precision = lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    # Scores in base 2 (exp2 is one instruction), k_scale folded in: q . (s k) = s (q . k).
    # (Both scales read here: v_scale's address kept live through the loop costs registers.)
    k_scale, v_scale = scale_ref[0], scale_ref[1]
    scale = sm_scale * LOG2_E * k_scale
    q_pos = (pos0 + qi)[:, None]

    def dequantize(x):  # an fp8 tile, converted in registers; a cache in q's dtype as it is
        return x if x.dtype == q.dtype else x.astype(q.dtype)

    kv_zero = 0.0 if is_fp8(k_ref.dtype) else 0  # Triton casts a float, not an int, to fp8

    hi = jnp.where(num_q > 0, jnp.minimum(seq_len, pos0 + num_q), 0)  # keys [lo, hi)
    lo = jnp.int32(0) if sliding_window is None else jnp.maximum(pos0 - (sliding_window - 1), 0)
    first_tile = lax.div(lo, block_kv)
    end_tile = jnp.maximum(pl.cdiv(hi, block_kv), first_tile)
    if sliding_window is None:
        # Tiles whose keys are all <= the first query's position (and < seq_len): no mask.
        full_end = jnp.clip(lax.div(jnp.minimum(pos0 + 1, seq_len), block_kv), first_tile, end_tile)
    else:
        full_end = first_tile
    offsets = jnp.arange(block_kv)

    def pages_of(tile):
        keys = tile * block_kv + offsets
        kv_ok = (keys >= lo) & (keys < hi)
        return plgpu.load(bt_ref.at[bt0 + lax.div(keys, block_size)], mask=kv_ok, other=0)

    def step(tile, carry, masked: bool):
        acc, m_prev, l_prev, page = carry  # page ids of this tile, loaded one step ahead
        keys = tile * block_kv + offsets
        if masked:
            kv_ok = (keys >= lo) & (keys < hi)
            load_mask = dict(mask=kv_ok[:, None], other=kv_zero)
        else:
            load_mask = {}
        slots = (page * block_size + lax.rem(keys, block_size))[:, None]
        k = dequantize(plgpu.load(k_ref.at[slots, dims[None, :]], **load_mask))
        next_page = pages_of(tile + 1)
        s = plgpu.dot(q, k, trans_b=True, precision=precision) * scale  # [rows, block_kv] f32
        if masked:
            ok = kv_ok[None, :] & (keys[None, :] <= q_pos)
            if sliding_window is not None:
                ok &= keys[None, :] > q_pos - sliding_window
            s = jnp.where(ok, s, MASK_VALUE)
        m_next = jnp.maximum(m_prev, s.max(axis=1))
        correction = jnp.exp2(m_prev - m_next)
        p = jnp.exp2(s - m_next[:, None])
        l_next = l_prev * correction + p.sum(axis=1)
        v = dequantize(plgpu.load(v_ref.at[slots, dims[None, :]], **load_mask))
        acc = acc * correction[:, None] + plgpu.dot(p.astype(v.dtype), v, precision=precision)
        return acc, m_next, l_next, next_page

    num_rows = block_q * block_h
    carry = (
        jnp.zeros((num_rows, head_dim), jnp.float32),
        jnp.full((num_rows,), MASK_VALUE, jnp.float32),
        jnp.zeros((num_rows,), jnp.float32),
        pages_of(first_tile),
    )
    carry = lax.fori_loop(first_tile, full_end, functools.partial(step, masked=False), carry)
    acc, _, l, _ = lax.fori_loop(full_end, end_tile, functools.partial(step, masked=True), carry)
    out = acc / jnp.where(l == 0.0, 1.0, l)[:, None] * v_scale  # sum p (s v) = s sum p v
    plgpu.store(o_ref.at[index], out.astype(o_ref.dtype), mask=row_ok)


def _tile_metadata(
    positions: jax.Array,
    query_start_loc: jax.Array,
    seq_lens: jax.Array,
    *,
    num_tokens: int,
    max_blocks: int,
    block_q: int,
    num_tiles: int,
    min_query_len: int,
) -> jax.Array:
    """int32 [num_tiles, 8]: which tokens each grid tile computes (idle tiles: 0 queries).

    Tiles are listed last first: the last tiles of a sequence see the most keys, and
    starting the heaviest programs first shortens the tail of the grid.
    """
    num_seqs = seq_lens.shape[0]
    starts = query_start_loc[:-1]
    q_lens = query_start_loc[1:] - starts
    tiles = jnp.where(q_lens >= min_query_len, (q_lens + block_q - 1) // block_q, 0)
    ends = jnp.cumsum(tiles)
    tile = ends[-1] - 1 - jnp.arange(num_tiles, dtype=jnp.int32)
    live = tile >= 0
    # compare_all ([tiles, seqs] compares, one fusion): the default bisects in a while loop,
    # which XLA runs from the host, splitting the step's CUDA graph in two.
    seq = jnp.minimum(jnp.searchsorted(ends, tile, side="right", method="compare_all"), num_seqs - 1)
    first_q = (tile - (ends - tiles)[seq]) * block_q
    tok0 = starts[seq] + first_q
    num_q = jnp.where(live, jnp.minimum(block_q, q_lens[seq] - first_q), 0)
    pos0 = positions[jnp.clip(tok0, 0, num_tokens - 1)]
    zeros = jnp.zeros_like(tok0)
    cols = [tok0, num_q, pos0, seq_lens[seq], seq * max_blocks, zeros, zeros, zeros]
    return jnp.stack([c.astype(jnp.int32) for c in cols], axis=1)


def _call_triton(meta, q4, k_slots, v_slots, block_tables_flat, scales, *, num_warps, num_stages, interpret,
                 **kernel_args):
    num_tokens, num_kv_heads, group, head_dim = q4.shape
    num_slots = k_slots.shape[1]
    num_tiles = meta.shape[0]
    kernel = functools.partial(_ragged_kernel, **kernel_args)
    qo_spec = pl.BlockSpec((num_tokens, None, group, head_dim), lambda h, i: (0, h, 0, 0))
    kv_spec = pl.BlockSpec((None, num_slots, head_dim), lambda h, i: (h, 0, 0))
    return pl.pallas_call(
        kernel,
        # KV heads fastest in launch order: each tile's heads start together, the tiles in
        # `meta`'s order (heaviest first) across all heads.
        grid=(num_kv_heads, num_tiles),
        in_specs=[
            pl.BlockSpec((None, _META_COLS), lambda h, i: (i, 0)),
            qo_spec,
            kv_spec,
            kv_spec,
            pl.BlockSpec(block_tables_flat.shape, lambda h, i: (0,)),
            pl.BlockSpec((None, 2), lambda h, i: (h, 0)),
        ],
        out_specs=qo_spec,
        out_shape=jax.ShapeDtypeStruct(q4.shape, q4.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="jaxvllm_ragged_paged_attention",
    )(meta, q4, k_slots, v_slots, block_tables_flat, scales)


def ragged_paged_attention_raw(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    positions: jax.Array,
    query_start_loc: jax.Array,
    seq_lens: jax.Array,
    block_tables: jax.Array,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    k_scale: jax.Array | float | None = None,
    v_scale: jax.Array | float | None = None,
    min_query_len: int = 1,
    block_q: int | None = None,
    block_kv: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    interpret: bool | None = None,
) -> jax.Array:
    """The kernel alone: rows of sequences with fewer than `min_query_len` query tokens,
    and padding rows, are left UNWRITTEN (garbage). `ragged_paged_attention` zeroes them;
    the mixed backend sends 1-token sequences to the decode kernel instead.
    """
    _check_shapes(q, k_cache, v_cache, positions, query_start_loc, seq_lens, block_tables)
    check_dtypes(q, k_cache)
    interpret = resolve_interpret(interpret)
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, num_blocks, block_size, _ = k_cache.shape
    num_seqs, max_blocks = block_tables.shape
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
    if min_query_len < 1:
        raise ValueError(f"min_query_len must be >= 1, got {min_query_len}")
    group = num_q_heads // num_kv_heads
    block_h = next_power_of_2(group)
    # Tensor cores take wide tiles; compiled float32 tiles stay small (spills otherwise).
    # Interpret mode runs grid steps one after another: wide tiles, fewer steps.
    wide = q.dtype.itemsize < 4 or interpret
    if block_q is None:
        block_q = max(1, (128 if wide else MIN_DOT_DIM) // block_h)
    if block_kv is None:
        if interpret:
            block_kv = 64
        elif wide:  # head_dim 256 in bf16: 32 keys, or three stages overflow shared memory
            block_kv = default_block_kv(head_dim, q.dtype, most=64)
        else:
            block_kv = MIN_DOT_DIM
    check_power_of_2("head_dim", head_dim, interpret)
    check_power_of_2("block_q", block_q, False)
    check_power_of_2("block_kv", block_kv, False)
    if not interpret and min(block_q * block_h, block_kv, head_dim) < MIN_DOT_DIM:
        raise ValueError(
            f"compiled: block_q * G ({block_q * block_h}), block_kv ({block_kv}) and head_dim ({head_dim}) "
            f"must be >= {MIN_DOT_DIM}"
        )
    if num_warps is None:
        num_warps = 4 if wide and head_dim <= 64 else 8
    if num_stages is None:
        num_stages = default_num_stages(q.dtype)

    # Every sequence adds at most one partial tile.
    num_tiles = max(1, cdiv(num_tokens, block_q) + min(num_seqs, num_tokens // min_query_len))
    meta = _tile_metadata(
        positions.astype(jnp.int32), query_start_loc.astype(jnp.int32), seq_lens.astype(jnp.int32),
        num_tokens=num_tokens, max_blocks=max_blocks, block_q=block_q, num_tiles=num_tiles,
        min_query_len=min_query_len,
    )
    num_slots = num_blocks * block_size
    out = _call_triton(
        meta,
        q.reshape(num_tokens, num_kv_heads, group, head_dim),
        k_cache.reshape(num_kv_heads, num_slots, head_dim),  # free: contiguous
        v_cache.reshape(num_kv_heads, num_slots, head_dim),
        block_tables.astype(jnp.int32).reshape(-1),
        kv_scales(k_scale, v_scale, num_kv_heads),
        num_warps=num_warps,
        num_stages=num_stages,
        interpret=interpret,
        sm_scale=float(sm_scale),
        block_size=block_size,
        block_q=block_q,
        block_h=block_h,
        block_kv=block_kv,
        sliding_window=sliding_window,
    )
    return out.reshape(num_tokens, num_q_heads, head_dim)


def ragged_paged_attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    positions: jax.Array,
    query_start_loc: jax.Array,
    seq_lens: jax.Array,
    block_tables: jax.Array,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    k_scale: jax.Array | float | None = None,
    v_scale: jax.Array | float | None = None,
    **tuning,
) -> jax.Array:
    """The reference's contract on the Pallas kernel: [T, num_q_heads, head_dim] in q's dtype.

    The cache is q's dtype or float8_e4m3fn, dequantized by k_scale / v_scale as in the
    reference (fp8 tiles converted to q's dtype in registers, the scales folded in).

    Padding rows (past `query_start_loc[-1]`) are zeros. `tuning`: block_q (query tokens
    per tile, a power of 2; default 128 rows / G, 16 rows / G in float32), block_kv (keys
    per inner step; default 64, 32 for head_dim 256, 16 in float32), num_warps,
    num_stages (default 3, 2 in float32), interpret (None: on CPU or with
    `JAXVLLM_PALLAS_INTERPRET=1`).
    """
    out = ragged_paged_attention_raw(
        q, k_cache, v_cache, positions, query_start_loc, seq_lens, block_tables,
        sm_scale=sm_scale, sliding_window=sliding_window, k_scale=k_scale, v_scale=v_scale, **tuning,
    )
    live = jnp.arange(q.shape[0]) < query_start_loc[-1]
    return jnp.where(live[:, None, None], out, 0).astype(q.dtype)

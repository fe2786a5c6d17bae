"""The `pallas` attention backend: one flat batch, two kernels, the reference's contract.

Which rows go where: a sequence with exactly one query token this step (a decode row,
or a 1-token prefill chunk) goes to the split-K decode kernel; every other sequence
goes to the ragged kernel (`min_query_len=2`). Both kernels run on every step and
skip the rows they do not own, then a select merges the outputs. A caller that knows a
batch is all decode rows, token s being sequence s's only token (an engine's host does:
it builds the batch), says so with `decode_only=True`: the decode kernel alone then runs,
on the queries as they are, with no gather, scatter or select around it (Qwen3-0.6B's
256-sequence decode step compiles to 430 kernels instead of 550 on sm_90a).

Why not pick one kernel per batch: the layer cannot know at trace time whether a
batch is decode-only (the token count is padded to a bucket and the sequence rows to
max_num_seqs), and a `lax.cond` on a device predicate typically makes XLA:GPU copy the
predicate to the host before it launches a branch: a sync in every layer. Why not the ragged kernel for everything: its query tiles are
block_q tokens wide, so a decode row wastes most of a tile's rows and has no split-K,
while decode is where the engine spends most of its time. The idle kernel of a step
costs one launch of programs that exit at once.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.paged_decode_attention import paged_decode_attention
from pallas_kernels.ragged_paged_attention import _check_shapes, ragged_paged_attention_raw


def mixed_paged_attention(
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
    interpret: bool | None = None,
    decode_tuning: dict | None = None,
    ragged_tuning: dict | None = None,
    decode_only: bool = False,
) -> jax.Array:
    """Same contract and layout as `ragged_paged_attention_reference` (an fp8 cache and its
    k_scale / v_scale included); padding rows are zeros. `decode_only`: the caller's promise
    that sequence s owns token s alone, or no token (query_start_loc = 0, 1, .., n, n, ..)."""
    _check_shapes(q, k_cache, v_cache, positions, query_start_loc, seq_lens, block_tables)
    num_tokens, num_seqs = q.shape[0], seq_lens.shape[0]

    def decode(seq_q, seq_positions, is_decode):
        """The decode kernel on each sequence's query row; other sequences get seq_len 0."""
        return paged_decode_attention(
            seq_q, k_cache, v_cache, jnp.where(is_decode, seq_lens, 0), block_tables,
            sm_scale=sm_scale, sliding_window=sliding_window, query_positions=seq_positions,
            k_scale=k_scale, v_scale=v_scale, interpret=interpret, **(decode_tuning or {}),
        )

    if decode_only:
        if num_seqs > num_tokens:
            raise ValueError(f"decode_only: {num_seqs} sequence rows for {num_tokens} tokens")
        decoded = decode(q[:num_seqs], positions[:num_seqs], jnp.arange(num_seqs) < query_start_loc[-1])
        return jnp.pad(decoded, ((0, num_tokens - num_seqs), (0, 0), (0, 0))).astype(q.dtype)
    starts = query_start_loc[:-1]
    is_decode = (query_start_loc[1:] - starts) == 1
    rows = jnp.clip(starts, 0, num_tokens - 1)

    decoded = decode(q[rows], positions[rows], is_decode)
    ragged = ragged_paged_attention_raw(
        q, k_cache, v_cache, positions, query_start_loc, seq_lens, block_tables,
        sm_scale=sm_scale, sliding_window=sliding_window, k_scale=k_scale, v_scale=v_scale, min_query_len=2,
        interpret=interpret, **(ragged_tuning or {}),
    )
    # Scatter the decode rows to their tokens (other sequences' index is out of range: dropped).
    target = jnp.where(is_decode, starts, num_tokens)
    from_decode = jnp.zeros(num_tokens, bool).at[target].set(True, mode="drop")
    decoded = jnp.zeros_like(q).at[target].set(decoded, mode="drop")
    live = jnp.arange(num_tokens) < query_start_loc[-1]
    out = jnp.where(from_decode[:, None, None], decoded, jnp.where(live[:, None, None], ragged, 0))
    return out.astype(q.dtype)

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

This file holds the plain-jnp reference, the oracle for the Pallas kernels.
"""

import jax
import jax.numpy as jnp


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
) -> jax.Array:
    """Attention output [T, num_q_heads, head_dim] in q's dtype (softmax in float32).

    Token t (position p in its sequence) sees cache positions j with j <= p and
    j < seq_len, and j > p - sliding_window when a window is set. Rows past
    `query_start_loc[-1]` are padding: their output is finite and meaningless.
    """
    _check_shapes(q, k_cache, v_cache, positions, query_start_loc, seq_lens, block_tables)
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, _, block_size, _ = k_cache.shape
    num_seqs, max_blocks = block_tables.shape
    group = num_q_heads // num_kv_heads

    # The sequence of each token; padding tokens fall on the last sequence.
    token_ids = jnp.arange(num_tokens)
    seq_of_token = jnp.searchsorted(query_start_loc[1:], token_ids, side="right")
    seq_of_token = jnp.minimum(seq_of_token, num_seqs - 1)

    # Gather every token's context pages: [kv_heads, T, max_blocks * block_size, D].
    pages = block_tables[seq_of_token]
    k = k_cache[:, pages].reshape(num_kv_heads, num_tokens, max_blocks * block_size, head_dim)
    v = v_cache[:, pages].reshape(num_kv_heads, num_tokens, max_blocks * block_size, head_dim)

    qg = q.reshape(num_tokens, num_kv_heads, group, head_dim)
    scores = jnp.einsum("thgd,htkd->thgk", qg, k, preferred_element_type=jnp.float32)
    scores = scores * sm_scale

    key_pos = jnp.arange(max_blocks * block_size)[None, :]
    query_pos = positions[:, None]
    mask = (key_pos <= query_pos) & (key_pos < seq_lens[seq_of_token][:, None])
    if sliding_window is not None:
        mask &= key_pos > query_pos - sliding_window
    scores = jnp.where(mask[:, None, None, :], scores, -jnp.inf)
    # Keep padding rows with an empty mask finite instead of NaN.
    scores = jnp.where(mask.any(-1)[:, None, None, None], scores, 0.0)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("thgk,htkd->thgd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.reshape(num_tokens, num_q_heads, head_dim).astype(q.dtype)

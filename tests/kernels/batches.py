"""What the kernel tests share: test batches over a paged cache (shuffled physical blocks,
random K/V in every slot, garbage block ids past each sequence's blocks, padding tokens and
sequences), tile sizes the compiled kernels accept, jitted references and tolerances."""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import paged_decode_attention_reference, ragged_paged_attention_reference
from pallas_kernels.common import MIN_DOT_DIM, cdiv, default_interpret, next_power_of_2

INTERPRET = default_interpret()
# Jitted references: one compile per test instead of one per jnp op.
ragged_reference = jax.jit(ragged_paged_attention_reference, static_argnames=("sm_scale", "sliding_window"))
decode_reference = jax.jit(paged_decode_attention_reference, static_argnames=("sm_scale", "sliding_window"))
TOL = {jnp.float32: dict(atol=1e-4, rtol=1e-4), jnp.bfloat16: dict(atol=3e-2, rtol=3e-2)}


def kv_tile(n: int) -> int:
    """A KV tile size the compiled kernel accepts (tl.dot needs >= 16); interpret takes any."""
    return n if INTERPRET else max(n, MIN_DOT_DIM)


def q_tile(n: int | None, group: int) -> int | None:
    """block_q tokens such that block_q * G >= 16 when compiled."""
    if n is None or INTERPRET:
        return n
    return max(n, MIN_DOT_DIM // next_power_of_2(group))


@dataclass
class Batch:
    q: jax.Array
    k_cache: jax.Array
    v_cache: jax.Array
    positions: jax.Array
    query_start_loc: jax.Array
    seq_lens: jax.Array
    block_tables: jax.Array
    num_tokens: int  # real tokens; the rest of q's rows are padding

    @property
    def args(self):
        return (self.q, self.k_cache, self.v_cache, self.positions, self.query_start_loc, self.seq_lens,
                self.block_tables)


def make_batch(seed: int, context: list[int], new: list[int], *, kv_heads: int = 2, group: int = 2,
               head_dim: int = 16, block_size: int = 4, dtype=jnp.float32, pad_tokens: int = 3,
               pad_seqs: int = 2) -> Batch:
    """Sequence s has context[s] tokens of which the last new[s] are this step's queries."""
    rng = np.random.default_rng(seed)
    blocks = [cdiv(c, block_size) for c in context]
    max_blocks = max(blocks) + 1
    num_blocks = sum(blocks) + 3
    perm = rng.permutation(num_blocks)
    tables = rng.integers(0, num_blocks, (len(context) + pad_seqs, max_blocks)).astype(np.int32)
    used = 0
    for s, n in enumerate(blocks):
        tables[s, :n] = perm[used : used + n]
        used += n
    shape = (kv_heads, num_blocks, block_size, head_dim)
    k_cache, v_cache = rng.normal(size=(2, *shape))
    num_tokens = sum(new)
    q = rng.normal(size=(num_tokens + pad_tokens, kv_heads * group, head_dim))
    positions = np.concatenate([np.arange(c - n, c) for c, n in zip(context, new)] + [np.zeros(pad_tokens)])
    qsl = np.concatenate([[0], np.cumsum(new), np.full(pad_seqs, num_tokens)])
    i32 = lambda x: jnp.asarray(np.asarray(x, np.int32))  # noqa: E731
    return Batch(
        q=jnp.asarray(q, dtype), k_cache=jnp.asarray(k_cache, dtype), v_cache=jnp.asarray(v_cache, dtype),
        positions=i32(positions), query_start_loc=i32(qsl), seq_lens=i32(list(context) + [0] * pad_seqs),
        block_tables=i32(tables), num_tokens=num_tokens,
    )


def assert_close(got, want, dtype, rows=None):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    if rows is not None:
        got, want = got[rows], want[rows]
    np.testing.assert_allclose(got, want, **TOL[dtype])


# The test batches' shapes: one token, partial blocks, several tiles, exact blocks.
DECODE_CONTEXT = [1, 7, 40, 13, 33, 16]
RAGGED_CONTEXT = [9, 14, 6, 1, 30, 17, 16, 4]
RAGGED_NEW = [1, 5, 6, 1, 17, 16, 4, 4]

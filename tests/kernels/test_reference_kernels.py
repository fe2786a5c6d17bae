"""The plain-jnp references in `pallas_kernels`: the oracles the Pallas kernels will be tested against."""

import functools

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import ragged_paged_attention_reference, write_kv_reference
from pallas_kernels.common import bits_dtype, from_bits
from pallas_kernels.ragged_paged_attention import _chunked_reference


def test_write_kv_drops_padding_slots():
    heads, blocks, block_size, dim = 2, 3, 4, 8
    k_cache = jnp.full((heads, blocks, block_size, dim), 7.0)
    v_cache = jnp.full((heads, blocks, block_size, dim), 9.0)
    k = jnp.arange(3 * heads * dim, dtype=jnp.float32).reshape(3, heads, dim)
    slots = jnp.array([5, -1, 11])  # slot 11 = last row of the last block; -1 must not wrap to it
    new_k, new_v = write_kv_reference(k_cache, v_cache, k, -k, slots)
    np.testing.assert_array_equal(new_k[:, 1, 1], k[0])
    np.testing.assert_array_equal(new_k[:, 2, 3], k[2])
    np.testing.assert_array_equal(new_v[:, 2, 3], -k[2])
    written = np.zeros((heads, blocks, block_size), bool)
    written[:, 1, 1] = written[:, 2, 3] = True
    assert np.all(np.asarray(new_k)[~written] == 7.0)
    assert np.all(np.asarray(new_v)[~written] == 9.0)


def test_write_kv_checks_shapes():
    cache = jnp.zeros((2, 3, 4, 8))
    with pytest.raises(ValueError, match="k/v must be"):
        write_kv_reference(cache, cache, jnp.zeros((3, 1, 8)), jnp.zeros((3, 1, 8)), jnp.zeros(3, jnp.int32))


def dense_attention(q, k, v, sm_scale):
    """Causal attention of the last len(q) positions over contiguous k, v [L, heads, D]."""
    group = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    scores = np.einsum("qhd,khd->hqk", q, k) * sm_scale
    offset = k.shape[0] - q.shape[0]
    mask = np.arange(k.shape[0])[None, :] <= np.arange(q.shape[0])[:, None] + offset
    scores = np.where(mask[None], scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    return np.einsum("hqk,khd->qhd", probs, v)


@pytest.mark.parametrize("group", [1, 2, 4])
def test_ragged_reference_matches_dense_per_sequence(group):
    """Mixed batch (decode, chunk, full prefill) over shuffled pages = dense causal attention."""
    rng = np.random.default_rng(group)
    kv_heads, dim, block_size, num_blocks = 2, 16, 4, 24
    context = [9, 14, 6]  # cached + new tokens per sequence
    new = [1, 5, 6]       # decode, chunked prefill, whole prompt
    pages = rng.permutation(num_blocks)
    tables = np.zeros((3, 4), np.int32)
    k_cache = np.zeros((kv_heads, num_blocks, block_size, dim), np.float32)
    v_cache = np.zeros_like(k_cache)
    ks, vs, qs, positions, used = [], [], [], [], 0
    for s, (length, n) in enumerate(zip(context, new)):
        nb = -(-length // block_size)
        tables[s, :nb] = pages[used : used + nb]
        used += nb
        k, v = rng.normal(size=(2, length, kv_heads, dim)).astype(np.float32)
        for p in range(length):
            k_cache[:, tables[s, p // block_size], p % block_size] = k[p]
            v_cache[:, tables[s, p // block_size], p % block_size] = v[p]
        ks.append(k), vs.append(v)
        qs.append(rng.normal(size=(n, kv_heads * group, dim)).astype(np.float32))
        positions += list(range(length - n, length))
    out = ragged_paged_attention_reference(
        jnp.asarray(np.concatenate(qs)), jnp.asarray(k_cache), jnp.asarray(v_cache),
        jnp.asarray(positions, jnp.int32), jnp.asarray(np.cumsum([0] + new), jnp.int32),
        jnp.asarray(context, jnp.int32), jnp.asarray(tables), sm_scale=dim**-0.5,
    )
    want = np.concatenate([dense_attention(q, k, v, dim**-0.5) for q, k, v in zip(qs, ks, vs)])
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)


def test_ragged_reference_checks_shapes():
    q = jnp.zeros((4, 6, 8))
    cache = jnp.zeros((4, 2, 4, 8))
    with pytest.raises(ValueError, match="not a multiple"):
        ragged_paged_attention_reference(
            q, cache, cache, jnp.zeros(4, jnp.int32), jnp.zeros(2, jnp.int32),
            jnp.zeros(1, jnp.int32), jnp.zeros((1, 2), jnp.int32), sm_scale=1.0,
        )


# -- The chunked ragged reference against the dense one it replaced ---------------------


def _dense_reference(
    q, k_cache, v_cache, positions, query_start_loc, seq_lens, block_tables, *, sm_scale, sliding_window=None
):
    """The former `ragged_paged_attention_reference`: every token gathers its whole context.

    Obviously right and [kv_heads, T, max_blocks * block_size, head_dim] big; the oracle
    of the chunked reference at small shapes.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, _, block_size, _ = k_cache.shape
    num_seqs, max_blocks = block_tables.shape
    group = num_q_heads // num_kv_heads
    seq_of_token = jnp.searchsorted(query_start_loc[1:], jnp.arange(num_tokens), side="right")
    seq_of_token = jnp.minimum(seq_of_token, num_seqs - 1)
    pages = block_tables[seq_of_token]
    k = k_cache[:, pages].reshape(num_kv_heads, num_tokens, max_blocks * block_size, head_dim)
    v = v_cache[:, pages].reshape(num_kv_heads, num_tokens, max_blocks * block_size, head_dim)
    qg = q.reshape(num_tokens, num_kv_heads, group, head_dim)
    scores = jnp.einsum("thgd,htkd->thgk", qg, k, preferred_element_type=jnp.float32) * sm_scale
    key_pos = jnp.arange(max_blocks * block_size)[None, :]
    query_pos = positions[:, None]
    mask = (key_pos <= query_pos) & (key_pos < seq_lens[seq_of_token][:, None])
    if sliding_window is not None:
        mask &= key_pos > query_pos - sliding_window
    scores = jnp.where(mask[:, None, None, :], scores, -jnp.inf)
    scores = jnp.where(mask.any(-1)[:, None, None, None], scores, 0.0)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("thgk,htkd->thgd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.reshape(num_tokens, num_q_heads, head_dim).astype(q.dtype)


# (context, new tokens) per sequence. "mixed": decode, whole prompt, chunked prefill, a
# one-token context, a sequence with no query token this step, contexts over many pages.
# "long": more than 256 tokens, not a multiple of 128 (the public chunk). "decode": one
# token per sequence.
_BATCHES = {
    "mixed": [(97, 1), (40, 40), (150, 23), (1, 1), (30, 0), (64, 1)],
    "long": [(330, 200), (77, 1), (90, 90)],
    "decode": [(c, 1) for c in (5, 17, 160, 33, 128, 2, 71, 99, 1)],
}


def _paged_batch(rng, specs, *, group, block_size, dtype, kv_heads=2, dim=16, padding_rows=5):
    """A flat batch over shuffled pages; unused table columns point at random (live) pages."""
    num_seqs = len(specs)
    max_blocks = -(-max(c for c, _ in specs) // block_size) + 1  # one column to spare
    num_blocks = num_seqs * max_blocks + 3
    tables = rng.permutation(num_blocks)[: num_seqs * max_blocks].reshape(num_seqs, max_blocks)
    for s, (context, _) in enumerate(specs):
        used = -(-context // block_size)
        tables[s, used:] = rng.integers(0, num_blocks, max_blocks - used)
    cache = rng.normal(size=(2, kv_heads, num_blocks, block_size, dim))
    new = [n for _, n in specs]
    positions = np.concatenate([np.arange(c - n, c) for c, n in specs] + [rng.integers(0, 400, padding_rows)])
    q = rng.normal(size=(len(positions), kv_heads * group, dim))
    return (
        jnp.asarray(q, dtype), jnp.asarray(cache[0], dtype), jnp.asarray(cache[1], dtype),
        jnp.asarray(positions, jnp.int32), jnp.asarray(np.cumsum([0] + new), jnp.int32),
        jnp.asarray([c for c, _ in specs], jnp.int32), jnp.asarray(tables, jnp.int32),
    ), sum(new)


_STATIC = ("sm_scale", "sliding_window", "query_chunk", "kv_chunk", "block_rows", "dynamic_kv_steps",
           "query_block")
_dense = jax.jit(_dense_reference, static_argnames=("sm_scale", "sliding_window"))
_chunked = jax.jit(_chunked_reference, static_argnames=_STATIC)
_public = jax.jit(ragged_paged_attention_reference, static_argnames=("sm_scale", "sliding_window"))


# (group, block_size, sliding_window, batch, keys per KV step): every value of each
# covered, not every combination (each case compiles two or three functions).
_SWEEP = [
    (1, 8, None, "mixed", 8),
    (2, 16, 24, "mixed", 32),
    (4, 8, 24, "decode", 16),
    (2, 16, None, "decode", 16),
    (4, 16, 24, "long", 16),
    (1, 8, None, "long", 32),
]


@pytest.mark.parametrize("group, block_size, window, batch, kv_chunk", _SWEEP)
def test_chunked_reference_matches_dense(group, block_size, window, batch, kv_chunk):
    """7-token query chunks with one or two pages per KV step, with the KV loop whole or
    stopped at the chunk's last column (and, past 256 tokens, the public chunking of 128) give the dense result on the real rows, and finite padding rows."""
    rng = np.random.default_rng([group, block_size, window or 0, kv_chunk])
    args, real = _paged_batch(rng, _BATCHES[batch], group=group, block_size=block_size, dtype=jnp.float32)
    want = _dense(*args, sm_scale=0.3, sliding_window=window)
    outs = {"chunked": _chunked(*args, sm_scale=0.3, sliding_window=window, query_chunk=7, kv_chunk=kv_chunk),
            # (the CPU engine's: only the chunks with a real token run, each KV loop to its last column)
            "dynamic": _chunked(*args, sm_scale=0.3, sliding_window=window, query_chunk=7, kv_chunk=kv_chunk,
                                dynamic_kv_steps=True),
            # (and in blocks of 3 tokens of one sequence, 2 a loop step (an odd count of used
            # blocks leaves the last step one unused), a sequence's pages gathered once a block)
            "blocks": _chunked(*args, sm_scale=0.3, sliding_window=window, query_chunk=7, kv_chunk=kv_chunk,
                               block_rows=6, dynamic_kv_steps=True, query_block=3)}
    if real > 256:
        outs["public"] = _public(*args, sm_scale=0.3, sliding_window=window)
    for name, out in outs.items():
        assert out.shape == want.shape and out.dtype == want.dtype, name
        np.testing.assert_allclose(out[:real], want[:real], rtol=2e-5, atol=2e-5, err_msg=name)
        assert np.isfinite(np.asarray(out)).all(), name


def test_chunked_reference_bfloat16_matches_dense():
    rng = np.random.default_rng(7)
    args, real = _paged_batch(rng, _BATCHES["mixed"], group=2, block_size=8, dtype=jnp.bfloat16)
    want = _dense(*args, sm_scale=0.3, sliding_window=None)
    out = _chunked(*args, sm_scale=0.3, sliding_window=None, query_chunk=7, kv_chunk=16)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(
        np.asarray(out[:real], np.float32), np.asarray(want[:real], np.float32), rtol=2e-2, atol=2e-2
    )


def _primitives(jaxpr, found):
    for eqn in jaxpr.eqns:
        found.add(eqn.primitive.name)
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else [param]:
                if isinstance(sub, jax.extend.core.ClosedJaxpr):
                    _primitives(sub.jaxpr, found)
                elif isinstance(sub, jax.extend.core.Jaxpr):
                    _primitives(sub, found)
    return found


def _big_shapes(num_tokens=8192, num_seqs=64, max_model_len=4096, block_size=16):
    """Engine-sized arguments (bf16, 32 q heads over 8 KV heads, head_dim 128), shapes only."""
    num_blocks = num_seqs * 4096 // block_size
    cache = jax.ShapeDtypeStruct((8, num_blocks, block_size, 128), jnp.bfloat16)
    i32 = jnp.int32
    return (
        jax.ShapeDtypeStruct((num_tokens, 32, 128), jnp.bfloat16), cache, cache,
        jax.ShapeDtypeStruct((num_tokens,), i32), jax.ShapeDtypeStruct((num_seqs + 1,), i32),
        jax.ShapeDtypeStruct((num_seqs,), i32), jax.ShapeDtypeStruct((num_seqs, max_model_len // block_size), i32),
    )


def test_reference_has_no_device_side_branches():
    jaxpr = jax.make_jaxpr(functools.partial(ragged_paged_attention_reference, sm_scale=0.1, sliding_window=64))(
        *_big_shapes(num_tokens=600, num_seqs=4, max_model_len=512)
    )
    found = _primitives(jaxpr.jaxpr, set())
    assert "scan" in found  # the loops are there, and static
    assert not found & {"cond", "while"}


def _as_bits(shapes):
    """The caches of `_big_shapes` stored as bits, as the engine stores them on a CPU
    (`jaxvllm.kv_cache.with_cache_storage`): the reference gathers pages as bits, and a
    bf16 cache argument costs XLA:CPU a converted copy of it whole."""
    q, k, v, *rest = shapes
    return (q, *(jax.ShapeDtypeStruct(c.shape, bits_dtype(c.dtype)) for c in (k, v)), *rest)


def _on_bits(q, k_bits, v_bits, *rest, **kwargs):
    return ragged_paged_attention_reference(q, from_bits(k_bits, q.dtype), from_bits(v_bits, q.dtype), *rest, **kwargs)


def _temp_bytes(fn, *shapes):
    compiled = jax.jit(functools.partial(fn, sm_scale=0.1)).lower(*shapes).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_reference_fits_at_engine_shapes():
    """T = 8192 tokens of 64 sequences, 4096-token contexts, bf16: compiled only.

    The dense reference needs 2 * 8 * 8192 * 4096 * 128 * 2 B = 128 GiB for the gathered
    K and V; the chunked one 2 * 8 * 128 * 128 * 128 * 2 B = 64 MiB of tiles plus q- and
    output-sized buffers (64 MiB each), and the same whatever max_model_len is.
    """
    GiB = 2**30
    new = _temp_bytes(_on_bits, *_as_bits(_big_shapes()))
    assert new < 1 * GiB, new / GiB
    assert _temp_bytes(_on_bits, *_as_bits(_big_shapes(max_model_len=16384))) <= 1.05 * new
    assert _temp_bytes(_dense_reference, *_big_shapes()) > 64 * GiB

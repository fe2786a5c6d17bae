"""The plain-jnp references in `pallas_kernels`: the oracles the Pallas kernels will be tested against."""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import ragged_paged_attention_reference, write_kv_reference


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

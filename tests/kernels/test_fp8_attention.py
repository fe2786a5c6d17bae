"""The kernels over an fp8 KV cache (float8_e4m3fn / e5m2 pages, k/v scales per tensor or per
KV head, queries in bf16 or float32) against their references, as tests/kernels/test_attention.py
checks them over a cache in the queries' dtype."""


from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import (
    mixed_paged_attention,
    paged_decode_attention,
    ragged_paged_attention,
    write_kv_reference,
)
from pallas_kernels.common import (dot_dtype, to_dot_dtype)

from tests.kernels.batches import (DECODE_CONTEXT, RAGGED_CONTEXT, RAGGED_NEW, Batch, assert_close, decode_reference,
                                   kv_tile, make_batch, q_tile, ragged_reference)


# -- fp8 KV cache: float8_e4m3fn pages, k/v scales per tensor or per KV head, q in bf16 or float32 --

FP8 = jnp.float8_e4m3fn


def per_head(scale) -> jax.Array:
    """A scale (one value, or one per KV head) shaped to broadcast against a cache [H, ...]."""
    return jnp.asarray(scale, jnp.float32).reshape(-1, 1, 1, 1)


def quantized(b: Batch, k_scale, v_scale, dtype=FP8) -> Batch:
    """The batch with its caches stored as fp8 (x / scale, as the KV write stores them);
    scales per tensor (a float) or per KV head (one per head)."""
    top = float(jnp.finfo(dtype).max)
    fp8 = lambda x, s: jnp.clip(x.astype(jnp.float32) / per_head(s), -top, top).astype(dtype)  # noqa: E731
    return Batch(b.q, fp8(b.k_cache, k_scale), fp8(b.v_cache, v_scale), b.positions, b.query_start_loc,
                 b.seq_lens, b.block_tables, b.num_tokens)


FP8_CASES = [
    # group, block_size, q dtype, sliding_window, (k_scale, v_scale): per tensor or per KV head (2)
    pytest.param(2, 4, jnp.bfloat16, None, (0.05, 0.02), id="g2-bf16"),
    pytest.param(2, 4, jnp.bfloat16, None, ((0.05, 0.4), (0.02, 0.2)), id="g2-bf16-per-head"),
    pytest.param(4, 8, jnp.float32, None, (1.0, 1.0), id="g4-f32-unit-scales"),
    pytest.param(8, 6, jnp.bfloat16, 5, (0.5, 3.0), id="g8-block6-bf16-window5"),
]


@pytest.mark.parametrize("group,block_size,dtype,window,scales", FP8_CASES)
def test_decode_fp8_cache_matches_reference(group, block_size, dtype, window, scales):
    b = quantized(make_batch(group + block_size, DECODE_CONTEXT, [1] * len(DECODE_CONTEXT), group=group,
                             block_size=block_size, dtype=dtype, pad_tokens=2, pad_seqs=2), *scales)
    args = (b.q, b.k_cache, b.v_cache, b.seq_lens, b.block_tables)
    k_scale, v_scale = (jnp.asarray(s, jnp.float32) for s in scales)  # traced, as the engine passes them
    fn = jax.jit(partial(paged_decode_attention, sm_scale=0.3, sliding_window=window, num_splits=2,
                         block_kv=kv_tile(8)))
    got = fn(*args, k_scale=k_scale, v_scale=v_scale)
    want = decode_reference(*args, sm_scale=0.3, sliding_window=window, k_scale=k_scale, v_scale=v_scale)
    assert b.k_cache.dtype == FP8 and got.dtype == dtype
    assert_close(got, want, dtype)
    assert np.all(np.asarray(got[len(DECODE_CONTEXT):], np.float32) == 0)


@pytest.mark.parametrize("group,block_size,dtype,window,scales", FP8_CASES)
def test_ragged_fp8_cache_matches_reference(group, block_size, dtype, window, scales):
    b = quantized(make_batch(group + block_size, RAGGED_CONTEXT, RAGGED_NEW, group=group, block_size=block_size,
                             dtype=dtype), *scales)
    k_scale, v_scale = (jnp.asarray(s, jnp.float32) for s in scales)
    fn = jax.jit(partial(ragged_paged_attention, sm_scale=0.3, sliding_window=window,
                         block_q=q_tile(4, group), block_kv=kv_tile(8)))
    got = fn(*b.args, k_scale=k_scale, v_scale=v_scale)
    want = ragged_reference(*b.args, sm_scale=0.3, sliding_window=window, k_scale=k_scale, v_scale=v_scale)
    assert got.dtype == dtype
    assert_close(got, want, dtype, rows=slice(0, b.num_tokens))
    assert np.all(np.asarray(got[b.num_tokens :], np.float32) == 0)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_kernels_over_an_e5m2_cache_match_reference(dtype):
    """kv_cache_dtype="fp8_e5m2": float8_e5m2 pages go through the same paths as e4m3's."""
    e5m2 = jnp.float8_e5m2
    b = quantized(make_batch(5, DECODE_CONTEXT, [1] * len(DECODE_CONTEXT), group=2, block_size=4, dtype=dtype,
                             pad_tokens=2, pad_seqs=2), 0.05, 0.02, e5m2)
    args = (b.q, b.k_cache, b.v_cache, b.seq_lens, b.block_tables)
    got = paged_decode_attention(*args, sm_scale=0.3, num_splits=2, block_kv=kv_tile(8), k_scale=0.05, v_scale=0.02)
    want = decode_reference(*args, sm_scale=0.3, k_scale=0.05, v_scale=0.02)
    assert b.k_cache.dtype == e5m2 and got.dtype == dtype
    assert_close(got, want, dtype)
    r = quantized(make_batch(6, RAGGED_CONTEXT, RAGGED_NEW, group=2, block_size=4, dtype=dtype), 0.05, 0.02, e5m2)
    got = ragged_paged_attention(*r.args, sm_scale=0.3, block_q=q_tile(4, 2), block_kv=kv_tile(8), k_scale=0.05,
                                 v_scale=0.02)
    want = ragged_reference(*r.args, sm_scale=0.3, k_scale=0.05, v_scale=0.02)
    assert_close(got, want, dtype, rows=slice(0, r.num_tokens))
    # The write clips to e5m2's range, not e4m3's.
    cache = jnp.zeros((1, 1, 2, 2), e5m2)
    new_k, _ = write_kv_reference(cache, cache, jnp.asarray([[[1000.0, -1e6]]], dtype), jnp.zeros((1, 1, 2), dtype),
                                  jnp.asarray([1], jnp.int32))
    np.testing.assert_array_equal(np.asarray(new_k.astype(jnp.float32))[0, 0, 1], [1024.0, -57344.0])


def test_mixed_fp8_cache_matches_reference():
    b = quantized(make_batch(7, RAGGED_CONTEXT, RAGGED_NEW, group=4, dtype=jnp.bfloat16), 0.1, 0.2)
    fn = jax.jit(partial(
        mixed_paged_attention, sm_scale=0.3,
        decode_tuning=dict(num_splits=2, block_kv=kv_tile(8)),
        ragged_tuning=dict(block_q=q_tile(4, 4), block_kv=kv_tile(8)),
    ))
    got = fn(*b.args, k_scale=jnp.float32(0.1), v_scale=jnp.float32(0.2))
    want = ragged_reference(*b.args, sm_scale=0.3, k_scale=0.1, v_scale=0.2)
    assert_close(got, want, jnp.bfloat16, rows=slice(0, b.num_tokens))


def test_fp8_reference_dequantizes_close_to_the_unquantized_cache():
    """The reference over an fp8 cache (x / s stored) is the reference over the dequantized
    cache (stored * s, float32), with scales per tensor or per KV head; against the
    unquantized K/V, e4m3's 3 mantissa bits (relative error <= 2^-4 per element) leave the
    output (values of order 1) close."""
    b = make_batch(11, RAGGED_CONTEXT, RAGGED_NEW, group=2, dtype=jnp.float32)
    for k_scale, v_scale in ((0.01, 0.02), ((0.01, 0.2), (0.02, 0.1))):
        q8 = quantized(b, k_scale, v_scale)
        got = ragged_reference(*q8.args, sm_scale=0.3, k_scale=jnp.asarray(k_scale), v_scale=jnp.asarray(v_scale))
        deq = Batch(b.q, q8.k_cache.astype(jnp.float32) * per_head(k_scale),
                    q8.v_cache.astype(jnp.float32) * per_head(v_scale), *q8.args[3:], b.num_tokens)
        assert_close(got, ragged_reference(*deq.args, sm_scale=0.3), jnp.float32, rows=slice(0, b.num_tokens))
        err = np.abs(np.asarray(got - ragged_reference(*b.args, sm_scale=0.3))[: b.num_tokens])
        assert err.max() < 0.25 and err.mean() < 0.03, (err.max(), err.mean())


def test_kv_scales_are_per_tensor_or_per_kv_head():
    """A scale is one value or one per KV head; the kernels and the write refuse any other
    shape, naming it."""
    b = quantized(make_batch(3, DECODE_CONTEXT, [1] * len(DECODE_CONTEXT), pad_tokens=2, pad_seqs=2), 1.0, 1.0)
    args = (b.q, b.k_cache, b.v_cache, b.seq_lens, b.block_tables)
    three = jnp.ones(3, jnp.float32)
    with pytest.raises(ValueError, match=r"k_scale must be a scalar or \[2\] \(one per KV head\), got shape \(3,\)"):
        paged_decode_attention(*args, sm_scale=0.3, k_scale=three)
    with pytest.raises(ValueError, match=r"v_scale must be a scalar or \[2\]"):
        ragged_paged_attention(*b.args, sm_scale=0.3, v_scale=three)
    with pytest.raises(ValueError, match=r"must be a scalar or \[2\]"):
        write_kv_reference(b.k_cache, b.v_cache, jnp.zeros((1, 2, 16)), jnp.zeros((1, 2, 16)),
                           jnp.zeros(1, jnp.int32), k_scale=three)


def test_fp8_cache_checks_dtypes():
    cache = jnp.zeros((2, 4, 4, 16), FP8)
    with pytest.raises(ValueError, match="q dtype bfloat16 != cache dtype float32"):
        paged_decode_attention(jnp.zeros((2, 4, 16), jnp.bfloat16), cache.astype(jnp.float32),
                               cache.astype(jnp.float32), jnp.zeros(2, jnp.int32), jnp.zeros((2, 2), jnp.int32),
                               sm_scale=1.0)
    with pytest.raises(ValueError, match="not supported"):  # q itself is never fp8
        paged_decode_attention(jnp.zeros((2, 4, 16), FP8), cache, cache, jnp.zeros(2, jnp.int32),
                               jnp.zeros((2, 2), jnp.int32), sm_scale=1.0)


def test_fp8_cache_dots_in_float16_with_queries_clipped_to_its_range():
    """bf16 queries over an fp8 cache dot in float16 (e4m3 converts to it exactly, in one
    instruction per pair); a query beyond float16's range is clipped, not made inf."""
    assert dot_dtype(jnp.bfloat16, FP8) == jnp.float16
    assert dot_dtype(jnp.float32, FP8) == jnp.float32 and dot_dtype(jnp.bfloat16, jnp.bfloat16) == jnp.bfloat16
    q = jnp.array([1e5, -1e5, 1.5, 0.0], jnp.bfloat16)
    clipped = to_dot_dtype(q, jnp.float16)
    assert clipped.dtype == jnp.float16 and np.all(np.isfinite(np.asarray(clipped, np.float32)))
    np.testing.assert_array_equal(np.asarray(clipped, np.float32), [65504, -65504, 1.5, 0])
    b = quantized(make_batch(3, DECODE_CONTEXT, [1] * len(DECODE_CONTEXT), group=2, dtype=jnp.bfloat16,
                             pad_tokens=2, pad_seqs=2), 1.0, 1.0)
    big = b.q.at[0].set(1e5)  # scores far past float16: the softmax picks the largest, finite
    got = paged_decode_attention(big, b.k_cache, b.v_cache, b.seq_lens, b.block_tables, sm_scale=0.3)
    assert np.all(np.isfinite(np.asarray(got, np.float32)))

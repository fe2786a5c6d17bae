"""The Pallas kernels against their plain-jnp references.

On CPU the kernels run in interpret mode (the same kernel body, executed by XLA); on a
GPU with JAXVLLM_PALLAS_INTERPRET=0 (scripts/gpu_check.sh) the same tests run the
compiled Triton kernels, with tiles raised to tl.dot's minimum of 16.

Every batch uses shuffled physical blocks, random K/V in every slot (a read of the wrong
slot shows), garbage block ids past each sequence's blocks, context lengths that are
not multiples of block_size, padding tokens and padding sequences.
"""

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
)
from pallas_kernels.common import (INTERPRET_ENV, default_interpret)
from pallas_kernels.paged_decode_attention import combine_partitions, default_num_splits

from tests.kernels.batches import (DECODE_CONTEXT, RAGGED_CONTEXT, RAGGED_NEW, assert_close, decode_reference,
                                   kv_tile, make_batch, q_tile, ragged_reference)


# -- decode ------------------------------------------------------------------------------------


DECODE_CASES = [
    # group, block_size, tuning, dtype, sliding_window
    pytest.param(1, 4, dict(num_splits=3, block_kv=8, block_h=16), jnp.float32, None, id="g1-split3-rows-padded"),
    pytest.param(2, 4, {}, jnp.float32, None, id="g2-defaults"),
    pytest.param(4, 8, dict(num_splits=4, block_kv=4), jnp.float32, None, id="g4-tile-below-block"),
    pytest.param(8, 6, dict(num_splits=2, block_kv=16), jnp.float32, None, id="g8-block6"),
    pytest.param(4, 4, dict(num_splits=2, block_kv=16), jnp.bfloat16, None, id="g4-bf16"),
    pytest.param(2, 4, dict(num_splits=3, block_kv=8), jnp.float32, 5, id="g2-window5"),
    # Unsplit: the kernel writes the output in q's dtype, no merge.
    pytest.param(2, 4, dict(num_splits=1, block_kv=8), jnp.bfloat16, None, id="g2-bf16-unsplit"),
    pytest.param(4, 8, dict(num_splits=1, block_kv=16), jnp.float32, 5, id="g4-unsplit-window5"),
]


@pytest.mark.parametrize("group,block_size,tuning,dtype,window", DECODE_CASES)
def test_decode_matches_reference(group, block_size, tuning, dtype, window):
    b = make_batch(group * 10 + block_size, DECODE_CONTEXT, [1] * len(DECODE_CONTEXT), group=group,
                   block_size=block_size, dtype=dtype, pad_tokens=2, pad_seqs=2)  # q rows = sequences
    if "block_kv" in tuning:
        tuning = {**tuning, "block_kv": kv_tile(tuning["block_kv"])}
    q = b.q
    args = (q, b.k_cache, b.v_cache, b.seq_lens, b.block_tables)
    got = jax.jit(partial(paged_decode_attention, sm_scale=0.3, sliding_window=window, **tuning))(*args)
    want = decode_reference(*args, sm_scale=0.3, sliding_window=window)
    assert got.shape == q.shape and got.dtype == dtype
    assert_close(got, want, dtype)
    assert np.all(np.asarray(got[len(DECODE_CONTEXT):], np.float32) == 0)  # padding rows (seq_len 0)


def test_decode_query_positions_before_the_end():
    """A query at position p < seq_len - 1 sees keys <= p only (the reference's contract)."""
    b = make_batch(3, DECODE_CONTEXT, [1] * len(DECODE_CONTEXT), pad_tokens=0, pad_seqs=0)
    positions = jnp.maximum(b.seq_lens - 1 - jnp.arange(len(DECODE_CONTEXT)) % 3, 0)
    args = (b.q, b.k_cache, b.v_cache, b.seq_lens, b.block_tables)
    got = paged_decode_attention(*args, sm_scale=0.3, query_positions=positions, num_splits=2, block_kv=kv_tile(8))
    want = decode_reference(*args, sm_scale=0.3, query_positions=positions)
    assert_close(got, want, jnp.float32)


@pytest.mark.parametrize("num_splits", [1, 2])
def test_decode_takes_sequences_in_any_order(num_splits):
    """Programs take sequences in `seq_order` (default: longest first); any permutation
    gives the same output, each row its own sequence's."""
    b = make_batch(4, DECODE_CONTEXT, [1] * len(DECODE_CONTEXT), group=2, pad_tokens=2, pad_seqs=2)
    args = (b.q, b.k_cache, b.v_cache, b.seq_lens, b.block_tables)
    tuning = dict(sm_scale=0.3, num_splits=num_splits, block_kv=kv_tile(8))
    want = decode_reference(*args, sm_scale=0.3)
    default = paged_decode_attention(*args, **tuning)
    shuffled = jnp.asarray(np.random.default_rng(0).permutation(len(b.seq_lens)), jnp.int32)
    got = jax.jit(partial(paged_decode_attention, **tuning))(*args, seq_order=shuffled)
    assert_close(default, want, jnp.float32)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(default))
    with pytest.raises(ValueError, match=r"seq_order must be \[8\], got \(7,\)"):
        paged_decode_attention(*args, **tuning, seq_order=shuffled[:7])


def test_decode_checks_shapes():
    cache = jnp.zeros((2, 4, 4, 16))
    with pytest.raises(ValueError, match="not a multiple"):
        paged_decode_attention(jnp.zeros((2, 3, 16)), cache, cache, jnp.zeros(2, jnp.int32),
                               jnp.zeros((2, 2), jnp.int32), sm_scale=1.0)
    with pytest.raises(ValueError, match="2 sequences"):
        paged_decode_attention(jnp.zeros((2, 4, 16)), cache, cache, jnp.zeros(3, jnp.int32),
                               jnp.zeros((2, 2), jnp.int32), sm_scale=1.0)
    with pytest.raises(ValueError, match="sliding_window"):
        paged_decode_attention(jnp.zeros((2, 4, 16)), cache, cache, jnp.zeros(2, jnp.int32),
                               jnp.zeros((2, 2), jnp.int32), sm_scale=1.0, sliding_window=0)
    with pytest.raises(ValueError, match="q dtype bfloat16 != cache dtype float32"):
        paged_decode_attention(jnp.zeros((2, 4, 16), jnp.bfloat16), cache, cache, jnp.zeros(2, jnp.int32),
                               jnp.zeros((2, 2), jnp.int32), sm_scale=1.0)
    odd = jnp.zeros((2, 4, 4, 24))
    with pytest.raises(ValueError, match="power of 2"):  # checked before anything compiles
        paged_decode_attention(jnp.zeros((2, 4, 24)), odd, odd, jnp.zeros(2, jnp.int32),
                               jnp.zeros((2, 2), jnp.int32), sm_scale=1.0, interpret=False)


def test_combine_partitions_ignores_empty_ones():
    rng = np.random.default_rng(0)
    o = jnp.asarray(rng.normal(size=(3, 1, 4)), jnp.float32)  # [P, G, D]
    m = jnp.asarray([[1.0], [-1e30], [3.0]])
    l = jnp.asarray([[2.0], [0.0], [0.5]])
    o = o.at[1].set(jnp.nan)  # an empty partition's output is never read
    got = combine_partitions(o, m, l)
    w = np.array([2.0 * np.exp(1.0 - 3.0), 0.5])
    want = (w[0] * o[0] + w[1] * o[2]) / w.sum()
    np.testing.assert_allclose(got, want, rtol=1e-6)
    empty = combine_partitions(jnp.ones((2, 1, 4)), jnp.zeros((2, 1)), jnp.zeros((2, 1)))
    np.testing.assert_array_equal(empty, 0.0)


def test_default_num_splits():
    assert default_num_splits(256, 8, 32) == 1  # a big batch fills the GPU by itself
    assert default_num_splits(64, 8, 32) == 8  # 512 programs: the H200's best K1 tuning
    assert default_num_splits(128, 8, 32) == 1  # 1024 programs fill it
    assert default_num_splits(1, 8, 32) == 16  # capped at MAX_SPLITS
    assert default_num_splits(1, 8, 3) == 3  # never more partitions than KV tiles


# -- ragged (prefill, chunked prefill, mixed) ------------------------------------------------

# Whole prompts (context == new), chunks of longer contexts, single tokens, and query
# lengths on and around the tile boundaries of block_q = 4 (4, 5, 16, 17).

RAGGED_CASES = [
    # group, block_size, tuning, dtype, sliding_window
    pytest.param(1, 4, dict(block_q=4, block_kv=8), jnp.float32, None, id="g1"),
    pytest.param(2, 4, {}, jnp.float32, None, id="g2-defaults"),
    pytest.param(4, 8, dict(block_q=2, block_kv=4), jnp.float32, None, id="g4-tile-below-block"),
    pytest.param(8, 6, dict(block_q=1, block_kv=16), jnp.float32, None, id="g8-block6"),
    pytest.param(2, 4, dict(block_q=4, block_kv=8), jnp.bfloat16, None, id="g2-bf16"),
    pytest.param(2, 4, dict(block_q=4, block_kv=8), jnp.float32, 5, id="g2-window5"),
]


@pytest.mark.parametrize("group,block_size,tuning,dtype,window", RAGGED_CASES)
def test_ragged_matches_reference(group, block_size, tuning, dtype, window):
    b = make_batch(group * 10 + block_size, RAGGED_CONTEXT, RAGGED_NEW, group=group, block_size=block_size,
                   dtype=dtype)
    tuning = dict(tuning)
    if "block_kv" in tuning:
        tuning["block_kv"] = kv_tile(tuning["block_kv"])
    if "block_q" in tuning:
        tuning["block_q"] = q_tile(tuning["block_q"], group)
    got = jax.jit(partial(ragged_paged_attention, sm_scale=0.3, sliding_window=window, **tuning))(*b.args)
    want = ragged_reference(*b.args, sm_scale=0.3, sliding_window=window)
    assert got.shape == b.q.shape and got.dtype == dtype
    assert_close(got, want, dtype, rows=slice(0, b.num_tokens))
    assert np.all(np.asarray(got[b.num_tokens :], np.float32) == 0)  # padding tokens


def test_ragged_checks_shapes():
    cache = jnp.zeros((2, 4, 4, 16))
    i32 = partial(jnp.zeros, dtype=jnp.int32)
    with pytest.raises(ValueError, match="not a multiple"):
        ragged_paged_attention(jnp.zeros((4, 3, 16)), cache, cache, i32(4), i32(2), i32(1), i32((1, 2)), sm_scale=1.0)
    with pytest.raises(ValueError, match="positions must be"):
        ragged_paged_attention(jnp.zeros((4, 4, 16)), cache, cache, i32(3), i32(2), i32(1), i32((1, 2)), sm_scale=1.0)
    with pytest.raises(ValueError, match="block_q"):
        ragged_paged_attention(jnp.zeros((4, 4, 16)), cache, cache, i32(4), i32(2), i32(1), i32((1, 2)),
                               sm_scale=1.0, block_q=3)


# -- the backend: decode rows to the decode kernel, the rest to the ragged kernel -----------

MIXED_BATCHES = {  # context, new, padding tokens, padding sequences
    "mixed": (RAGGED_CONTEXT, RAGGED_NEW, 3, 2),
    # More sequence rows than tokens: padding rows (the runner pads to min(max_num_seqs, T)).
    "decode-only-more-seqs-than-tokens": ([5, 1, 33, 16, 9], [1, 1, 1, 1, 1], 1, 6),
    "prefill-only": ([12, 7, 20], [12, 7, 3], 3, 2),
}
MIXED_CASES = [
    pytest.param(kind, 2, jnp.float32, None, id=f"g2-{kind}") for kind in MIXED_BATCHES
] + [
    pytest.param("mixed", 4, jnp.bfloat16, 6, id="g4-bf16-window6-mixed"),
    pytest.param("mixed", 3, jnp.float32, None, id="g3-rows-padded-mixed"),  # G not a power of 2
]


@pytest.mark.parametrize("kind,group,dtype,window", MIXED_CASES)
def test_mixed_matches_reference(kind, group, dtype, window):
    context, new, pad_tokens, pad_seqs = MIXED_BATCHES[kind]
    b = make_batch(7, context, new, group=group, dtype=dtype, pad_tokens=pad_tokens, pad_seqs=pad_seqs)
    fn = jax.jit(partial(
        mixed_paged_attention, sm_scale=0.3, sliding_window=window,
        decode_tuning=dict(num_splits=2, block_kv=kv_tile(8)),
        ragged_tuning=dict(block_q=q_tile(4, group), block_kv=kv_tile(8)),
    ))
    got = fn(*b.args)
    want = ragged_reference(*b.args, sm_scale=0.3, sliding_window=window)
    assert_close(got, want, dtype, rows=slice(0, b.num_tokens))
    assert np.all(np.asarray(got[b.num_tokens :], np.float32) == 0)


@pytest.mark.parametrize("pad_tokens,dtype", [(0, jnp.float32), (3, jnp.bfloat16)])
def test_decode_only_batch_runs_the_decode_kernel_alone(pad_tokens, dtype):
    """decode_only=True (sequence s owns token s alone): the same outputs as the reference,
    padding sequence rows and tokens beyond them zeros, and no ragged kernel traced."""
    context = [5, 1, 33, 16, 9]
    b = make_batch(8, context, [1] * len(context), group=2, dtype=dtype, pad_tokens=pad_tokens + 2, pad_seqs=2)
    fn = partial(mixed_paged_attention, sm_scale=0.3, decode_only=True,
                 decode_tuning=dict(num_splits=2, block_kv=kv_tile(8)))
    got = jax.jit(fn)(*b.args)
    want = ragged_reference(*b.args, sm_scale=0.3)
    assert_close(got, want, dtype, rows=slice(0, b.num_tokens))
    assert np.all(np.asarray(got[b.num_tokens :], np.float32) == 0)
    jaxpr = str(jax.make_jaxpr(fn)(*b.args))
    assert "jaxvllm_paged_decode_attention" in jaxpr and "jaxvllm_ragged_paged_attention" not in jaxpr
    with pytest.raises(ValueError, match="decode_only: 7 sequence rows for 5 tokens"):
        mixed_paged_attention(b.q[:5], b.k_cache, b.v_cache, b.positions[:5], *b.args[4:], sm_scale=0.3,
                              decode_only=True)


# -- plumbing ------------------------------------------------------------------------------------


def test_interpret_default_follows_backend_and_env(monkeypatch):
    monkeypatch.delenv(INTERPRET_ENV, raising=False)
    assert default_interpret() == (jax.default_backend() == "cpu")
    monkeypatch.setenv(INTERPRET_ENV, "0")
    assert default_interpret() is False
    monkeypatch.setenv(INTERPRET_ENV, "1")
    assert default_interpret() is True


def test_backend_resolution(monkeypatch):
    from jaxvllm.config import ATTENTION_BACKENDS
    from jaxvllm.model_runner import resolve_backend

    assert "pallas" in ATTENTION_BACKENDS
    assert resolve_backend("pallas") == "pallas"
    assert resolve_backend("reference") == "reference"
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    assert resolve_backend("auto") == "reference"
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert resolve_backend("auto") == "pallas"
    assert resolve_backend("auto", softcapped=True) == "reference"  # the kernels lack it
    with pytest.raises(ValueError, match="attention_backend 'flash'"):
        resolve_backend("flash")

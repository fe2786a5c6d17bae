"""The Pallas kernels against their plain-jnp references.

On CPU the kernels run in interpret mode (the same kernel body, executed by XLA); on a
GPU with JAXVLLM_PALLAS_INTERPRET=0 (scripts/gpu_check.sh) the same tests run the
compiled Triton kernels, with tiles raised to tl.dot's minimum of 16.

Every batch uses shuffled physical blocks, random K/V in every slot (a read of the wrong
slot shows), garbage block ids past each sequence's blocks, context lengths that are
not multiples of block_size, padding tokens and padding sequences.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import (
    mixed_paged_attention,
    paged_decode_attention,
    paged_decode_attention_reference,
    ragged_paged_attention,
    ragged_paged_attention_reference,
    write_kv_reference,
)
from pallas_kernels.common import (INTERPRET_ENV, MIN_DOT_DIM, cdiv, default_interpret, dot_dtype, next_power_of_2,
                                    to_dot_dtype)
from pallas_kernels.paged_decode_attention import combine_partitions, default_num_splits

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


# -- decode ------------------------------------------------------------------------------------

DECODE_CONTEXT = [1, 7, 40, 13, 33, 16]  # one token, partial blocks, several tiles, exact blocks

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
RAGGED_CONTEXT = [9, 14, 6, 1, 30, 17, 16, 4]
RAGGED_NEW = [1, 5, 6, 1, 17, 16, 4, 4]

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

"""The Pallas grouped matmul against its plain-jnp reference and jax.lax.ragged_dot.

On CPU the kernel runs in interpret mode; on a GPU with JAXVLLM_PALLAS_INTERPRET=0 the same
tests run it compiled, with tiles raised to tl.dot's minimum of 16.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from pallas_kernels.common import MIN_DOT_DIM, default_interpret
from pallas_kernels.grouped_matmul import (
    default_block_m,
    grouped_matmul,
    grouped_matmul_reference,
    make_schedule,
    max_visits,
)

INTERPRET = default_interpret()
TOL = {jnp.float32: dict(atol=1e-4, rtol=1e-4), jnp.bfloat16: dict(atol=3e-2, rtol=3e-2)}
reference = jax.jit(grouped_matmul_reference)


def tile(n: int | None) -> int | None:
    """A tile the compiled kernel accepts (>= 16); interpret mode takes any."""
    return n if n is None or INTERPRET else max(n, MIN_DOT_DIM)


def operands(seed: int, m: int, k: int, n: int, sizes: list[int], dtype):
    rng = np.random.default_rng(seed)
    lhs = jnp.asarray(rng.normal(size=(m, k)), dtype)
    rhs = jnp.asarray(rng.normal(size=(len(sizes), k, n)) / np.sqrt(k), dtype)
    return lhs, rhs, jnp.asarray(np.asarray(sizes, np.int32))


def eight_bit_operands(rng, m: int, k: int, n: int, num_groups: int, dtype):
    """8-bit lhs [m, k] and rhs [num_groups, k, n]: int8 over its whole range, e4m3 from normals times 40."""
    if dtype == jnp.int8:
        return (jnp.asarray(rng.integers(-128, 128, (m, k)), dtype),
                jnp.asarray(rng.integers(-128, 128, (num_groups, k, n)), dtype))
    return (jnp.asarray(rng.normal(size=(m, k)) * 40, dtype),
            jnp.asarray(rng.normal(size=(num_groups, k, n)) * 40, dtype))


def exact_ragged_dot(lhs, rhs, group_sizes):
    """ragged_dot of 8-bit operands without rounding: int8 accumulating in int32, e4m3 taken
    as float32 at HIGHEST precision (each product exact, float32 sums). XLA's ragged_dot on
    the fp8 operands themselves runs fp8 tensor cores on an H100, which accumulate with
    fewer bits (off by up to 2.1 at a magnitude of 8,000 in this file's sweep)."""
    if lhs.dtype == jnp.int8:
        return jax.lax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=jnp.int32).astype(jnp.float32)
    return jax.lax.ragged_dot(lhs.astype(jnp.float32), rhs.astype(jnp.float32), group_sizes,
                              precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)


def assert_close(got, want, dtype):
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), **TOL[dtype])


CASES = [
    # m, k, n, group sizes, tiles (block_m, block_n, block_k)
    pytest.param(37, 24, 20, [0, 5, 13, 0, 9, 3], (8, 16, 16), id="empty-groups-straddling-tiles-rows-beyond"),
    pytest.param(40, 16, 16, [40], (16, 16, 16), id="one-group-all-rows"),
    pytest.param(33, 16, 24, [0, 0, 33], (16, 16, 8), id="last-group-all-rows-m-not-multiple"),
    pytest.param(30, 16, 16, [0, 0, 0, 0], (8, 16, 16), id="no-rows-in-any-group"),
    pytest.param(50, 40, 48, [3, 1, 1, 2, 20, 0, 7, 9], (16, 32, 16), id="several-boundaries-per-tile"),
    pytest.param(64, 32, 32, [16, 16, 16, 16], (16, 16, 16), id="boundaries-on-tile-edges"),
    pytest.param(48, 20, 36, [10, 0, 25], (32, 16, 8), id="k-n-not-multiples-of-tiles"),
    pytest.param(19, 16, 16, [7, 12], (None, None, None), id="defaults"),
]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("m,k,n,sizes,tiles", CASES)
def test_matches_reference(m, k, n, sizes, tiles, dtype):
    lhs, rhs, group_sizes = operands(m * 7 + len(sizes), m, k, n, sizes, dtype)
    block_m, block_n, block_k = map(tile, tiles)
    fn = jax.jit(partial(grouped_matmul, block_m=block_m, block_n=block_n, block_k=block_k))
    got = fn(lhs, rhs, group_sizes)
    want = reference(lhs, rhs, group_sizes)
    assert got.shape == (m, n) and got.dtype == dtype
    assert_close(got, want, dtype)
    total = min(sum(sizes), m)
    assert np.all(np.asarray(got[total:], np.float32) == 0)  # rows past the groups: zeros, as ragged_dot
    if dtype == jnp.float32:  # the reference is ragged_dot's contract
        ragged = jax.lax.ragged_dot(lhs, rhs, group_sizes, precision=jax.lax.Precision.HIGHEST)
        assert_close(ragged, want, dtype)


@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.int8])
@pytest.mark.parametrize("m,k,n,sizes,tiles", CASES)
def test_eight_bit_operands(m, k, n, sizes, tiles, dtype):
    """W8A8 expert stacks: 8-bit lhs and rhs, float32 out, equal to an exact ragged_dot:
    every product of two 8-bit values is exact in float32, so only the order of the sums
    differs."""
    lhs, rhs = eight_bit_operands(np.random.default_rng(m + k), m, k, n, len(sizes), dtype)
    group_sizes = jnp.asarray(np.asarray(sizes, np.int32))
    block_m, block_n, block_k = map(tile, tiles)
    got = jax.jit(partial(grouped_matmul, block_m=block_m, block_n=block_n, block_k=block_k))(lhs, rhs, group_sizes)
    want = exact_ragged_dot(lhs, rhs, group_sizes)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-3)
    np.testing.assert_allclose(np.asarray(reference(lhs, rhs, group_sizes)), np.asarray(got), rtol=1e-6, atol=1e-3)


BLOCK_SCALED_CASES = [
    # m, k, n, group sizes, tiles (block_m, block_n, block_k), scale_size
    pytest.param(37, 48, 20, [0, 5, 13, 0, 9, 3], (8, 16, 16), 16, id="blocks-of-16-steps-of-16"),
    pytest.param(40, 64, 32, [11, 29], (16, 16, 8), 32, id="four-steps-a-block"),
    pytest.param(33, 40, 24, [0, 20, 13], (16, 16, 8), 16, id="partial-last-block"),
    pytest.param(50, 32, 48, [3, 1, 1, 2, 20, 0, 7, 9], (None, None, None), 16, id="defaults"),
    pytest.param(24, 96, 16, [24], (None, None, None), 32, id="default-block-k-divides-the-block"),
]


@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.int8])
@pytest.mark.parametrize("m,k,n,sizes,tiles,scale_size", BLOCK_SCALED_CASES)
def test_block_scales(m, k, n, sizes, tiles, scale_size, dtype):
    """Block-scaled 8-bit operands (a block-fp8 checkpoint's experts and their rows quantized
    per block): each block's product scaled by its rows' and columns' scales, equal to the
    reference's product of the scaled operands and to one ragged_dot per block."""
    rng = np.random.default_rng(m + k + scale_size)
    lhs, rhs = eight_bit_operands(rng, m, k, n, len(sizes), dtype)
    blocks = -(-k // scale_size)
    lhs_scale = jnp.asarray(rng.uniform(0.01, 1, (m, blocks)), jnp.float32)
    rhs_scale = jnp.asarray(rng.uniform(0.01, 1, (len(sizes), blocks, n)), jnp.float32)
    group_sizes = jnp.asarray(np.asarray(sizes, np.int32))
    block_m, block_n, block_k = map(tile, tiles)
    fn = jax.jit(partial(grouped_matmul, block_m=block_m, block_n=block_n, block_k=block_k, scale_size=scale_size))
    got = fn(lhs, rhs, group_sizes, lhs_scale=lhs_scale, rhs_scale=rhs_scale)
    assert got.shape == (m, n) and got.dtype == jnp.float32
    want = grouped_matmul_reference(lhs, rhs, group_sizes, lhs_scale=lhs_scale, rhs_scale=rhs_scale,
                                    scale_size=scale_size)
    scale = float(jnp.max(jnp.abs(want)))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5 * scale)
    expert_of_row = jnp.repeat(jnp.arange(len(sizes)), group_sizes, total_repeat_length=m)
    per_block = sum(exact_ragged_dot(lhs[:, lo:lo + scale_size], rhs[:, lo:lo + scale_size], group_sizes)
                    * lhs_scale[:, b, None] * rhs_scale[expert_of_row, b]
                    for b, lo in enumerate(range(0, k, scale_size)))
    np.testing.assert_allclose(np.asarray(got), np.asarray(per_block), rtol=1e-5, atol=1e-5 * scale)


def test_block_scale_errors():
    lhs, rhs, sizes = operands(0, 8, 32, 16, [4, 4], jnp.float32)
    lhs, rhs = lhs.astype(jnp.float8_e4m3fn), rhs.astype(jnp.float8_e4m3fn)
    row, col = jnp.ones((8, 2), jnp.float32), jnp.ones((2, 2, 16), jnp.float32)
    with pytest.raises(ValueError, match="together"):
        grouped_matmul(lhs, rhs, sizes, lhs_scale=row, scale_size=16)
    with pytest.raises(ValueError, match=r"lhs_scale must be \[8, 2\] and rhs_scale \[2, 2, 16\]"):
        grouped_matmul(lhs, rhs, sizes, lhs_scale=row[:, :1], rhs_scale=col, scale_size=16)
    with pytest.raises(ValueError, match="float32"):
        grouped_matmul(lhs, rhs, sizes, lhs_scale=row.astype(jnp.bfloat16), rhs_scale=col, scale_size=16)
    with pytest.raises(ValueError, match="8-bit operands"):
        grouped_matmul(lhs.astype(jnp.float32), rhs.astype(jnp.float32), sizes, lhs_scale=row, rhs_scale=col,
                       scale_size=16)
    with pytest.raises(ValueError, match="block_k 32 must divide scale_size 16"):
        grouped_matmul(lhs, rhs, sizes, lhs_scale=row, rhs_scale=col, scale_size=16, block_k=32)


def test_traced_group_sizes_one_compile():
    """Group sizes are data: one compiled kernel serves every routing."""
    lhs, rhs, _ = operands(1, 40, 16, 16, [0] * 5, jnp.float32)
    fn = jax.jit(partial(grouped_matmul, block_m=tile(8), block_n=16, block_k=16))
    rng = np.random.default_rng(2)
    for _ in range(3):
        sizes = rng.multinomial(int(rng.integers(20, 41)), [0.2] * 5).astype(np.int32)
        assert_close(fn(lhs, rhs, jnp.asarray(sizes)), reference(lhs, rhs, jnp.asarray(sizes)), jnp.float32)
    assert fn._cache_size() == 1


@pytest.mark.parametrize("seed", range(6))
def test_schedule_covers_every_row_once(seed):
    """Each row is owned by exactly one visit, of its own group (-1 past the groups), within
    the visit's tile; the visits fit the static bound."""
    rng = np.random.default_rng(seed)
    num_groups = int(rng.integers(1, 12))
    m, block_m = int(rng.integers(1, 90)), int(rng.choice([1, 4, 8, 16, 64]))
    sizes = rng.multinomial(int(rng.integers(0, m + 1)), np.ones(num_groups) / num_groups)
    sizes[rng.random(num_groups) < 0.3] = 0
    schedule = np.asarray(make_schedule(jnp.asarray(sizes, jnp.int32), m, block_m))
    assert schedule.shape == (max_visits(m, num_groups, block_m), 4)
    owner = np.full(m, -2)
    ends = np.cumsum(sizes)
    group_of_row = np.where(np.arange(m) < ends[-1], np.searchsorted(ends, np.arange(m), side="right"), -1)
    for group, t, lo, hi in schedule:
        assert t * block_m <= lo <= hi <= min(t * block_m + block_m, m) or lo == hi == 0
        assert np.all(owner[lo:hi] == -2)  # no row twice
        owner[lo:hi] = group
    np.testing.assert_array_equal(owner, group_of_row)


def test_default_block_m():
    assert default_block_m(2048, 128) == 16  # decode: 256 tokens x top-8 over 128 experts
    assert default_block_m(8192, 128) == 64
    assert default_block_m(65536, 128) == 64
    assert default_block_m(5, 4) == 16


def test_shape_errors():
    lhs, rhs, sizes = operands(0, 8, 16, 16, [4, 4], jnp.float32)
    with pytest.raises(ValueError, match="k="):
        grouped_matmul(lhs[:, :8], rhs, sizes)
    with pytest.raises(ValueError, match="group_sizes"):
        grouped_matmul(lhs, rhs, sizes[:1])
    with pytest.raises(ValueError, match="dtype"):
        grouped_matmul(lhs.astype(jnp.bfloat16), rhs, sizes)
    with pytest.raises(ValueError, match="power of 2"):
        grouped_matmul(lhs, rhs, sizes, block_m=24, interpret=False)
    assert grouped_matmul(lhs[:0], rhs, sizes).shape == (0, 16)


H200 = jax.sharding.AbstractMesh(
    (1,), ("x",), abstract_device=jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=None, platform="gpu")
)


@pytest.mark.parametrize("m,k,n", [(2048, 2048, 768), (8192, 768, 2048)])
def test_lowers_to_triton_at_qwen3_moe_shapes(m, k, n):
    """Qwen3-30B-A3B's experts (128, bf16) through Pallas' Triton lowering for CUDA, on any host."""
    fn = partial(grouped_matmul, interpret=False)
    args = (jax.ShapeDtypeStruct((m, k), jnp.bfloat16), jax.ShapeDtypeStruct((128, k, n), jnp.bfloat16),
            jax.ShapeDtypeStruct((128,), jnp.int32))
    call = "__gpu$xla.gpu.triton"
    with jax.sharding.use_abstract_mesh(H200):
        exported = export.export(jax.jit(fn), platforms=("cuda",),
                                 disabled_checks=[export.DisabledSafetyCheck.custom_call(call)])(*args)
    assert exported.mlir_module().count(call) == 1
    assert exported.out_avals[0].shape == (m, n)

"""The Pallas grouped W4A16 (and W8A16) matmul against its plain-jnp reference and
jax.lax.ragged_dot over the dequantized stack.

On CPU the kernel runs in interpret mode; on a GPU with JAXVLLM_PALLAS_INTERPRET=0 the same
tests run it compiled, with tiles raised to tl.dot's minimum of 16 (int4: block_n / 2).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from pallas_kernels.common import MIN_DOT_DIM, default_interpret
from pallas_kernels.grouped_int4_matmul import (
    grouped_int4_matmul,
    grouped_int4_matmul_reference,
    pack_int4,
    unpack_int4,
)

INTERPRET = default_interpret()


def tiles(block_m, block_n, block_k):
    """Tiles the compiled kernel accepts (each dot's dimensions >= 16); interpret mode takes any."""
    if INTERPRET or block_m is None:
        return dict(block_m=block_m, block_n=block_n, block_k=block_k)
    return dict(block_m=max(block_m, MIN_DOT_DIM), block_n=max(block_n, 2 * MIN_DOT_DIM),
                block_k=max(block_k, MIN_DOT_DIM))


def operands(seed: int, m: int, k: int, n: int, sizes: list[int], group: int, asymmetric: bool, bits: int = 4,
             dtype=jnp.float32):
    """lhs, the values [G, k, n] (int4 or int8), scales and zero points [G, k / group, n], group sizes."""
    rng = np.random.default_rng(seed)
    half, groups = 2 ** (bits - 1), k // (group or k)
    values = jnp.asarray(rng.integers(-half, half, (len(sizes), k, n)), jnp.int4 if bits == 4 else jnp.int8)
    scale = jnp.asarray(rng.uniform(0.01, 0.1, (len(sizes), groups, n)) / 2 ** (bits - 4), jnp.float32)
    zero = jnp.asarray(rng.integers(-half, half, scale.shape), jnp.float32) if asymmetric else None
    lhs = jnp.asarray(rng.standard_normal((m, k)), dtype)
    return lhs, values, scale, zero, jnp.asarray(np.asarray(sizes, np.int32))


def ragged(lhs, values, scale, zero, group_sizes, group):
    """ragged_dot over the stack dequantized from the int values themselves (not the packing),
    rounded to lhs' dtype as the kernel rounds its tiles."""
    per_input = partial(jnp.repeat, repeats=group or values.shape[1], axis=1)
    w = (values.astype(jnp.float32) - (0 if zero is None else per_input(zero))) * per_input(scale)
    w = w.astype(lhs.dtype).astype(jnp.float32)
    return jax.lax.ragged_dot(lhs.astype(jnp.float32), w, group_sizes, precision=jax.lax.Precision.HIGHEST)


CASES = [
    # m, k, n, group sizes, group_size, tiles (block_m, block_n, block_k), zero points
    pytest.param(37, 64, 48, [0, 5, 13, 0, 9, 3], 32, (8, 32, 16), True,
                 id="empty-groups-straddling-tiles-rows-beyond-n-masked"),
    pytest.param(50, 128, 64, [3, 1, 1, 2, 20, 0, 7, 9], 64, (16, 32, 32), False,
                 id="several-boundaries-per-tile-group-64"),
    pytest.param(40, 256, 32, [40], 128, (None, None, None), True, id="one-group-all-rows-group-128-defaults"),
    pytest.param(33, 128, 80, [0, 0, 33], 0, (16, 64, 64), False, id="one-scale-a-column-m-not-multiple"),
    pytest.param(30, 64, 32, [0, 0, 0, 0], 32, (8, 32, 32), True, id="no-rows-in-any-group"),
    pytest.param(64, 128, 64, [16, 16, 16, 16], 32, (16, 64, 32), True, id="boundaries-on-tile-edges"),
]


def check(got, want, m, sizes, rtol=1e-5, atol=1e-5):
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=rtol, atol=atol)
    total = min(sum(sizes), m)
    assert np.all(np.asarray(got[total:], np.float32) == 0)  # rows past the groups: zeros, as ragged_dot


@pytest.mark.parametrize("m,k,n,sizes,group,tile,asymmetric", CASES)
def test_int4_matches_reference(m, k, n, sizes, group, tile, asymmetric):
    lhs, values, scale, zero, group_sizes = operands(m + k + n, m, k, n, sizes, group, asymmetric)
    fn = jax.jit(partial(grouped_int4_matmul, group_size=group, **tiles(*tile)))
    got = fn(lhs, pack_int4(values), group_sizes, scale, zero)
    assert got.shape == (m, n) and got.dtype == jnp.float32
    want = ragged(lhs, values, scale, zero, group_sizes, group)
    check(got, want, m, sizes)
    reference = grouped_int4_matmul_reference(lhs, pack_int4(values), group_sizes, scale, zero, group_size=group)
    check(reference, want, m, sizes)


@pytest.mark.parametrize("m,k,n,sizes,group,tile,asymmetric", CASES[:2])
def test_int8_values(m, k, n, sizes, group, tile, asymmetric):
    """8-bit GPTQ's stacks (W8A16): int8 tiles read as they are, one dot a step."""
    lhs, values, scale, zero, group_sizes = operands(m + k, m, k, n, sizes, group, not asymmetric, bits=8)
    got = jax.jit(partial(grouped_int4_matmul, group_size=group, **tiles(*tile)))(lhs, values, group_sizes, scale,
                                                                                   zero)
    want = ragged(lhs, values, scale, zero, group_sizes, group)
    check(got, want, m, sizes)
    check(grouped_int4_matmul_reference(lhs, values, group_sizes, scale, zero, group_size=group), want, m, sizes)


def test_bfloat16_rows_and_output():
    """bf16 rows: the dequantized tiles are bf16 too (as the model runs them), the output bf16
    when asked: the float32 product of the bf16 weights, rounded once."""
    sizes = [7, 0, 20, 5]
    lhs, values, scale, zero, group_sizes = operands(3, 40, 256, 64, sizes, 128, True, dtype=jnp.bfloat16)
    got = grouped_int4_matmul(lhs, pack_int4(values), group_sizes, scale, zero, group_size=128,
                              out_dtype=jnp.bfloat16)
    assert got.dtype == jnp.bfloat16
    check(got, ragged(lhs, values, scale, zero, group_sizes, 128), 40, sizes, rtol=1e-2, atol=1e-2)


def test_pack_is_the_documented_layout():
    """Column 2c in byte c's low nibble, 2c + 1 in its high one, two's complement, along n;
    `unpack_int4` gives the values back."""
    w = jnp.asarray(np.array([[[-8, 7, 1, -1], [0, 2, -3, 4]]], np.int8), jnp.int4)  # [1, k 2, n 4]
    packed = pack_int4(w)
    assert packed.shape == (1, 2, 2) and np.asarray(packed).tolist() == [[[0x78, 0xF1], [0x20, 0x4D]]]
    np.testing.assert_array_equal(np.asarray(unpack_int4(packed)), np.asarray(w, np.int32))


def test_shape_errors():
    lhs, values, scale, zero, sizes = operands(0, 8, 64, 32, [4, 4], 32, True)
    packed = pack_int4(values)
    with pytest.raises(ValueError, match="k=64"):
        grouped_int4_matmul(lhs[:, :32], packed, sizes, scale, zero, group_size=32)
    with pytest.raises(ValueError, match="must be uint8"):
        grouped_int4_matmul(lhs, packed.astype(jnp.int32), sizes, scale, zero, group_size=32)
    with pytest.raises(ValueError, match=r"scale \(and zero\) must be \[2, 2, 32\]"):
        grouped_int4_matmul(lhs, packed, sizes, scale[:, :1], zero, group_size=32)
    with pytest.raises(ValueError, match="group_size 48 must divide k 64"):
        grouped_int4_matmul(lhs, packed, sizes, scale, zero, group_size=48)
    with pytest.raises(ValueError, match="block_k 64 must divide the group of 32"):
        grouped_int4_matmul(lhs, packed, sizes, scale, zero, group_size=32, block_k=64)
    with pytest.raises(ValueError, match="group_sizes"):
        grouped_int4_matmul(lhs, packed, sizes[:1], scale, zero, group_size=32)
    with pytest.raises(ValueError, match=r"block_n / 2 \(8\)"):
        grouped_int4_matmul(lhs, packed, sizes, scale, zero, group_size=32, block_n=16, interpret=False)
    assert grouped_int4_matmul(lhs[:0], packed, sizes, scale, zero, group_size=32).shape == (0, 32)


H200 = jax.sharding.AbstractMesh(
    (1,), ("x",), abstract_device=jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=None, platform="gpu")
)


def test_lowers_to_triton_at_qwen3_moe_shapes():
    """Qwen3-30B-A3B-GPTQ-Int4's gate/up (128 experts, groups of 128, zero points) through
    Pallas' Triton lowering for CUDA, on any host; the packing is a bitcast, in the call."""
    m, k, n = 2048, 2048, 768

    def fn(lhs, values, group_sizes, scale, zero):
        return grouped_int4_matmul(lhs, pack_int4(values), group_sizes, scale, zero, group_size=128, interpret=False)

    args = (jax.ShapeDtypeStruct((m, k), jnp.bfloat16), jax.ShapeDtypeStruct((128, k, n), jnp.int4),
            jax.ShapeDtypeStruct((128,), jnp.int32), *[jax.ShapeDtypeStruct((128, k // 128, n), jnp.float32)] * 2)
    call = "__gpu$xla.gpu.triton"
    with jax.sharding.use_abstract_mesh(H200):
        exported = export.export(jax.jit(fn), platforms=("cuda",),
                                 disabled_checks=[export.DisabledSafetyCheck.custom_call(call)])(*args)
    assert exported.mlir_module().count(call) == 1
    assert exported.out_avals[0].shape == (m, n) and exported.out_avals[0].dtype == jnp.float32

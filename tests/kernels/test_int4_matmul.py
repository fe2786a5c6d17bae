"""The Pallas W4A16 matmul against its plain-jnp reference and a dense float32 product.

On CPU the kernel runs in interpret mode; on a GPU with JAXVLLM_PALLAS_INTERPRET=0 the same
tests run it compiled (tiles raised to tl.dot's minimum).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.common import MIN_DOT_DIM, default_interpret
from pallas_kernels.int4_matmul import int4_matmul, int4_matmul_reference, pack_int4

INTERPRET = default_interpret()


def operands(seed: int, m: int, k: int, n: int, group: int, asymmetric: bool, dtype):
    rng = np.random.default_rng(seed)
    groups = k // (group or k)
    w = jnp.asarray(rng.integers(-8, 8, (n, k)), jnp.int4)
    scale = jnp.asarray(rng.uniform(0.01, 0.1, (n, groups)), jnp.float32)
    zero = jnp.asarray(rng.integers(-8, 8, (n, groups)), jnp.float32) if asymmetric else None
    return jnp.asarray(rng.standard_normal((m, k)), dtype), w, scale, zero


def dense(x, w, scale, zero, group):
    """x @ ((w - zero) * scale).T in float32, from the int4 array itself (not the packing)."""
    per_input = partial(jnp.repeat, repeats=group or w.shape[1], axis=1)
    weight = (w.astype(jnp.float32) - (0 if zero is None else per_input(zero))) * per_input(scale)
    return jnp.dot(x.astype(jnp.float32), weight.T, precision=jax.lax.Precision.HIGHEST)


CASES = [  # m, k, n, group_size, block_k (None: the default)
    pytest.param(1, 256, 64, 128, None, id="batch-1"),
    pytest.param(5, 128, 48, 32, 32, id="n-not-a-multiple-of-the-tile"),
    pytest.param(37, 256, 80, 64, 32, id="several-groups-per-tile-row"),
    pytest.param(16, 64, 32, 0, 32, id="one-group-a-row"),
]


@pytest.mark.parametrize("asymmetric", [False, True], ids=["symmetric", "zero-points"])
@pytest.mark.parametrize("m,k,n,group,block_k", CASES)
def test_matches_reference(m, k, n, group, block_k, asymmetric):
    x, w, scale, zero = operands(m + k + n, m, k, n, group, asymmetric, jnp.float32)
    block_k = block_k if block_k is None or INTERPRET else max(block_k, 2 * MIN_DOT_DIM)
    got = jax.jit(partial(int4_matmul, group_size=group, block_k=block_k))(x, pack_int4(w), scale, zero)
    want = dense(x, w, scale, zero, group)
    assert got.shape == (m, n) and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    reference = int4_matmul_reference(x, pack_int4(w), scale, zero, group_size=group)
    np.testing.assert_allclose(np.asarray(reference), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_bfloat16_activations():
    """bf16 x: the dequantized weights are bf16 too (as the model runs them), within bf16's error."""
    x, w, scale, zero = operands(0, 9, 256, 64, 128, True, jnp.bfloat16)
    got = int4_matmul(x, pack_int4(w), scale, zero, group_size=128)
    want = dense(x, w, scale, zero, 128)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-2, atol=5e-2)


def test_pack_is_the_documented_layout():
    """Input 2j in a byte's low nibble, 2j + 1 in its high one, two's complement."""
    w = jnp.asarray(np.array([[-8, 7, 1, -1]], np.int8), jnp.int4)
    assert np.asarray(pack_int4(w)).tolist() == [[0x78, 0xF1]]


def test_shape_errors():
    x, w, scale, zero = operands(0, 4, 128, 32, 64, True, jnp.float32)
    packed = pack_int4(w)
    with pytest.raises(ValueError, match=r"packed must be uint8 \[32, 64\]"):
        int4_matmul(x, packed[:, :32], scale, zero, group_size=64)
    with pytest.raises(ValueError, match=r"scale \(and zero\) must be \[32, 2\]"):
        int4_matmul(x, packed, scale[:, :1], zero, group_size=64)
    with pytest.raises(ValueError, match="group_size 48 must divide k 128"):
        int4_matmul(x, packed, scale, zero, group_size=48)
    with pytest.raises(ValueError, match="block_k 128 must be even and divide the group of 64 inputs"):
        int4_matmul(x, packed, scale, zero, group_size=64, block_k=128)

"""RoPE as the models apply it (the models' parity with HF transformers, every architecture:
tests/models/test_hf_parity.py)."""

import jax.numpy as jnp
import numpy as np
import pytest


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_rope_rotates_half_without_a_concatenate(dtype):
    """apply_rope is HF's x * cos + rotate_half(x) * sin bit for bit, with rotate_half as a
    flip of the two halves (no concatenate of x, which would make XLA start a fusion of its
    own: one more kernel per layer in a mixed step, `python -m jaxvllm.benchmarks.aot_engine`)."""
    import jax

    from jaxvllm.layers import apply_rope, rope_inv_freq
    from jaxvllm.model_config import RopeConfig

    rope = RopeConfig(theta=10000.0)
    x = jnp.asarray(np.random.default_rng(0).normal(size=(37, 4, 64)), dtype)
    positions = jnp.arange(37, dtype=jnp.int32) * 13
    angles = positions.astype(jnp.float32)[:, None] * jnp.asarray(rope_inv_freq(rope, 64))[None, :]
    angles = jnp.concatenate([angles, angles], axis=-1)[:, None, :]
    cos, sin = jnp.cos(angles).astype(dtype), jnp.sin(angles).astype(dtype)
    # HF's rotate_half, jitted too (XLA may contract x * cos + r * sin into an fma)
    want = jax.jit(lambda x: x * cos + jnp.concatenate([-x[..., 32:], x[..., :32]], axis=-1) * sin)(x)
    got = jax.jit(apply_rope, static_argnums=2)(x, positions, rope)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    jaxpr = jax.make_jaxpr(apply_rope, static_argnums=2)(x, positions, rope).jaxpr
    assert not [e for e in jaxpr.eqns if e.primitive.name == "concatenate" and e.outvars[0].aval.shape == x.shape]

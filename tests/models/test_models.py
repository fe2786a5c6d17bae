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


def test_every_architecture_satisfies_the_model_contract():
    from jaxvllm.model_config import SUPPORTED_ARCHITECTURES
    from jaxvllm.models import MODELS
    from jaxvllm.models.common import Model

    assert set(MODELS) == set(SUPPORTED_ARCHITECTURES)
    assert all(isinstance(model, Model) for model in MODELS.values())


def test_linear_takes_weights_in_hf_layout_with_head_axes():
    """`layers.linear`, every model matmul: x [T, *in] @ weight [*out, *in] -> [T, *out]."""
    from jaxvllm.layers import linear

    rng = np.random.default_rng(0)
    x, q_proj = jnp.asarray(rng.normal(size=(5, 8)), jnp.float32), jnp.asarray(rng.normal(size=(3, 4, 8)), jnp.float32)
    heads = linear(x, q_proj)
    np.testing.assert_allclose(heads, np.einsum("td,hkd->thk", x, q_proj), rtol=1e-6)
    o_proj, bias = jnp.asarray(rng.normal(size=(8, 3, 4)), jnp.float32), jnp.arange(8, dtype=jnp.float32)
    np.testing.assert_allclose(linear(heads, o_proj, bias), np.einsum("thk,dhk->td", heads, o_proj) + bias, rtol=1e-5)
    logits = linear(x.astype(jnp.bfloat16), q_proj[0].astype(jnp.bfloat16), preferred_element_type=jnp.float32)
    assert logits.shape == (5, 4) and logits.dtype == jnp.float32  # (an lm_head [vocab, hidden])


def test_input_major_weight_multiplies_as_the_weight():
    """A CPU's layer matrices are stored inputs first (`InputMajorWeight`, [*in, *out]):
    `linear` gives what the weight in HF's order gives, under an adapter too, at one row and
    at several, in float32 and bfloat16; the weight comes back exactly."""
    from jaxvllm.layers import InputMajorWeight, linear
    from jaxvllm.lora.weights import LoRAWeight

    rng = np.random.default_rng(1)
    q_proj = jnp.asarray(rng.normal(size=(3, 4, 8)), jnp.float32)  # [heads, head_dim, hidden]
    o_proj = jnp.asarray(rng.normal(size=(8, 3, 4)), jnp.float32)  # [hidden, heads, head_dim]
    q_major, o_major = InputMajorWeight.of(q_proj, 1), InputMajorWeight.of(o_proj, 2)
    assert q_major.value.shape == (8, 3, 4) and o_major.value.shape == (3, 4, 8)
    assert q_major.shape == q_proj.shape and o_major.shape == o_proj.shape
    np.testing.assert_array_equal(q_major.weight(), q_proj)
    np.testing.assert_array_equal(o_major.weight(), o_proj)
    for rows in (1, 5):
        x = jnp.asarray(rng.normal(size=(rows, 8)), jnp.float32)
        heads = linear(x, q_proj)
        np.testing.assert_allclose(linear(x, q_major), heads, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(linear(heads, o_major, jnp.ones(8)), linear(heads, o_proj, jnp.ones(8)),
                                   rtol=1e-5, atol=1e-5)
        x16 = x.astype(jnp.bfloat16)
        np.testing.assert_allclose(linear(x16, InputMajorWeight.of(q_proj.astype(jnp.bfloat16), 1)).astype(np.float32),
                                   linear(x16, q_proj.astype(jnp.bfloat16)).astype(np.float32), rtol=2e-2, atol=2e-2)
    # An adapter over it: slot 0 on every token, a [1, R, in] and b [1, out, R] (one part).
    x = jnp.asarray(rng.normal(size=(5, 8)), jnp.float32)
    a, b = jnp.asarray(rng.normal(size=(1, 2, 8)), jnp.float32), jnp.asarray(rng.normal(size=(1, 3, 4, 2)), jnp.float32)
    slots = jnp.zeros(5, jnp.int32)
    np.testing.assert_allclose(linear(x, LoRAWeight(q_major, a, (b,), slots)), linear(x, LoRAWeight(q_proj, a, (b,), slots)),
                               rtol=1e-5, atol=1e-5)


def test_reference_query_blocks_only_where_no_decode_step_lands():
    """Query blocks (a sequence's pages gathered once for up to 8 of its tokens) need the CPU
    loops that skip unused blocks, and a step that is not decodes alone: one that verifies
    drafts (1 + K tokens a row), or a bucket at least twice its sequence rows, for every step
    of decodes alone fits the bucket below."""
    from types import SimpleNamespace

    from jaxvllm.layers import CPU_QUERY_BLOCK, reference_query_block

    def inputs(rows: int, dynamic_loops: bool = True, verifies_drafts: bool = False):
        return SimpleNamespace(dynamic_loops=dynamic_loops, block_tables=np.zeros((rows, 4), np.int32),
                               verifies_drafts=verifies_drafts)

    assert reference_query_block(2048, inputs(256)) == CPU_QUERY_BLOCK > 1
    assert reference_query_block(512, inputs(256)) == CPU_QUERY_BLOCK
    assert reference_query_block(256, inputs(256)) == 1  # 256 decodes take this bucket
    assert reference_query_block(32, inputs(32)) == 1  # (rows = min(max_num_seqs, bucket))
    assert reference_query_block(2048, inputs(256, dynamic_loops=False)) == 1  # a GPU's static loops
    assert reference_query_block(16, inputs(16, verifies_drafts=True)) == CPU_QUERY_BLOCK  # a 16-token verify
    assert reference_query_block(16, inputs(16, dynamic_loops=False, verifies_drafts=True)) == 1

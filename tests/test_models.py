"""Parity of the JAX models with HF transformers (float32, CPU) through the paged KV cache.

Errors are max |logit difference| / max |HF logit| (`rel_err`); the bound is 1e-4.
"""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxvllm import load_model
from jaxvllm.kv_cache import allocate_kv_caches
from tests.conftest import ARCHS
from tests.paged import (Chunk, build_inputs, greedy_decode, hf_logits, jit_forward, mixed_errors, mixed_steps,
                         random_tokens, rel_err)

TOL = 1e-4
BLOCK = 4
NUM_BLOCKS = 32


@pytest.fixture(scope="module", params=ARCHS)
def arch_setup(request, tiny_checkpoint, hf_model):
    path = tiny_checkpoint(request.param)
    cfg, params = load_model(path)
    return request.param, cfg, params, hf_model(path)


def fresh_caches(cfg):
    return allocate_kv_caches(cfg, NUM_BLOCKS, BLOCK, jnp.float32)


def test_full_prompt_logits(arch_setup):
    arch, cfg, params, hf = arch_setup
    tokens = random_tokens(np.random.default_rng(0), 27)
    blocks = list(range(8))
    inputs = build_inputs([Chunk(tokens, 0, blocks)], BLOCK, all_logits=True)
    logits, _ = jit_forward(params, fresh_caches(cfg), inputs, cfg, "reference")
    err = rel_err(logits, hf_logits(hf, tokens))
    print(f"{arch} full-prompt rel err {err:.2e}")
    assert err <= TOL


def test_prefill_then_decode_shuffled_blocks(arch_setup):
    """Prompt, then one token at a time, with physical blocks in random order."""
    arch, cfg, params, hf = arch_setup
    rng = np.random.default_rng(1)
    prompt, steps = random_tokens(rng, 13), 14
    blocks = [int(b) for b in rng.permutation(NUM_BLOCKS)[:8]]
    assert blocks != sorted(blocks)

    tokens, got = greedy_decode(params, cfg, fresh_caches(cfg), prompt, steps, blocks, BLOCK)
    want = hf_logits(hf, tokens)[len(prompt) - 1 :]
    errs = [rel_err(g, w) for g, w in zip(got, want)]
    print(f"{arch} decode max rel err {max(errs):.2e} over {len(errs)} steps")
    assert max(errs) <= TOL


def test_batched_sequences_match_each_alone(arch_setup):
    """Two sequences of different lengths in one padded flat batch = each one alone."""
    arch, cfg, params, hf = arch_setup
    rng = np.random.default_rng(2)
    a, b = random_tokens(rng, 7), random_tokens(rng, 18)
    chunk_a, chunk_b = Chunk(a, 0, [9, 3]), Chunk(b, 0, [0, 17, 5, 30, 12])

    batched = build_inputs([chunk_a, chunk_b], BLOCK, pad_tokens_to=32, pad_seqs_to=4)
    logits, _ = jit_forward(params, fresh_caches(cfg), batched, cfg, "reference")
    alone_a, _ = jit_forward(params, fresh_caches(cfg), build_inputs([chunk_a], BLOCK), cfg, "reference")
    alone_b, _ = jit_forward(params, fresh_caches(cfg), build_inputs([chunk_b], BLOCK), cfg, "reference")
    np.testing.assert_allclose(logits[0], alone_a[0], rtol=0, atol=1e-5)
    np.testing.assert_allclose(logits[1], alone_b[0], rtol=0, atol=1e-5)
    assert rel_err(logits[0], hf_logits(hf, a)[-1]) <= TOL
    assert rel_err(logits[1], hf_logits(hf, b)[-1]) <= TOL


def test_chunked_prefill_and_mixed_batch(arch_setup):
    """A prompt in two chunks, the second sharing a step with another sequence's decode."""
    arch, cfg, params, hf = arch_setup
    a, b, next_a, logits1, logits2, _ = mixed_steps(params, cfg, fresh_caches(cfg), np.random.default_rng(3), BLOCK)
    assert max(mixed_errors(hf, a, b, next_a, logits1, logits2)) <= TOL


@pytest.mark.parametrize("window", [5, 8])
def test_mistral_sliding_window(tiny_checkpoint, hf_model, window):
    path = tiny_checkpoint("mistral", sliding_window=window)
    cfg, params = load_model(path)
    assert cfg.sliding_windows == (window,) * cfg.num_layers
    tokens = random_tokens(np.random.default_rng(4), 22)
    blocks = [int(b) for b in np.random.default_rng(5).permutation(NUM_BLOCKS)[:8]]
    want = hf_logits(hf_model(path), tokens)
    caches = fresh_caches(cfg)
    logits, caches = jit_forward(params, caches, build_inputs([Chunk(tokens[:-3], 0, blocks)], BLOCK, all_logits=True), cfg, "reference")
    assert rel_err(logits, want[:-3]) <= TOL
    for i in range(len(tokens) - 3, len(tokens)):  # decode past the window
        logits, caches = jit_forward(params, caches, build_inputs([Chunk([tokens[i]], i, blocks)], BLOCK), cfg, "reference")
        assert rel_err(logits[0], want[i]) <= TOL


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_bfloat16_close_to_float32_reference(arch, tiny_checkpoint, hf_model):
    path = tiny_checkpoint(arch)
    cfg, params = load_model(path, dtype="bfloat16")
    tokens = random_tokens(np.random.default_rng(6), 16)
    caches = allocate_kv_caches(cfg, NUM_BLOCKS, BLOCK, jnp.bfloat16)
    logits, _ = jit_forward(params, caches, build_inputs([Chunk(tokens, 0, list(range(4)))], BLOCK, all_logits=True), cfg, "reference")
    want = hf_logits(hf_model(path), tokens)
    assert logits.dtype == jnp.float32
    # bf16 keeps 8 bits of mantissa: a few percent of the logit scale, and mostly the same argmax.
    assert rel_err(logits, want) < 0.05
    assert np.mean(np.argmax(logits, -1) == np.argmax(want, -1)) >= 0.8


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_rope_rotates_half_without_a_concatenate(dtype):
    """apply_rope is HF's x * cos + rotate_half(x) * sin bit for bit, with rotate_half as a
    flip of the two halves (no concatenate of x, which would make XLA start a fusion of its
    own: one more kernel per layer in a mixed step, `python -m jaxvllm.benchmarks.aot_engine`)."""
    import jax

    from jaxvllm.model_config import RopeConfig
    from jaxvllm.layers import apply_rope, rope_inv_freq

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

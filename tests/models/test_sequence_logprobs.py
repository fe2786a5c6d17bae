"""`jaxvllm.models.sequence_logprobs` (the trainer's forward) on its dense causal attention
against the paged form it replaced (each sequence one prefill over a fresh paged cache on
the reference attention, kept here as `paged_logprobs`): the same logprobs within 1e-5
(float32) for the tiny architectures, windows, soft-capping and experts included, with
rows of uneven lengths; finite, non-zero gradients equal to the paged form's; a longer
sequence. Its agreement with the engine's own logprobs: tests/engine/test_update_weights.py."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxvllm import load_model
from jaxvllm.batch import ModelInputs
from jaxvllm.models import MODELS, sequence_logprobs

LENGTHS = np.array([40, 23, 9])  # uneven rows, all past gemma3's (and the mistral case's) window of 8


def paged_logprobs(params, cfg, token_ids, lengths, temperature=1.0, block_size=16):
    """The paged form: each row one prefill over pages of its own in a fresh cache, on the
    reference attention (what `sequence_logprobs` ran before its dense attention)."""
    b, t = token_ids.shape
    cfg = dataclasses.replace(cfg, kv_cache_bits=None)
    blocks = -(-t // block_size)
    dtype = jax.tree.leaves(params["layers"])[0].dtype
    cache = jnp.zeros((cfg.num_kv_heads, cfg.num_layers, b * blocks, block_size, cfg.head_dim), dtype)
    pos = jnp.arange(t, dtype=jnp.int32)
    real = pos[None, :] < lengths[:, None]
    rows = jnp.arange(b, dtype=jnp.int32)
    inputs = ModelInputs(
        input_ids=token_ids.reshape(-1), positions=jnp.tile(pos, b),
        slot_mapping=jnp.where(real, rows[:, None] * blocks * block_size + pos[None, :], -1).reshape(-1),
        query_start_loc=jnp.arange(b + 1, dtype=jnp.int32) * t, seq_lens=jnp.full((b,), t, jnp.int32),
        block_tables=rows[:, None] * blocks + jnp.arange(blocks, dtype=jnp.int32)[None, :],
        logits_indices=jnp.arange(b * t, dtype=jnp.int32))
    model = MODELS[cfg.architecture]
    hidden, _, _ = model.hidden_states(params, (cache, cache), inputs, cfg, "reference")
    logits = model.compute_logits(params, hidden, cfg).reshape(b, t, -1)[:, :-1] / temperature
    chosen = jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), token_ids[:, 1:, None], axis=-1)[..., 0]
    return jnp.where(real[:, 1:], chosen, 0.0)


dense = jax.jit(sequence_logprobs, static_argnames=("cfg", "temperature"))
paged = jax.jit(paged_logprobs, static_argnames=("cfg", "temperature"))


def tokens(cfg, lengths, seed=0) -> np.ndarray:
    """Random ids [B, max(lengths)], 0 past each row's length."""
    ids = np.random.default_rng(seed).integers(1, cfg.vocab_size, (len(lengths), max(lengths)), dtype=np.int32)
    return np.where(np.arange(ids.shape[1])[None, :] < np.asarray(lengths)[:, None], ids, 0).astype(np.int32)


CASES = [("llama", {}), ("mistral", dict(sliding_window=8)), ("qwen2", {}), ("qwen3", {}),
         ("gemma3", dict(attn_logit_softcapping=0.5)), ("qwen3_moe", {})]


@pytest.mark.parametrize("arch,overrides", CASES, ids=[arch for arch, _ in CASES])
def test_dense_equals_paged(arch, overrides, tiny_checkpoint):
    """The tiny architectures' attention variants (GQA groups 1, 2 and 4, q/k norms, gemma3's
    sliding layers and soft-cap, mistral with a window; a MoE, qwen3_moe: mixtral's attention
    is llama's), rows of uneven lengths, at a temperature: the paged form's logprobs within
    1e-5, zeros past each row's end."""
    cfg, params = load_model(tiny_checkpoint(arch, **overrides))
    if arch in ("gemma3", "mistral"):
        assert 8 in cfg.sliding_windows and cfg.attn_logit_softcapping == overrides.get("attn_logit_softcapping")
    ids, lengths = tokens(cfg, LENGTHS), jnp.asarray(LENGTHS)
    got = np.asarray(dense(params, cfg, ids, lengths, temperature=0.8))
    want = np.asarray(paged(params, cfg, ids, lengths, temperature=0.8))
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    assert (got[np.arange(got.shape[1])[None, :] >= LENGTHS[:, None] - 1] == 0).all()
    assert (got[np.arange(got.shape[1])[None, :] < LENGTHS[:, None] - 1] < 0).all()


def test_stacked_layers_dense_equals_paged(tiny_checkpoint):
    """The GPU's stacked layout of the layer weights (each layer a row of one array) alike."""
    cfg, params = load_model(tiny_checkpoint("gemma3", attn_logit_softcapping=0.5), stack_layers=True)
    assert cfg.stack_layers
    ids, lengths = tokens(cfg, LENGTHS, seed=1), jnp.asarray(LENGTHS)
    np.testing.assert_allclose(np.asarray(dense(params, cfg, ids, lengths, temperature=1.0)),
                               np.asarray(paged(params, cfg, ids, lengths, temperature=1.0)), atol=1e-5, rtol=0)


def test_gradients_flow_and_equal_paged(tiny_checkpoint):
    """jax.grad of the summed logprobs (gemma3: windows, soft-cap, uneven rows): finite,
    non-zero, and the paged form's (within 1e-4 of its largest)."""
    cfg, params = load_model(tiny_checkpoint("gemma3", attn_logit_softcapping=0.5))
    ids, lengths = tokens(cfg, LENGTHS, seed=2), jnp.asarray(LENGTHS)

    def grads(fn):
        g = jax.jit(jax.grad(lambda p: fn(p, cfg, ids, lengths).sum(), allow_int=True))(params)
        return [np.asarray(x) for x in jax.tree.leaves(g) if x.dtype != jax.dtypes.float0]

    got, want = grads(sequence_logprobs), grads(paged_logprobs)
    assert all(np.isfinite(g).all() for g in got) and all(np.abs(g).max() > 0 for g in got)
    scale = max(np.abs(w).max() for w in want)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, atol=1e-4 * scale, rtol=0)


def test_longer_sequences(tiny_checkpoint):
    """T = 256, two rows (one cut short): runs, and is the paged form's."""
    cfg, params = load_model(tiny_checkpoint("qwen3"))
    lengths = np.array([256, 200])
    ids = tokens(cfg, lengths, seed=3)
    got = np.asarray(dense(params, cfg, ids, jnp.asarray(lengths)))
    assert got.shape == (2, 255) and np.isfinite(got).all()
    np.testing.assert_allclose(got, np.asarray(paged(params, cfg, ids, jnp.asarray(lengths))), atol=1e-5, rtol=0)

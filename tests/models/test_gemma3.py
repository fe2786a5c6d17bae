"""Gemma 3 (text): the tiny "gemma3" checkpoint has 4 layers alternating sliding (window 8,
RoPE base 10k) and global (base 1M, linear scaling), random norm weights and
query_pre_attn_scalar != head_dim.

Its parity with HF transformers (the model through the paged cache, soft-capping, bfloat16, the
engine) is in tests/models/test_hf_parity.py with every other architecture's; here: the config read
from HF's, the Pallas kernels against the reference backend past the window, and what the
Pallas backend refuses. Errors are max |logit difference| / max |reference logit| (`rel_err`);
the bound is 1e-4.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxvllm import load_model
from jaxvllm.kv_cache import allocate_kv_caches
from tests.models.paged import MIXED_BLOCKS, Chunk, build_inputs, jit_forward, mixed_steps, random_tokens, rel_err

TOL = 1e-4
BLOCK = 4
NUM_BLOCKS = 48
WINDOW = 8  # the tiny checkpoint's sliding_window


def fresh_caches(cfg):
    return allocate_kv_caches(cfg, NUM_BLOCKS, BLOCK, jnp.float32)


@pytest.fixture(scope="module")
def gemma(tiny_checkpoint, hf_model):
    path = tiny_checkpoint("gemma3")
    cfg, params = load_model(path)
    return path, cfg, params, hf_model(path)


def test_config_from_hf(gemma):
    _, cfg, _, hf = gemma
    assert cfg.architecture == "Gemma3ForCausalLM"
    assert cfg.sliding_windows == (WINDOW, None, WINDOW, None)
    assert (cfg.sliding_rope.theta, cfg.sliding_rope.rope_type) == (10000.0, "default")
    assert (cfg.rope.theta, cfg.rope.rope_type, cfg.rope.factor) == (1000000.0, "linear", 8.0)
    assert [cfg.rope_of_layer(i).theta for i in range(4)] == [10000.0, 1000000.0, 10000.0, 1000000.0]
    assert cfg.sm_scale == pytest.approx(24**-0.5) and cfg.head_dim == 16
    assert cfg.hidden_act == "gelu_pytorch_tanh" and cfg.qk_norm and cfg.tie_word_embeddings
    assert cfg.attn_logit_softcapping is None and cfg.final_logit_softcapping is None
    assert hf.config.layer_types == ["sliding_attention", "full_attention"] * 2


def test_pallas_kernels_equal_reference(gemma):
    """The same two mixed steps (prefill chunks and a decode, past the window) through the
    Pallas kernels in interpret mode: the ragged kernel and the split-K decode kernel."""
    _, cfg, params, _ = gemma
    out = {}
    blocks_a, blocks_b = MIXED_BLOCKS
    for backend in ("reference", "pallas"):
        _, _, _, logits1, logits2, caches = mixed_steps(params, cfg, fresh_caches(cfg), np.random.default_rng(3),
                                                         BLOCK, backend)
        next_ids = [int(t) for t in np.argmax(logits2, -1)]
        step3 = build_inputs([Chunk(next_ids[:1], 11, blocks_a), Chunk(next_ids[1:2], 21, blocks_b)], BLOCK)
        logits3, _ = jit_forward(params, caches, step3, cfg, backend)
        out[backend] = np.concatenate([logits1, logits2, logits3])
    err = rel_err(out["pallas"], out["reference"])
    print(f"gemma3 pallas vs reference rel err {err:.2e}")
    assert err <= TOL


def test_attention_logit_softcapping_not_on_pallas(tiny_checkpoint):
    """The attention soft-cap runs on the reference backend (its HF parity: tests/models/test_hf_parity.py);
    the Pallas backend refuses it."""
    cfg, params = load_model(tiny_checkpoint("gemma3", attn_logit_softcapping=0.5))
    assert cfg.attn_logit_softcapping == 0.5
    tokens = random_tokens(np.random.default_rng(8), 20)
    inputs = build_inputs([Chunk(tokens, 0, list(range(5)))], BLOCK, all_logits=True)
    with pytest.raises(ValueError, match="soft-capping.*not supported by the 'pallas' attention backend"):
        jit_forward(params, fresh_caches(cfg), inputs, cfg, "pallas")

"""Gemma 3 (text) against HF transformers (float32, CPU): the tiny "gemma3" checkpoint has 4
layers alternating sliding (window 8, RoPE base 10k) and global (base 1M, linear scaling),
random norm weights and query_pre_attn_scalar != head_dim; prompts run past the window.

Not in conftest's ARCHS (every architecture there runs through the whole suite): this file
covers the model through the paged cache (full prompt, decode, chunked prefill, the Pallas
kernels) and the engine (greedy parity, preemption, prefix caching). Errors are
max |logit difference| / max |HF logit| (`rel_err`); the bound is 1e-4.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxvllm import LLM, SamplingParams, load_model
from jaxvllm.kv_cache import allocate_kv_caches
from tests.paged import (MIXED_BLOCKS, Chunk, build_inputs, greedy_decode, hf_logits, jit_forward, mixed_errors,
                         mixed_steps, random_tokens, rel_err)

TOL = 1e-4
BLOCK = 4
NUM_BLOCKS = 48
WINDOW = 8  # the tiny checkpoint's sliding_window
ENGINE = dict(max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64, token_buckets=[64])
MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)


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


def test_full_prompt_logits(gemma):
    """27 tokens, over three windows: HF's sliding-window mask is ours."""
    _, cfg, params, hf = gemma
    tokens = random_tokens(np.random.default_rng(0), 27)
    inputs = build_inputs([Chunk(tokens, 0, list(range(8)))], BLOCK, all_logits=True)
    logits, _ = jit_forward(params, fresh_caches(cfg), inputs, cfg, "reference")
    err = rel_err(logits, hf_logits(hf, tokens))
    print(f"gemma3 full-prompt rel err {err:.2e}")
    assert err <= TOL


def test_prefill_then_decode_shuffled_blocks(gemma):
    """Prompt, then one token at a time past the window, with physical blocks in random order."""
    _, cfg, params, hf = gemma
    rng = np.random.default_rng(1)
    prompt, steps = random_tokens(rng, 13), 14
    blocks = [int(b) for b in rng.permutation(NUM_BLOCKS)[:8]]
    tokens, got = greedy_decode(params, cfg, fresh_caches(cfg), prompt, steps, blocks, BLOCK)
    want = hf_logits(hf, tokens)[len(prompt) - 1 :]
    errs = [rel_err(g, w) for g, w in zip(got, want)]
    print(f"gemma3 decode max rel err {max(errs):.2e} over {len(errs)} steps")
    assert max(errs) <= TOL


def test_chunked_prefill_and_mixed_batch(gemma):
    _, cfg, params, hf = gemma
    a, b, next_a, logits1, logits2, _ = mixed_steps(params, cfg, fresh_caches(cfg), np.random.default_rng(3), BLOCK)
    errs = mixed_errors(hf, a, b, next_a, logits1, logits2)
    print(f"gemma3 chunked prefill max rel err {max(errs):.2e}")
    assert max(errs) <= TOL


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


def test_bfloat16_close_to_float32_reference(tiny_checkpoint, hf_model):
    path = tiny_checkpoint("gemma3")
    cfg, params = load_model(path, dtype="bfloat16")
    tokens = random_tokens(np.random.default_rng(6), 16)
    caches = allocate_kv_caches(cfg, NUM_BLOCKS, BLOCK, jnp.bfloat16)
    inputs = build_inputs([Chunk(tokens, 0, list(range(4)))], BLOCK, all_logits=True)
    logits, _ = jit_forward(params, caches, inputs, cfg, "reference")
    want = hf_logits(hf_model(path), tokens)
    assert logits.dtype == jnp.float32
    assert rel_err(logits, want) < 0.05
    assert np.mean(np.argmax(logits, -1) == np.argmax(want, -1)) >= 0.8


def test_final_logit_softcapping(tiny_checkpoint, hf_model):
    path = tiny_checkpoint("gemma3", final_logit_softcapping=3.0)
    cfg, params = load_model(path)
    assert cfg.final_logit_softcapping == 3.0
    tokens = random_tokens(np.random.default_rng(7), 20)
    inputs = build_inputs([Chunk(tokens, 0, list(range(5)))], BLOCK, all_logits=True)
    logits, _ = jit_forward(params, fresh_caches(cfg), inputs, cfg, "reference")
    assert np.abs(np.asarray(logits)).max() < 3.0
    assert rel_err(logits, hf_logits(hf_model(path), tokens)) <= TOL


@pytest.fixture(scope="module")
def softcap_attention():
    """An HF attention implementation that soft-caps the scores with `attn_logit_softcapping`:
    transformers' Gemma3Attention keeps the value but never passes it to its attention
    function (eager or sdpa), so HF's Gemma 3 ignores it; this is the reference for the cap."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask
    from transformers.models.gemma3 import modeling_gemma3

    def eager_softcap(module, query, key, value, attention_mask, **kwargs):
        kwargs.pop("sliding_window", None)  # already in the mask
        return modeling_gemma3.eager_attention_forward(
            module, query, key, value, attention_mask, softcap=module.attn_logit_softcapping, **kwargs
        )

    AttentionInterface.register("jaxvllm_eager_softcap", eager_softcap)
    AttentionMaskInterface.register("jaxvllm_eager_softcap", eager_mask)
    return "jaxvllm_eager_softcap"


def test_attention_logit_softcapping(tiny_checkpoint, softcap_attention):
    from transformers import AutoModelForCausalLM

    path = tiny_checkpoint("gemma3", attn_logit_softcapping=0.5)
    cfg, params = load_model(path)
    assert cfg.attn_logit_softcapping == 0.5
    tokens = random_tokens(np.random.default_rng(8), 20)
    inputs = build_inputs([Chunk(tokens, 0, list(range(5)))], BLOCK, all_logits=True)
    logits, _ = jit_forward(params, fresh_caches(cfg), inputs, cfg, "reference")
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, attn_implementation=softcap_attention)
    plain = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    capped, uncapped = hf_logits(hf.eval(), tokens), hf_logits(plain.eval(), tokens)
    assert rel_err(capped, uncapped) > 0.01  # a cap of 0.5 matters
    err = rel_err(logits, capped)
    print(f"gemma3 attention soft-capping rel err {err:.2e}")
    assert err <= TOL
    with pytest.raises(ValueError, match="soft-capping.*not supported by the 'pallas' attention backend"):
        jit_forward(params, fresh_caches(cfg), inputs, cfg, "pallas")


# -- The engine ------------------------------------------------------------------------------


def engine_prompts():
    """Mixed lengths (1 to 100 tokens; above the 64-token budget: chunked prefill), four of
    them sharing a 40-token prefix (prefix-cache hits within the first run)."""
    rng = np.random.default_rng(0)
    prompts = [random_tokens(rng, n) for n in (1, 2, 5, 9, 16, 17, 30, 70, 100)]
    prefix = random_tokens(rng, 40)
    return prompts + [prefix + random_tokens(rng, n) for n in (3, 11, 24, 50)]


@pytest.fixture(scope="module")
def engine_case(gemma):
    """(path, prompts, HF greedy completions of each prompt alone)."""
    path, _, _, hf = gemma
    prompts, want = engine_prompts(), []
    with torch.no_grad():
        for p in prompts:
            out = hf.generate(torch.tensor([p]), max_new_tokens=MAX_TOKENS, do_sample=False,
                              attention_mask=torch.ones(1, len(p), dtype=torch.long))
            want.append(out[0, len(p):].tolist())
    return path, prompts, want


def completions(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def test_engine_greedy_matches_hf_and_prefix_cache(engine_case):
    path, prompts, want = engine_case
    llm = LLM(str(path), **ENGINE)
    requests = [{"prompt_token_ids": p} for p in prompts]
    outputs = llm.generate(requests, GREEDY, use_tqdm=False)
    assert completions(outputs) == want
    # Again, reversed: every prompt's full blocks are prefix-cache hits now.
    again = llm.generate(requests[::-1], GREEDY, use_tqdm=False)
    assert completions(again) == want[::-1]
    assert sum(o.num_cached_tokens for o in again) >= 100
    stats = llm.stats()
    assert stats["num_free_blocks"] == stats["num_gpu_blocks"]


def test_engine_preemption_and_no_prefix_caching(engine_case):
    path, prompts, want = engine_case
    # 10 blocks x 16 = 160 tokens of KV for 8 running sequences of up to 108 tokens.
    llm = LLM(str(path), **ENGINE, num_gpu_blocks_override=10, enable_prefix_caching=False)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert llm.stats()["num_preemptions"] > 0
    assert completions(outputs) == want


def test_engine_pallas_equals_reference(engine_case):
    """A short run on the Pallas kernels (interpret mode on CPU): HF's tokens, and the
    reference backend's logprobs."""
    path, prompts, want = engine_case
    pick = [0, 3, 7, 10]  # 1, 9, 70 tokens (chunked), and one past the shared prefix
    params = SamplingParams(temperature=0, max_tokens=4, logprobs=0)
    requests = [{"prompt_token_ids": prompts[i]} for i in pick]
    got = {}
    for backend in ("reference", "pallas"):
        llm = LLM(str(path), **ENGINE, attention_backend=backend)
        assert llm.llm_engine.runner.backend == backend
        got[backend] = llm.generate(requests, params, use_tqdm=False)
    assert completions(got["pallas"]) == [want[i][:4] for i in pick] == completions(got["reference"])
    np.testing.assert_allclose([o.outputs[0].cumulative_logprob for o in got["pallas"]],
                               [o.outputs[0].cumulative_logprob for o in got["reference"]], rtol=1e-4, atol=1e-4)

"""YaRN RoPE (`rope_type: "yarn"`, long-context Qwen checkpoints) against transformers:
the inverse frequencies and attention factor of `_compute_yarn_parameters`, and the
logits of tiny Qwen3 / Llama checkpoints with YaRN over prompts longer than
original_max_position_embeddings (rel err bound 1e-4, as tests/models/test_hf_parity.py)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxvllm import load_model
from jaxvllm.layers import rope_attention_scaling, rope_inv_freq
from jaxvllm.model_config import ModelConfig
from jaxvllm.kv_cache import allocate_kv_caches
from tests.models.paged import Chunk, build_inputs, hf_logits, jit_forward, rel_err
from weights.make_tiny import make_tiny

TOL = 1e-4
BLOCK = 4
YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=32)


@pytest.mark.parametrize("params, max_pos, head_dim", [
    (YARN, 128, 32),
    (dict(rope_type="yarn", rope_theta=1e6, factor=4.0, original_max_position_embeddings=32768), 131072, 128),
    (dict(rope_type="yarn", rope_theta=1e4, factor=8.0, original_max_position_embeddings=4096, beta_fast=16,
          beta_slow=2, truncate=False, mscale=1.0, mscale_all_dim=0.7), 32768, 64),
    (dict(rope_type="yarn", rope_theta=1e4, factor=2.0, original_max_position_embeddings=4096,
          attention_factor=1.3), 8192, 64),
    # factor None: max_position_embeddings / original_max_position_embeddings
    (dict(rope_type="yarn", rope_theta=1e4, factor=None, original_max_position_embeddings=4096), 16384, 64),
], ids=["tiny", "qwen3-128k", "beta-truncate-mscale", "attention-factor", "no-factor"])
def test_yarn_parameters_match_transformers(params, max_pos, head_dim):
    from transformers import Qwen3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = Qwen3Config(rope_parameters=dict(params), max_position_embeddings=max_pos, head_dim=head_dim,
                     architectures=["Qwen3ForCausalLM"])
    want, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
    rope = ModelConfig.from_hf(hf).rope
    assert rope.rope_type == "yarn"
    np.testing.assert_allclose(rope_inv_freq(rope, head_dim), want.numpy(), rtol=1e-6)
    assert rope_attention_scaling(rope) == pytest.approx(attention_factor, rel=1e-12)


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_yarn_logits_match_transformers(arch, tmp_path_factory, hf_model):
    """90 tokens, past original_max_position_embeddings (32): the prompt's logits, then decode steps."""
    path = make_tiny(arch, tmp_path_factory.mktemp("yarn") / arch, max_position_embeddings=128, rope_parameters=YARN)
    cfg, params = load_model(path)
    assert cfg.rope.rope_type == "yarn" and rope_attention_scaling(cfg.rope) == pytest.approx(0.1 * np.log(4.0) + 1)
    rng = np.random.default_rng(0)
    tokens = [int(t) for t in rng.integers(3, 384, size=90)]
    blocks = [int(b) for b in rng.permutation(32)[:24]]
    caches = allocate_kv_caches(cfg, 32, BLOCK, jnp.float32)
    want = hf_logits(hf_model(path), tokens)
    prefill = build_inputs([Chunk(tokens[:-4], 0, blocks)], BLOCK, all_logits=True, max_blocks=24)
    logits, caches = jit_forward(params, caches, prefill, cfg, "reference")
    errs = [rel_err(logits, want[:-4])]
    for i in range(len(tokens) - 4, len(tokens)):
        step = build_inputs([Chunk([tokens[i]], i, blocks)], BLOCK, max_blocks=24)
        logits, caches = jit_forward(params, caches, step, cfg, "reference")
        errs.append(rel_err(logits[0], want[i]))
    print(f"{arch} yarn max rel err {max(errs):.2e}")
    assert max(errs) <= TOL


def test_rope_scaling_extends_the_longest_sequence(tmp_path_factory):
    """As vLLM derives max_model_len: YaRN reaches factor x original_max_position_embeddings,
    linear scaling factor x max_position_embeddings; Llama 3's scaling changes nothing. So a
    checkpoint given YaRN through hf_overrides (vLLM's context-extension recipe) runs longer."""
    from transformers import LlamaConfig, Qwen3Config

    from jaxvllm import LLM

    def limit(config_class, rope, max_pos):
        return ModelConfig.from_hf(config_class(rope_parameters=rope, max_position_embeddings=max_pos,
                                                architectures=[config_class.__name__[:-6] + "ForCausalLM"]))\
            .max_model_len_limit

    assert limit(Qwen3Config, dict(YARN), 32) == 128
    assert limit(Qwen3Config, dict(rope_type="yarn", rope_theta=1e6, factor=4.0,
                                   original_max_position_embeddings=32768), 40960) == 131072
    assert limit(LlamaConfig, dict(rope_type="linear", rope_theta=1e4, factor=2.0), 2048) == 4096
    assert limit(LlamaConfig, dict(rope_type="llama3", rope_theta=5e5, factor=8.0, low_freq_factor=1.0,
                                   high_freq_factor=4.0, original_max_position_embeddings=8192), 131072) == 131072
    path = make_tiny("qwen3", tmp_path_factory.mktemp("yarn") / "plain", max_position_embeddings=32)
    with pytest.raises(ValueError, match="max_model_len 128 exceeds the model's max_position_embeddings"):
        LLM(path, max_model_len=128, enforce_eager=True)
    with LLM(path, max_model_len=128, enforce_eager=True, hf_overrides={"rope_parameters": dict(YARN)}) as llm:
        assert llm.llm_engine.runner.max_model_len == llm.llm_engine.model_config.max_model_len == 128


def test_rope_overrides_keep_what_they_do_not_give(tmp_path_factory):
    """vLLM's hf_overrides for RoPE on transformers 5's one rope_parameters dict: rope_theta
    sets the theta (it was ignored), rope_scaling replaces the scaling and keeps the theta
    (it was lost: a crash), in vLLM 0.11's "type" spelling too; Gemma 3's global layers take
    them. A checkpoint saved with those values runs the same."""
    from transformers import AutoConfig

    from jaxvllm import LLM, SamplingParams
    from jaxvllm.loader import load_config

    folder = tmp_path_factory.mktemp("rope")
    path = make_tiny("llama", folder / "plain", max_position_embeddings=128)
    theta = load_config(path).rope.theta
    assert load_config(path, {"rope_theta": 10.0}).rope.theta == 10.0
    scaled = load_config(path, {"rope_scaling": {k: v for k, v in YARN.items() if k != "rope_theta"}}).rope
    assert scaled == load_config(make_tiny("llama", folder / "yarn", max_position_embeddings=128,
                                           rope_parameters={**YARN, "rope_theta": theta})).rope
    linear = load_config(path, {"rope_scaling": {"type": "linear", "factor": 2.0}}).rope
    assert (linear.rope_type, linear.factor, linear.theta) == ("linear", 2.0, theta)
    gemma = make_tiny("gemma3", folder / "gemma3")
    plain, given = load_config(gemma), load_config(gemma, {"rope_theta": 10.0})
    assert given.rope.theta == 10.0 and given.sliding_rope == plain.sliding_rope
    engine = dict(max_model_len=64, enforce_eager=True)
    rope = dict(AutoConfig.from_pretrained(path).rope_parameters)  # (the tiny Llama's: Llama 3 scaling)
    saved = make_tiny("llama", folder / "theta", max_position_embeddings=128, rope_parameters={**rope, "rope_theta": 10.0})
    prompt, greedy = {"prompt_token_ids": list(range(5, 45))}, SamplingParams(temperature=0, max_tokens=8)
    with LLM(path, hf_overrides={"rope_theta": 10.0}, **engine) as llm:
        overridden = llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids
    with LLM(saved, **engine) as llm:
        assert llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids == overridden
    with LLM(path, **engine) as llm:
        assert llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids != overridden

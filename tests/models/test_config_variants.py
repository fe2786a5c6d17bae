"""Config fields that change what HF transformers computes, read as HF reads them: the
prompt's logits of tiny checkpoints whose config.json sets them equal transformers'
(rel err bound 1e-4, as tests/models/test_hf_parity.py)."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest

from jaxvllm import load_model
from jaxvllm.kv_cache import allocate_kv_caches
from jaxvllm.model_config import ModelConfig
from tests.models.paged import Chunk, build_inputs, hf_logits, jit_forward, rel_err
from weights.make_tiny import make_tiny

TOL = 1e-4
BLOCK = 4
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64}
LLAMA3 = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}

CASES = {
    # A Mistral config with `layer_types` is Ministral's to transformers: only the layers marked
    # so slide (every layer slid).
    "ministral-layer-types": ("mistral", dict(sliding_window=8), {"layer_types": ["sliding_attention", "full_attention"]},
                              lambda cfg: cfg.sliding_windows == (8, None)),
    # A top-level original_max_position_embeddings wins over rope_parameters' own (HF's
    # standardize_rope_params, as Phi-3 saves it; the inner one was read).
    "yarn-top-level-original": ("llama", dict(max_position_embeddings=128),
                                {"rope_parameters": YARN, "original_max_position_embeddings": 32},
                                lambda cfg: cfg.rope.original_max_position_embeddings == 32),
    "llama3-top-level-original": ("llama", dict(max_position_embeddings=128),
                                  {"rope_parameters": LLAMA3, "original_max_position_embeddings": 32},
                                  lambda cfg: cfg.rope.original_max_position_embeddings == 32),
    # Gemma 3's MLP reads hidden_activation, whatever hidden_act says (exact gelu was run).
    "gemma3-hidden-activation": ("gemma3", {}, {"hidden_act": "gelu", "hidden_activation": "gelu_pytorch_tanh"},
                                 lambda cfg: cfg.hidden_act == "gelu_pytorch_tanh"),
}


@pytest.mark.parametrize("name", CASES)
def test_prompt_logits_match_transformers(name, tmp_path_factory, hf_model):
    arch, overrides, edits, check = CASES[name]
    path = make_tiny(arch, tmp_path_factory.mktemp("variant") / name, **overrides)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, **edits}))
    cfg, params = load_model(path)
    assert check(cfg)
    tokens = [int(t) for t in np.random.default_rng(0).integers(3, 384, size=40)]
    caches = allocate_kv_caches(cfg, 16, BLOCK, jnp.float32)
    inputs = build_inputs([Chunk(tokens, 0, list(range(10)))], BLOCK, all_logits=True, max_blocks=10)
    logits, _ = jit_forward(params, caches, inputs, cfg, "reference")
    assert rel_err(logits, hf_logits(hf_model(path), tokens)) <= TOL


def test_bias_flags_that_the_architecture_reads():
    """HF's Mistral and Mixtral have no biases and only Llama's MLP has them, whatever the
    config says: their flags are not read (a Mistral checkpoint with bias tensors had them
    added; HF drops them as unused)."""
    from transformers import LlamaConfig, MistralConfig, MixtralConfig, Qwen2Config, Qwen3Config

    def biases(config_class, **kwargs):
        cfg = ModelConfig.from_hf(config_class(attention_bias=True, mlp_bias=True, **kwargs,
                                               architectures=[config_class.__name__[:-6] + "ForCausalLM"]))
        return cfg.qkv_bias, cfg.o_bias, cfg.mlp_bias

    assert biases(LlamaConfig) == (True, True, True)
    assert biases(Qwen3Config) == (True, True, False)
    assert biases(Qwen2Config) == (True, False, False)
    assert biases(MistralConfig) == biases(MixtralConfig) == (False, False, False)

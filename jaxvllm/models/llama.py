"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3, and with mixture-of-experts MLPs
Qwen3-MoE and Mixtral: `jaxvllm/models/moe.py`) as plain functions over a params pytree.

The architectures differ only in `ModelConfig` flags (bias, qk-norm, sliding windows,
RoPE, tied embeddings, which layers are sparse); the shared pieces are in
`jaxvllm/models/common.py`.
"""

from __future__ import annotations

import jax
from jax.sharding import Mesh

from jaxvllm.batch import ModelInputs
from jaxvllm.layers import rms_norm
from jaxvllm.model_config import ModelConfig
from jaxvllm.models.common import (KVCaches, Params, ParamSpec, attention, attention_specs, decoder_specs,
                                   lm_head_logits, mlp, mlp_specs, run_layers)
from jaxvllm.models.moe import moe_specs, sparse_moe


def param_specs(cfg: ModelConfig) -> list[ParamSpec]:
    def layer_specs(add, i: int) -> None:
        d = cfg.hidden_size
        add("input_norm", "input_layernorm.weight", (d,), init="ones")
        attention_specs(add, cfg)
        add("post_norm", "post_attention_layernorm.weight", (d,), init="ones")
        if cfg.is_moe_layer(i):
            moe_specs(add, cfg)
        else:
            mlp_specs(add, cfg)

    return decoder_specs(cfg, layer_specs, norm_init="ones")


def hidden_states(params: Params, kv_caches: KVCaches, inputs: ModelInputs, cfg: ModelConfig,
                  attention_backend: str = "reference", mesh: Mesh | None = None,
                  aux_layers: tuple[int, ...] = ()) -> tuple[jax.Array, KVCaches, list[jax.Array]]:
    """Final-normed hidden states [T, hidden] of every token, the new caches, and the
    residual stream entering each of `aux_layers` (EAGLE-3 reads those). With a
    mesh (tensor parallelism), attention runs per device on its heads; the rest is XLA's
    SPMD partitioning of the sharded params (see `jaxvllm/sharding.py`)."""
    def layer_step(layer, x, kv_cache, index, inputs, i):
        h = rms_norm(x, layer["input_norm"], cfg.rms_norm_eps)
        h, kv_cache = attention(layer, h, kv_cache, index, inputs, cfg, i, attention_backend, mesh)
        x = x + h
        h = rms_norm(x, layer["post_norm"], cfg.rms_norm_eps)
        x = x + (sparse_moe(layer, h, cfg, attention_backend, mesh) if cfg.is_moe_layer(i) else mlp(layer, h, cfg))
        return x, kv_cache

    x = params["embed"][inputs.input_ids]
    x, new_caches, aux = run_layers(layer_step, params, kv_caches, x, inputs, cfg, param_specs(cfg), aux_layers)
    return rms_norm(x, params["norm"], cfg.rms_norm_eps), new_caches, aux


def compute_logits(params: Params, hidden: jax.Array, cfg: ModelConfig) -> jax.Array:
    """float32 logits [rows, vocab] of final-normed hidden rows."""
    return lm_head_logits(params, hidden, cfg)

"""Gemma 3 text decoder (HF `Gemma3ForCausalLM`, config `gemma3_text`) over the paged cache.

The model contract (`jaxvllm.models.common.Model`) and the head-explicit layout of every
architecture, so loading, dummy weights and the tensor-parallel rules apply unchanged. What differs from Llama, as transformers' modeling_gemma3.py:

- RMSNorm scales by (1 + weight), in float32, before casting back (Llama casts, then
  scales); the weights are stored zero-centred (dummy init: zeros);
- four norms per layer: input, post-attention (on the attention output, before the
  residual add), pre-feedforward and post-feedforward (likewise around the MLP);
- RMSNorm of q and k over head_dim; the softmax scale is query_pre_attn_scalar ** -0.5;
- embeddings multiplied by sqrt(hidden_size), the scale cast to the embeddings' dtype first;
- a sliding/global layer pattern (`layer_types`): sliding layers attend to their window
  through the kernels and rotate with their own RoPE (`cfg.sliding_rope`, base 10k), global
  ones with `cfg.rope` (base 1M, possibly scaled);
- gelu (tanh approximation) MLP; tied embeddings by default;
- optional tanh soft-capping of the attention scores (`attn_logit_softcapping`, reference
  backend only) and of the final logits (`final_logit_softcapping`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jaxvllm.batch import ModelInputs
from jaxvllm.model_config import ModelConfig
from jaxvllm.models.common import (KVCaches, Params, ParamSpec, attention, attention_specs, decoder_specs,
                                   lm_head_logits, mlp, mlp_specs, run_layers)


def param_specs(cfg: ModelConfig) -> list[ParamSpec]:
    d = cfg.hidden_size

    def layer_specs(add, i: int) -> None:
        # Norm weights are zero-centred ((1 + w) scales): "zeros" is the identity scale.
        add("input_norm", "input_layernorm.weight", (d,), init="zeros")
        attention_specs(add, cfg, norm_init="zeros")  # (Gemma 3 has q/k norms)
        add("post_norm", "post_attention_layernorm.weight", (d,), init="zeros")
        add("pre_ffn_norm", "pre_feedforward_layernorm.weight", (d,), init="zeros")
        add("post_ffn_norm", "post_feedforward_layernorm.weight", (d,), init="zeros")
        mlp_specs(add, cfg)

    return decoder_specs(cfg, layer_specs, norm_init="zeros")


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """Gemma's RMSNorm: normalized in float32, times (1 + weight) in float32, then cast back."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (x32 * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)


def soft_cap(x: jax.Array, cap: float | None) -> jax.Array:
    return x if cap is None else jnp.tanh(x / cap) * cap


def hidden_states(params: Params, kv_caches: KVCaches, inputs: ModelInputs, cfg: ModelConfig,
                  attention_backend: str = "reference", mesh: Mesh | None = None,
                  aux_layers: tuple[int, ...] = ()) -> tuple[jax.Array, KVCaches, list[jax.Array]]:
    """Final-normed hidden states [T, hidden] of every token, the new caches, and the
    residual stream entering each of `aux_layers`."""
    embed = params["embed"]
    # HF casts sqrt(hidden) to the embeddings' dtype (bf16: sqrt(3072) = 55.4256 -> 55.5).
    x = embed[inputs.input_ids] * jnp.asarray(cfg.hidden_size**0.5, jnp.float32).astype(embed.dtype)
    eps = cfg.rms_norm_eps

    def layer_step(layer, x, kv_cache, index, inputs, i):
        h, kv_cache = attention(layer, rms_norm(x, layer["input_norm"], eps), kv_cache, index, inputs, cfg, i,
                                attention_backend, mesh, norm=rms_norm)
        x = x + rms_norm(h, layer["post_norm"], eps)
        h = mlp(layer, rms_norm(x, layer["pre_ffn_norm"], eps), cfg)
        return x + rms_norm(h, layer["post_ffn_norm"], eps), kv_cache

    x, new_caches, aux = run_layers(layer_step, params, kv_caches, x, inputs, cfg, param_specs(cfg), aux_layers)
    return rms_norm(x, params["norm"], eps), new_caches, aux


def compute_logits(params: Params, hidden: jax.Array, cfg: ModelConfig) -> jax.Array:
    """float32 logits [rows, vocab] of final-normed hidden rows, soft-capped when the config says."""
    return soft_cap(lm_head_logits(params, hidden, cfg), cfg.final_logit_softcapping)

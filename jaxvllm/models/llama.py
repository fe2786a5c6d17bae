"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3) as plain functions over a params pytree.

Params keep HF's [out, in] matrices, only reshaped so the head axis is explicit
(q_proj [num_heads, head_dim, hidden], o_proj [hidden, num_heads, head_dim]): loading
is a reshape, never a transpose, and tensor-parallel sharding rules can name the head
axis per parameter.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jaxvllm.batch import ModelInputs
from jaxvllm.config import ModelConfig
from jaxvllm.layers import apply_rope, paged_attention, rms_norm

Params = dict
KVCaches = list  # per layer: (k_cache, v_cache)


@dataclass(frozen=True)
class ParamSpec:
    """One parameter: where it lives in the pytree, its HF tensor, shapes and dummy init."""

    path: tuple[str | int, ...]
    hf_name: str
    hf_shape: tuple[int, ...]
    shape: tuple[int, ...]
    init: str  # "normal", "ones" or "zeros" (for load_format="dummy")


def param_specs(cfg: ModelConfig) -> list[ParamSpec]:
    d, f, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    hq, hkv = cfg.num_heads, cfg.num_kv_heads
    specs = [ParamSpec(("embed",), "model.embed_tokens.weight", (cfg.vocab_size, d), (cfg.vocab_size, d), "normal")]
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."

        def add(name, hf_name, hf_shape, shape=None, init="normal"):
            specs.append(ParamSpec(("layers", i, name), p + hf_name, hf_shape, shape or hf_shape, init))

        add("input_norm", "input_layernorm.weight", (d,), init="ones")
        add("q_proj", "self_attn.q_proj.weight", (hq * hd, d), (hq, hd, d))
        add("k_proj", "self_attn.k_proj.weight", (hkv * hd, d), (hkv, hd, d))
        add("v_proj", "self_attn.v_proj.weight", (hkv * hd, d), (hkv, hd, d))
        add("o_proj", "self_attn.o_proj.weight", (d, hq * hd), (d, hq, hd))
        if cfg.qkv_bias:
            add("q_bias", "self_attn.q_proj.bias", (hq * hd,), (hq, hd), init="zeros")
            add("k_bias", "self_attn.k_proj.bias", (hkv * hd,), (hkv, hd), init="zeros")
            add("v_bias", "self_attn.v_proj.bias", (hkv * hd,), (hkv, hd), init="zeros")
        if cfg.o_bias:
            add("o_bias", "self_attn.o_proj.bias", (d,), init="zeros")
        if cfg.qk_norm:
            add("q_norm", "self_attn.q_norm.weight", (hd,), init="ones")
            add("k_norm", "self_attn.k_norm.weight", (hd,), init="ones")
        add("post_norm", "post_attention_layernorm.weight", (d,), init="ones")
        add("gate_proj", "mlp.gate_proj.weight", (f, d))
        add("up_proj", "mlp.up_proj.weight", (f, d))
        add("down_proj", "mlp.down_proj.weight", (d, f))
        if cfg.mlp_bias:
            add("gate_bias", "mlp.gate_proj.bias", (f,), init="zeros")
            add("up_bias", "mlp.up_proj.bias", (f,), init="zeros")
            add("down_bias", "mlp.down_proj.bias", (d,), init="zeros")
    specs.append(ParamSpec(("norm",), "model.norm.weight", (d,), (d,), "ones"))
    if not cfg.tie_word_embeddings:
        specs.append(ParamSpec(("lm_head",), "lm_head.weight", (cfg.vocab_size, d), (cfg.vocab_size, d), "normal"))
    return specs


def _attention_block(layer: dict, x, kv_cache, inputs: ModelInputs, cfg: ModelConfig, window, backend, mesh):
    q = jnp.einsum("td,hkd->thk", x, layer["q_proj"])
    k = jnp.einsum("td,hkd->thk", x, layer["k_proj"])
    v = jnp.einsum("td,hkd->thk", x, layer["v_proj"])
    if cfg.qkv_bias:
        q, k, v = q + layer["q_bias"], k + layer["k_bias"], v + layer["v_bias"]
    if cfg.qk_norm:
        q = rms_norm(q, layer["q_norm"], cfg.rms_norm_eps)
        k = rms_norm(k, layer["k_norm"], cfg.rms_norm_eps)
    q = apply_rope(q, inputs.positions, cfg.rope)
    k = apply_rope(k, inputs.positions, cfg.rope)
    out, kv_cache = paged_attention(
        q, k, v, kv_cache, inputs, sm_scale=cfg.head_dim**-0.5, sliding_window=window, backend=backend, mesh=mesh
    )
    out = jnp.einsum("thk,dhk->td", out, layer["o_proj"])
    if cfg.o_bias:
        out = out + layer["o_bias"]
    return out, kv_cache


def _mlp(layer: dict, x, cfg: ModelConfig):
    gate = jnp.einsum("td,fd->tf", x, layer["gate_proj"])
    up = jnp.einsum("td,fd->tf", x, layer["up_proj"])
    if cfg.mlp_bias:
        gate, up = gate + layer["gate_bias"], up + layer["up_bias"]
    out = jnp.einsum("tf,df->td", jax.nn.silu(gate) * up, layer["down_proj"])
    return out + layer["down_bias"] if cfg.mlp_bias else out


def hidden_states(
    params: Params,
    kv_caches: KVCaches,
    inputs: ModelInputs,
    cfg: ModelConfig,
    attention_backend: str = "reference",
    mesh: Mesh | None = None,
) -> tuple[jax.Array, KVCaches]:
    """Final-normed hidden states [T, hidden] of every token, and the new caches. With a
    mesh (tensor parallelism), attention runs per device on its heads; the rest is XLA's
    SPMD partitioning of the sharded params (see `jaxvllm/sharding.py`)."""
    x = params["embed"][inputs.input_ids]
    new_caches = []
    for i, layer in enumerate(params["layers"]):
        h = rms_norm(x, layer["input_norm"], cfg.rms_norm_eps)
        window = cfg.sliding_windows[i] if cfg.sliding_windows else None
        h, cache = _attention_block(layer, h, kv_caches[i], inputs, cfg, window, attention_backend, mesh)
        new_caches.append(cache)
        x = x + h
        x = x + _mlp(layer, rms_norm(x, layer["post_norm"], cfg.rms_norm_eps), cfg)
    return rms_norm(x, params["norm"], cfg.rms_norm_eps), new_caches


def compute_logits(params: Params, hidden: jax.Array, cfg: ModelConfig) -> jax.Array:
    """float32 logits [rows, vocab] of final-normed hidden rows."""
    lm_head = params["embed"] if cfg.tie_word_embeddings else params["lm_head"]
    return jnp.einsum("sd,vd->sv", hidden, lm_head, preferred_element_type=jnp.float32)


def forward(
    params: Params,
    kv_caches: KVCaches,
    inputs: ModelInputs,
    cfg: ModelConfig,
    attention_backend: str = "reference",
    mesh: Mesh | None = None,
) -> tuple[jax.Array, KVCaches]:
    """Run the flat batch; returns (float32 logits [S, vocab] for `logits_indices`, new caches).

    A pure function of (params, kv_caches, inputs): jit it with `cfg` and the backend
    static and the caches donated.
    """
    hidden, kv_caches = hidden_states(params, kv_caches, inputs, cfg, attention_backend, mesh)
    return compute_logits(params, hidden[inputs.logits_indices], cfg), kv_caches

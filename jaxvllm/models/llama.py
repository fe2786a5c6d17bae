"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3, and with mixture-of-experts MLPs
Qwen3-MoE and Mixtral: `jaxvllm/models/moe.py`) as plain functions over a params pytree.

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
from jaxvllm.models.moe import sparse_moe

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
    # Stacked experts: one HF tensor per index of our first axis (`hf_name` has "{}" for the
    # expert's number; `hf_shape` is one expert's), each transposed: our [E, in, out] of
    # HF's per-expert [out, in] (see `jaxvllm/models/moe.py`).
    stacked: int = 0
    # The tensor in transformers 5's own layout, which `save_pretrained(...,
    # save_original_format=False)` writes, when that differs: stacked experts fused into one
    # [E, out, in] tensor `fused_shape` (gate above up in `gate_up_proj`), ours from row
    # `fused_row` of its out axis; Mixtral's router under `mlp.`. None: one layout only.
    fused_name: str | None = None
    fused_shape: tuple[int, ...] = ()
    fused_row: int = 0

    def hf_names(self) -> list[str]:
        return [self.hf_name.format(j) for j in range(self.stacked)] if self.stacked else [self.hf_name]


def decoder_specs(cfg: ModelConfig, layer_specs, norm_init: str) -> list[ParamSpec]:
    """The frame every decoder's params share: embeddings, each layer's own params
    (`layer_specs(add, i)`, where `add(name, hf_name, hf_shape, shape, init, stacked)`
    records one under `model.layers.{i}.`), the final norm (dummy init `norm_init`) and an
    untied lm_head."""
    d, vocab = cfg.hidden_size, cfg.vocab_size
    specs = [ParamSpec(("embed",), "model.embed_tokens.weight", (vocab, d), (vocab, d), "normal")]
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."

        def add(name, hf_name, hf_shape, shape=None, init="normal", stacked=0, fused=None):
            fused_name, fused_shape, fused_row = fused or (None, (), 0)  # (name, shape, row)
            specs.append(ParamSpec(("layers", i, name), p + hf_name, hf_shape, shape or hf_shape, init, stacked,
                                   fused_name and p + fused_name, fused_shape, fused_row))

        layer_specs(add, i)
    specs.append(ParamSpec(("norm",), "model.norm.weight", (d,), (d,), norm_init))
    if not cfg.tie_word_embeddings:
        specs.append(ParamSpec(("lm_head",), "lm_head.weight", (vocab, d), (vocab, d), "normal"))
    return specs


def param_specs(cfg: ModelConfig) -> list[ParamSpec]:
    d, f = cfg.hidden_size, cfg.intermediate_size

    def layer_specs(add, i: int) -> None:
        add("input_norm", "input_layernorm.weight", (d,), init="ones")
        attention_specs(add, cfg)
        add("post_norm", "post_attention_layernorm.weight", (d,), init="ones")
        if cfg.is_moe_layer(i):
            e, fe = cfg.num_experts, cfg.moe_intermediate_size
            # Mixtral's checkpoints name the block `block_sparse_moe` and the experts w1/w3/w2.
            mix = cfg.architecture == "MixtralForCausalLM"
            moe, (w_gate, w_up, w_down) = ("block_sparse_moe", ("w1", "w3", "w2")) if mix else (
                "mlp", ("gate_proj", "up_proj", "down_proj"))
            add("router", f"{moe}.gate.weight", (e, d), fused=("mlp.gate.weight", (e, d), 0) if mix else None)
            gate_up = ("mlp.experts.gate_up_proj", (e, 2 * fe, d))
            for name, w, hf_shape, fused in (("experts_gate", w_gate, (fe, d), (*gate_up, 0)),
                                             ("experts_up", w_up, (fe, d), (*gate_up, fe)),
                                             ("experts_down", w_down, (d, fe), ("mlp.experts.down_proj", (e, d, fe), 0))):
                add(name, f"{moe}.experts.{{}}.{w}.weight", hf_shape, (e, *hf_shape[::-1]), stacked=e, fused=fused)
        else:
            add("gate_proj", "mlp.gate_proj.weight", (f, d))
            add("up_proj", "mlp.up_proj.weight", (f, d))
            add("down_proj", "mlp.down_proj.weight", (d, f))
        if cfg.mlp_bias:
            add("gate_bias", "mlp.gate_proj.bias", (f,), init="zeros")
            add("up_bias", "mlp.up_proj.bias", (f,), init="zeros")
            add("down_bias", "mlp.down_proj.bias", (d,), init="zeros")

    return decoder_specs(cfg, layer_specs, norm_init="ones")


def attention_specs(add, cfg: ModelConfig, norm_init: str = "ones") -> None:
    """A layer's attention parameters (`decoder_specs`' `add` records each): q/k/v/o with
    the head axis explicit, their biases, the q/k norms."""
    d, hd, hq, hkv = cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
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
        add("q_norm", "self_attn.q_norm.weight", (hd,), init=norm_init)
        add("k_norm", "self_attn.k_norm.weight", (hd,), init=norm_init)


def attention(layer: dict, x, kv_cache, inputs: ModelInputs, cfg: ModelConfig, i: int, backend, mesh, norm=rms_norm):
    """Layer i's self-attention over the paged cache: q/k normed by `norm` (when the config
    has q/k norms), the layer's RoPE, window, softmax scale and soft-cap."""
    q = jnp.einsum("td,hkd->thk", x, layer["q_proj"])
    k = jnp.einsum("td,hkd->thk", x, layer["k_proj"])
    v = jnp.einsum("td,hkd->thk", x, layer["v_proj"])
    if cfg.qkv_bias:
        q, k, v = q + layer["q_bias"], k + layer["k_bias"], v + layer["v_bias"]
    if cfg.qk_norm:
        q = norm(q, layer["q_norm"], cfg.rms_norm_eps)
        k = norm(k, layer["k_norm"], cfg.rms_norm_eps)
    rope = cfg.rope_of_layer(i)
    q = apply_rope(q, inputs.positions, rope)
    k = apply_rope(k, inputs.positions, rope)
    window = cfg.sliding_windows[i] if cfg.sliding_windows else None
    cap = cfg.attn_logit_softcapping
    out, kv_cache = paged_attention(
        q, k, v, kv_cache, inputs, sm_scale=cfg.sm_scale, sliding_window=window, backend=backend, mesh=mesh,
        logits_soft_cap=None if cap is None else float(cap),
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
        h, cache = attention(layer, h, kv_caches[i], inputs, cfg, i, attention_backend, mesh)
        new_caches.append(cache)
        x = x + h
        h = rms_norm(x, layer["post_norm"], cfg.rms_norm_eps)
        x = x + (sparse_moe(layer, h, cfg, attention_backend, mesh) if cfg.is_moe_layer(i) else _mlp(layer, h, cfg))
    return rms_norm(x, params["norm"], cfg.rms_norm_eps), new_caches


def compute_logits(params: Params, hidden: jax.Array, cfg: ModelConfig) -> jax.Array:
    """float32 logits [rows, vocab] of final-normed hidden rows."""
    lm_head = params["embed"] if cfg.tie_word_embeddings else params["lm_head"]
    return jnp.einsum("sd,vd->sv", hidden, lm_head, preferred_element_type=jnp.float32)

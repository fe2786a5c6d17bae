"""What every architecture shares: the model contract, the parameter specs' frame, the
self-attention over the paged cache, the gated MLP and the lm_head.

Params keep HF's [out, in] matrices, only reshaped so the head axis is explicit
(q_proj [num_heads, head_dim, hidden], o_proj [hidden, num_heads, head_dim]): loading
is a reshape, never a transpose, and tensor-parallel sharding rules can name the head
axis per parameter. Every matmul with such a weight goes through `layers.linear`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jaxvllm.batch import ModelInputs
from jaxvllm.layers import apply_rope, linear, paged_attention, rms_norm
from jaxvllm.model_config import ModelConfig

Params = dict
KVCaches = list  # per layer: (k_cache, v_cache[, scales])


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


@runtime_checkable
class Model(Protocol):
    """What an architecture provides: a module of plain functions with these names
    satisfies it. `jaxvllm.models.MODELS` maps each HF architecture name to one."""

    def param_specs(self, cfg: ModelConfig) -> list[ParamSpec]:
        """Every parameter, with its HF name and our shape (the loader reads these)."""

    def hidden_states(self, params: Params, kv_caches: KVCaches, inputs: ModelInputs, cfg: ModelConfig,
                      attention_backend: str = "reference", mesh: Mesh | None = None,
                      aux_layers: tuple[int, ...] = ()) -> tuple[jax.Array, KVCaches, list[jax.Array]]:
        """Final-normed hidden states [T, hidden] of every token, the new caches, and the
        residual stream [T, hidden] entering each of `aux_layers` (EAGLE-3's inputs)."""

    def compute_logits(self, params: Params, hidden: jax.Array, cfg: ModelConfig) -> jax.Array:
        """float32 logits [rows, vocab] of final-normed hidden rows."""


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


def mlp_specs(add, cfg: ModelConfig) -> None:
    """A dense layer's gated MLP (gate/up/down, and their biases where the config has them)."""
    d, f = cfg.hidden_size, cfg.intermediate_size
    add("gate_proj", "mlp.gate_proj.weight", (f, d))
    add("up_proj", "mlp.up_proj.weight", (f, d))
    add("down_proj", "mlp.down_proj.weight", (d, f))
    if cfg.mlp_bias:
        add("gate_bias", "mlp.gate_proj.bias", (f,), init="zeros")
        add("up_bias", "mlp.up_proj.bias", (f,), init="zeros")
        add("down_bias", "mlp.down_proj.bias", (d,), init="zeros")


def attention(layer: dict, x, kv_cache, inputs: ModelInputs, cfg: ModelConfig, i: int, backend, mesh, norm=rms_norm):
    """Layer i's self-attention over the paged cache: q/k normed by `norm` (when the config
    has q/k norms), the layer's RoPE, window, softmax scale and soft-cap."""
    q = linear(x, layer["q_proj"], layer.get("q_bias"))
    k = linear(x, layer["k_proj"], layer.get("k_bias"))
    v = linear(x, layer["v_proj"], layer.get("v_bias"))
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
    return linear(out, layer["o_proj"], layer.get("o_bias")), kv_cache


def layer_kinds(cfg: ModelConfig) -> list[int]:
    """Each layer's kind, as the first layer that has the same static settings (RoPE,
    sliding window, dense or sparse MLP)."""
    keys = [(cfg.rope_of_layer(i), cfg.sliding_windows[i] if cfg.sliding_windows else None, cfg.is_moe_layer(i))
            for i in range(cfg.num_layers)]
    return [keys.index(key) for key in keys]


def run_layers(layer_fn: Callable, params: Params, kv_caches: KVCaches, x: jax.Array, inputs: ModelInputs,
               cfg: ModelConfig, collect: tuple[int, ...] = ()) -> tuple[jax.Array, KVCaches, list[jax.Array]]:
    """x through every decoder layer: `layer_fn(layer, x, kv_cache, inputs, kind)` -> (x, kv_cache),
    `kind` a layer index (`layer_kinds`) whose static settings the layer shares. Also
    returns x as it enters each layer of `collect`, in that order.

    Each call is a jit nested in the step's, so JAX traces and lowers one layer of each
    kind, not every layer: start-up (even from the persistent cache, whose key needs the
    lowered step) does not grow with depth. XLA inlines the calls: the compiled step is
    the one the unrolled layers gave."""
    step = jax.jit(layer_fn, static_argnums=4)
    new_caches, entering = [], {}
    for i, (layer, cache, kind) in enumerate(zip(params["layers"], kv_caches, layer_kinds(cfg))):
        if i in collect:
            entering[i] = x
        x, cache = step(layer, x, cache, inputs, kind)
        new_caches.append(cache)
    return x, new_caches, [entering[i] for i in collect]


def activation(x: jax.Array, hidden_act: str) -> jax.Array:
    """HF's `hidden_act`: silu, or gelu (exact, or gelu_pytorch_tanh's tanh form)."""
    if hidden_act == "silu":
        return jax.nn.silu(x)
    return jax.nn.gelu(x, approximate=hidden_act != "gelu")


def mlp(layer: dict, x: jax.Array, cfg: ModelConfig) -> jax.Array:
    """The gated MLP: down(act(gate(x)) * up(x)), with biases where the params have them."""
    gate = linear(x, layer["gate_proj"], layer.get("gate_bias"))
    up = linear(x, layer["up_proj"], layer.get("up_bias"))
    return linear(activation(gate, cfg.hidden_act) * up, layer["down_proj"], layer.get("down_bias"))


def lm_head_logits(params: Params, hidden: jax.Array, cfg: ModelConfig) -> jax.Array:
    """float32 logits [rows, vocab] of final-normed hidden rows (the embeddings when tied)."""
    lm_head = params["embed"] if cfg.tie_word_embeddings else params["lm_head"]
    return linear(hidden, lm_head, preferred_element_type=jnp.float32)

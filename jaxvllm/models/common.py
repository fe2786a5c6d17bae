"""What every architecture shares: the model contract, the parameter specs' frame, the
self-attention over the paged cache, the gated MLP and the lm_head.

Params keep HF's [out, in] matrices, only reshaped so the head axis is explicit
(q_proj [num_heads, head_dim, hidden], o_proj [hidden, num_heads, head_dim]): loading
is a reshape (a CPU's aside, below), and tensor-parallel sharding rules can name the head
axis per parameter. Every matmul with such a weight goes through `layers.linear`. On a
CPU, as in vLLM, q/k/v are one weight and gate/up another, each one matmul
(`ModelConfig.merge_projections`): qkv_proj [num_kv_heads, group + 2, head_dim, hidden]
(each KV head's query heads, then its k and its v, so that a split on KV heads gives
each device whole groups) and gate_up_proj [2, intermediate, hidden] (`ParamSpec.parts`).
XLA's GPU backend merges those matmuls itself. A CPU also stores each layer matrix inputs
first (`layers.InputMajorWeight`: the spec's shape with its input axes moved to the front,
each block transposed as the loader reads it), which XLA:CPU multiplies faster.

Each kind of layer parameter is one array stacked over the layers that have it
(`params["layers"]["q_proj"]` [num_layers, heads, head_dim, hidden]), so a step's
argument leaves do not grow with depth. Each layer reads its row with a dynamic slice at
an index XLA cannot see (`params["layer_rows"]`, 0, 1, ...), which XLA's GPU backend
fuses into the matmul reading it; a static slice it copies out first. Expert stacks,
which the grouped-matmul kernel reads whole, stay one array per layer (a list), and so
does every layer matrix on a CPU (`ModelConfig.stack_layers`), whose XLA copies a
layer's rows out of a stack on every step; norms and biases stack there too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxvllm.batch import ModelInputs
from jaxvllm.layers import apply_rope, linear, paged_attention, rms_norm
from jaxvllm.lora.weights import LoRAWeight, lora_groups
from jaxvllm.model_config import KV_GROUPS, SIDE_BY_SIDE, ModelConfig

Params = dict
KVCaches = tuple  # (k_cache, v_cache[, scales]), every layer's (see `jaxvllm/kv_cache.py`)


@dataclass(frozen=True)
class ParamSpec:
    """One parameter: where it lives in the pytree, its HF tensor, shapes and dummy init."""

    path: tuple[str | int, ...]
    hf_name: str
    hf_shape: tuple[int, ...]
    shape: tuple[int, ...]
    init: str  # "normal", "ones" or "zeros" (for load_format="dummy"); "rows": `stack_layers`' indices
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
    # A parameter of several layers (path ("layers", name)): one member spec per layer that
    # has it, in layer order (each member's path is ("layers", i, name)); `shape` is
    # (len(layers), *member shape) when stacked, the members' shape when a list (`stack` False).
    layers: tuple["ParamSpec", ...] = ()
    stack: bool = True
    # A parameter made of several HF tensors (`merged`): one spec per tensor, as a parameter
    # of its own would have it, joined as `merge` says (KV_GROUPS or SIDE_BY_SIDE).
    parts: tuple["ParamSpec", ...] = ()
    merge: str = ""
    # A quantized checkpoint's (`loader.quantized_specs`): the element type the tensor keeps
    # (None: the model's dtype), and for block scales, how many of our rows share one of
    # the checkpoint's (its rows are repeated over their block when read).
    dtype: str | None = None
    row_block: int = 0

    def hf_names(self) -> list[str]:
        if self.layers or self.parts:
            return [name for member in self.layers or self.parts for name in member.hf_names()]
        return [self.hf_name.format(j) for j in range(self.stacked)] if self.stacked else [self.hf_name]




def merged(path: tuple, parts: list[ParamSpec], merge: str) -> ParamSpec:
    """One parameter of several HF tensors (`parts`, each spec'd as a parameter of its own).
    Its hf_shape is its first part's, so that a merged vector still counts as one."""
    first = parts[0]
    if merge == KV_GROUPS:
        q, k = first.shape, parts[1].shape
        shape = (k[0], q[0] // k[0] + 2, *q[1:])
    else:
        shape = (len(parts), *first.shape)
    return ParamSpec(path, " + ".join(p.hf_name for p in parts), first.hf_shape, shape, first.init,
                     parts=tuple(parts), merge=merge)


def merge_parts(merge: str, parts: list):
    """The merged parameter's array from its parts' (numpy or jax; k and v already repeated
    to the KV heads the model runs with), or a block of it from the parts' blocks."""
    xp = np if all(isinstance(p, np.ndarray) for p in parts) else jnp
    if merge == SIDE_BY_SIDE:
        return xp.stack(parts)
    q, k, v = parts
    heads = k.shape[0]
    return xp.concatenate([q.reshape(heads, -1, *q.shape[1:]), k[:, None], v[:, None]], axis=1)


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
        """float32 logits [rows, vocab] of final-normed hidden rows. It reads only the
        params named in `LOGITS_PARAMS` (`logits_params`)."""


# What `compute_logits` reads of a model's params: steps that only score hidden states
# (prompt logprobs, an EAGLE head's drafts) take these, not every layer's weights as
# arguments (each one more leaf for every call's dispatch).
LOGITS_PARAMS = ("embed", "lm_head")


def logits_params(params: Params) -> Params:
    """The part of `params` that `compute_logits` reads."""
    return {name: params[name] for name in LOGITS_PARAMS if name in params}


# Kept one array per layer (a list), not stacked: the grouped-matmul kernel reads an
# expert stack whole, and a slice of a stacked array handed to a kernel is a copy.
UNSTACKED = ("experts_gate", "experts_up", "experts_down")


def stack_layers(specs: list[ParamSpec], stack: bool = True) -> list[ParamSpec]:
    """Per-layer specs (paths ("layers", i, name)) merged into one spec per name, over the
    layers that have it, in the place of its first member; other specs as they are. Each
    is one stacked array, or (`stack` False, or an expert stack) a list of the layers';
    vectors (1-D in the checkpoint) stack whatever `stack` says."""
    members: dict[str, list[ParamSpec]] = {}
    for spec in specs:
        if spec.path[0] == "layers":
            members.setdefault(spec.path[-1], []).append(spec)
    out = []
    for spec in specs:
        if spec.path[0] != "layers":
            out.append(spec)
        elif members[spec.path[-1]][0] is spec:
            # A layer's vectors (norms, biases) stack everywhere: a row of them is too small
            # for XLA:CPU's copy out of the stack to cost what an argument leaf does.
            stacked = (stack or len(spec.hf_shape) == 1) and spec.path[-1] not in UNSTACKED
            group = tuple(members[spec.path[-1]])
            if stacked and any(m.shape != spec.shape for m in group):
                raise ValueError(f"{spec.path[-1]}: layers differ in shape; it cannot be stacked")
            shape = (len(group), *spec.shape) if stacked else spec.shape
            out.append(ParamSpec(("layers", spec.path[-1]), spec.hf_name, spec.hf_shape, shape, spec.init,
                                 layers=group, stack=stacked))
    rows = max((len(s.layers) for s in out if s.stack and s.layers), default=0)
    if rows:  # the rows' indices, an argument of the step (`run_layers`), not a checkpoint tensor
        out.append(ParamSpec(("layer_rows",), "", (), (rows,), "rows"))
    return out


def layer_rows(specs: list[ParamSpec]) -> list[dict[str, int]]:
    """For each layer, its parameters' names and its row in each one's stack (or list)."""
    members = [(m.path[1], spec.path[-1], row) for spec in specs for row, m in enumerate(spec.layers)]
    rows: list[dict[str, int]] = [{} for _ in range(1 + max((i for i, _, _ in members), default=-1))]
    for i, name, row in members:
        rows[i][name] = row
    return rows


def layer_params(params: Params, specs: list[ParamSpec], i: int) -> dict:
    """Layer i's parameters, each its slice of the stack (or its element of the list)."""
    return {name: params["layers"][name][row] for name, row in layer_rows(specs)[i].items()}


def decoder_specs(cfg: ModelConfig, layer_specs, norm_init: str) -> list[ParamSpec]:
    """The frame every decoder's params share: embeddings, each layer's own params
    (`layer_specs(add, i)`, where `add(name, hf_name, hf_shape, shape, init, stacked)`
    records one under `model.layers.{i}.`), stacked over the layers (`stack_layers`), the
    final norm (dummy init `norm_init`) and an untied lm_head."""
    d, vocab = cfg.hidden_size, cfg.vocab_size
    specs = [ParamSpec(("embed",), "model.embed_tokens.weight", (vocab, d), (vocab, d), "normal")]
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."

        def add(name, hf_name=None, hf_shape=None, shape=None, init="normal", stacked=0, fused=None, parts=(),
                merge=""):
            if parts:  # (name, hf_name, hf_shape, shape) of each
                members = [ParamSpec(("layers", i, n), p + h, hs, s, init) for n, h, hs, s in parts]
                specs.append(merged(("layers", i, name), members, merge))
                return
            fused_name, fused_shape, fused_row = fused or (None, (), 0)  # (name, shape, row)
            specs.append(ParamSpec(("layers", i, name), p + hf_name, hf_shape, shape or hf_shape, init, stacked,
                                   fused_name and p + fused_name, fused_shape, fused_row))

        layer_specs(add, i)
    specs.append(ParamSpec(("norm",), "model.norm.weight", (d,), (d,), norm_init))
    if not cfg.tie_word_embeddings:
        specs.append(ParamSpec(("lm_head",), "lm_head.weight", (vocab, d), (vocab, d), "normal"))
    return stack_layers(specs, cfg.stack_layers)


def attention_specs(add, cfg: ModelConfig, norm_init: str = "ones") -> None:
    """A layer's attention parameters (`decoder_specs`' `add` records each): q/k/v (one
    qkv_proj when `merge_projections`) and o with the head axis explicit, their biases,
    the q/k norms."""
    d, hd, hq, hkv = cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    heads = (("q", hq), ("k", hkv), ("v", hkv))
    weights = [(f"{x}_proj", f"self_attn.{x}_proj.weight", (h * hd, d), (h, hd, d)) for x, h in heads]
    biases = [(f"{x}_bias", f"self_attn.{x}_proj.bias", (h * hd,), (h, hd)) for x, h in heads]
    projections(add, cfg, "qkv_proj", weights, KV_GROUPS)
    add("o_proj", "self_attn.o_proj.weight", (d, hq * hd), (d, hq, hd))
    if cfg.qkv_bias:
        projections(add, cfg, "qkv_bias", biases, KV_GROUPS, init="zeros")
    if cfg.o_bias:
        add("o_bias", "self_attn.o_proj.bias", (d,), init="zeros")
    if cfg.qk_norm:
        add("q_norm", "self_attn.q_norm.weight", (hd,), init=norm_init)
        add("k_norm", "self_attn.k_norm.weight", (hd,), init=norm_init)


def mlp_specs(add, cfg: ModelConfig) -> None:
    """A dense layer's gated MLP (gate/up, one gate_up_proj when `merge_projections`, and
    down) and their biases where the config has them."""
    d, f = cfg.hidden_size, cfg.intermediate_size
    projections(add, cfg, "gate_up_proj", [(f"{x}_proj", f"mlp.{x}_proj.weight", (f, d), (f, d))
                                           for x in ("gate", "up")], SIDE_BY_SIDE)
    add("down_proj", "mlp.down_proj.weight", (d, f))
    if cfg.mlp_bias:
        projections(add, cfg, "gate_up_bias", [(f"{x}_bias", f"mlp.{x}_proj.bias", (f,), (f,))
                                               for x in ("gate", "up")], SIDE_BY_SIDE, init="zeros")
        add("down_bias", "mlp.down_proj.bias", (d,), init="zeros")


def projections(add, cfg: ModelConfig, name: str, parts: list[tuple], merge: str, init: str = "normal") -> None:
    """Parameters read by one input: one merged parameter `name` (`merge_projections`), else
    one each. `parts`: each one's (name, hf_name, hf_shape, shape)."""
    if cfg.merge_projections:
        add(name, parts=parts, merge=merge, init=init)
    else:
        for part, hf_name, hf_shape, shape in parts:
            add(part, hf_name, hf_shape, shape, init=init)


def attention(layer: dict, x, kv_cache, layer_index, inputs: ModelInputs, cfg: ModelConfig, i: int, backend, mesh,
              norm=rms_norm):
    """Self-attention over layer `layer_index`'s pages of the cache (an int32 scalar, traced):
    q/k normed by `norm` (when the config has q/k norms), the RoPE, window, softmax scale
    and soft-cap of layer i (the static twin of layer_index: its kind, `layer_kinds`)."""
    if "qkv_proj" in layer:  # [T, kv_heads, group + 2, head_dim]
        qkv = linear(x, layer["qkv_proj"], layer.get("qkv_bias"))
        q, k, v = qkv[:, :, :-2].reshape(qkv.shape[0], -1, qkv.shape[-1]), qkv[:, :, -2], qkv[:, :, -1]
    else:
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
        q, k, v, kv_cache, layer_index, inputs, sm_scale=cfg.sm_scale, sliding_window=window, backend=backend, mesh=mesh,
        logits_soft_cap=None if cap is None else float(cap), cache_bits=cfg.kv_cache_bits,
    )
    return linear(out, layer["o_proj"], layer.get("o_bias")), kv_cache


def layer_kinds(cfg: ModelConfig) -> list[int]:
    """Each layer's kind, as the first layer that has the same static settings (RoPE,
    sliding window, dense or sparse MLP)."""
    keys = [(cfg.rope_of_layer(i), cfg.sliding_windows[i] if cfg.sliding_windows else None, cfg.is_moe_layer(i))
            for i in range(cfg.num_layers)]
    return [keys.index(key) for key in keys]


def run_layers(layer_fn: Callable, params: Params, kv_caches: KVCaches, x: jax.Array, inputs: ModelInputs,
               cfg: ModelConfig, specs: list[ParamSpec],
               collect: tuple[int, ...] = ()) -> tuple[jax.Array, KVCaches, list[jax.Array]]:
    """x through every decoder layer: `layer_fn(layer, x, kv_cache, layer_index, inputs, kind)`
    -> (x, kv_cache), `layer` the layer's slices of the stacked params (`specs` say which
    rows), kv_cache every layer's, `layer_index` the layer's (an int32 scalar, traced),
    `kind` a layer index (`layer_kinds`) whose static settings the layer shares. Also
    returns x as it enters each layer of `collect`, in that order.

    Each call is a jit nested in the step's, so JAX traces and lowers one layer of each
    kind, not every layer: start-up (even from the persistent cache, whose key needs the
    lowered step) does not grow with depth. XLA inlines the calls: the compiled step is
    the one the unrolled layers gave.

    With LoRA adapters in the step (`params["lora"]`, the device slots' stacks by weight
    name, and `inputs.lora_slots`), each targeted weight comes as a `LoRAWeight` of its
    rows, which `linear` adds every token's adapter for."""
    step = jax.jit(layer_fn, static_argnums=5)
    entering = {}
    stacks = params["layers"]
    lora = params.get("lora") if inputs.lora_slots is not None else None
    merges = {spec.path[-1]: spec.layers[0].merge for spec in specs if spec.layers}
    groups = None  # (the tokens grouped by slot, once a step, for the grouped-matmul form)
    if lora and inputs.lora_kernel:
        groups = lora_groups(inputs.lora_slots, next(iter(lora.values()))[0].shape[1])

    def row_of(stack, row: int):
        if isinstance(stack, list):
            return stack[row]
        index = params["layer_rows"][row]  # (a quantized weight: its values' and scales' rows)
        return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, index, keepdims=False), stack)

    for i, (rows, kind) in enumerate(zip(layer_rows(specs), layer_kinds(cfg))):
        layer = {name: row_of(stacks[name], row) for name, row in rows.items()}
        for name, (a, b) in (lora or {}).items():
            if name in layer:
                index = params["layer_rows"][rows[name]]
                a, b = jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, index, keepdims=False), (a, b))
                layer[name] = LoRAWeight(layer[name], a, b, inputs.lora_slots, merges[name], groups)
        if i in collect:
            entering[i] = x
        x, kv_caches = step(layer, x, kv_caches, np.int32(i), inputs, kind)
    return x, kv_caches, [entering[i] for i in collect]


def activation(x: jax.Array, hidden_act: str) -> jax.Array:
    """HF's `hidden_act`: silu, or gelu (exact, or gelu_pytorch_tanh's tanh form)."""
    if hidden_act == "silu":
        return jax.nn.silu(x)
    return jax.nn.gelu(x, approximate=hidden_act != "gelu")


def mlp(layer: dict, x: jax.Array, cfg: ModelConfig) -> jax.Array:
    """The gated MLP: down(act(gate(x)) * up(x)), with biases where the params have them."""
    if "gate_up_proj" in layer:  # [T, 2, intermediate]
        gate_up = linear(x, layer["gate_up_proj"], layer.get("gate_up_bias"))
        gate, up = gate_up[:, 0], gate_up[:, 1]
    else:
        gate = linear(x, layer["gate_proj"], layer.get("gate_bias"))
        up = linear(x, layer["up_proj"], layer.get("up_bias"))
    return linear(activation(gate, cfg.hidden_act) * up, layer["down_proj"], layer.get("down_bias"))


def lm_head_logits(params: Params, hidden: jax.Array, cfg: ModelConfig) -> jax.Array:
    """float32 logits [rows, vocab] of final-normed hidden rows (the embeddings when tied)."""
    lm_head = params["embed"] if cfg.tie_word_embeddings else params["lm_head"]
    return linear(hidden, lm_head, preferred_element_type=jnp.float32)

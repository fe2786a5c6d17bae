"""EAGLE and EAGLE-3 draft heads (vLLM's "eagle" and "eagle3" methods): a decoder layer or
two that drafts from the target's own hidden states, over a paged KV cache of its own.

The head's input at position p is the embedding of token p + 1 beside a hidden state of
position p: the target's (EAGLE: its final-normed hidden state; EAGLE-3: the residual
streams entering three of its layers, side by side, brought to the head's width by `fc`),
or, for a token the head drafted itself, the head's own output before it. So the head's
K/V of position p can only be written once token p + 1 is known, after the target's step:

- `_prefill` runs after each step, over that step's packed batch (the same layout, its
  hidden states kept on the device), its tokens shifted by one: each position's next
  token where the request has one (the prompt's, an accepted draft or the token the step
  sampled), else the slot is not written (rejected drafts, the chunk's end);
- then `_decode`, for each drafting request: its newest position's output gives the first
  draft and K - 1 unrolled decode steps the rest (a static trip count, K/V written in
  place, in slots the engine allocated). Drafts are argmaxes (q one-hot), as in vLLM's V1
  proposer.

Under async scheduling the step's tokens are known on the device only when the next step
is dispatched: `_prefill_rows` finds each token's next one there, from the step's input ids,
the counts accepted and the tokens sampled, and `_decode_rows` writes the drafts to
`draft_rows`, where the next step reads them (`BatchLayout.model_inputs`).

Checkpoints are read in their published layouts, as vLLM's `llama_eagle.py` and
`llama_eagle3.py` read them:

- EAGLE: `fc.weight` [H, 2H] over (embedding, hidden) (and `fc.bias` where the EAGLE authors'
  heads have one), `layers.{i}.*` Llama layers, the first without an input norm; no final
  norm; the target's embeddings (a copy in the folder is not read, as in vLLM) and the
  target's lm_head unless the folder has its own.
- EAGLE-3: `fc.weight` [H, 3 x target hidden], `midlayer.*` whose q/k/v take (normed
  embedding, `hidden_norm`-ed hidden) [2H], `norm.weight`, an lm_head over a draft
  vocabulary and `d2t`, the target id of each draft id less that id (`t2d` is not needed);
  its own `embed_tokens.weight` when it has one.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxvllm.batch import ModelInputs
from jaxvllm.config import EngineConfig
from jaxvllm.input_batch import NEWEST, BatchLayout, store_drafts
from jaxvllm.kv_cache import CACHE_STEP_COMPILER_OPTIONS, KVCacheSpec, allocate_kv_caches, with_cache_storage
from jaxvllm.layers import linear, rms_norm
from jaxvllm.loader import (SPECULATORS_FORMAT, _param_shardings, dummy_params, load_safetensors, resolve_dtype,
                            tensor_files)
from jaxvllm.model_config import ModelConfig
from jaxvllm.models import MODELS
from jaxvllm.models.common import ParamSpec, attention, attention_specs, mlp, mlp_specs
from jaxvllm.sharding import kv_cache_sharding, kv_repeats, put, replicated, sharded_config, step_input, structs
from jaxvllm.spec_decode.draft_model import decode_inputs


@dataclass(frozen=True)
class EagleConfig:
    """An EAGLE head as its config.json describes it, checked against the target's."""

    method: str  # "eagle" or "eagle3"
    model: ModelConfig  # the head's decoder layers (Llama layers)
    draft_vocab_size: int  # EAGLE-3's lm_head may cover a part of the vocabulary (`d2t` maps it)
    target_hidden_size: int
    # EAGLE-3: the target layers whose inputs `fc` combines; () when the head reads the
    # target's final hidden state (`use_aux_hidden_state: false`).
    aux_layers: tuple[int, ...] = ()
    norm_before_residual: bool = False  # EAGLE-3: the residual is the normed hidden state


def default_aux_layers(num_layers: int) -> tuple[int, ...]:
    """vLLM's choice of the target layers an EAGLE-3 head reads when its config names none."""
    return (2, num_layers // 2, num_layers - 3)


def load_eagle_config(model: str, method: str, target: ModelConfig) -> EagleConfig:
    """Read and check an EAGLE head's config.json against the target's config, before any
    weight loads: the head must work at the target's hidden size and vocabulary."""
    from transformers import LlamaConfig

    path = Path(model) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"the {method} head {model!r} has no config.json")
    try:
        raw = json.loads(path.read_text())
    except ValueError as e:
        raise ValueError(f"cannot read {path}: {e}") from e
    if raw.get("add_para_norm"):
        raise ValueError(f"the {method} head {model!r} is a HASS head (add_para_norm), not supported by jaxvllm yet")
    if "speculators_config" in raw:
        raise ValueError(SPECULATORS_FORMAT.format(model))
    hf = LlamaConfig.from_dict({k: v for k, v in raw.items() if k not in ("architectures", "model_type")})
    hf.architectures = ["LlamaForCausalLM"]  # the head's layers are Llama layers, whatever it drafts for
    cfg = ModelConfig.from_hf(hf)
    eagle = raw.get("eagle_config") or {}
    target_hidden = raw.get("target_hidden_size") or cfg.hidden_size
    if target_hidden != target.hidden_size:
        raise ValueError(f"the {method} head {model!r} is for a target of hidden size {target_hidden}; the target's "
                         f"is {target.hidden_size}")
    aux: tuple[int, ...] = ()
    if method == "eagle3" and eagle.get("use_aux_hidden_state", True):
        aux = tuple(eagle.get("eagle_aux_hidden_state_layer_ids") or default_aux_layers(target.num_layers))
        if len(aux) != 3 or not all(0 <= i < target.num_layers for i in aux):
            raise ValueError(f"the eagle3 head {model!r} reads target layers {list(aux)}: it needs three of the "
                             f"target's {target.num_layers} layers (eagle_config.eagle_aux_hidden_state_layer_ids)")
    if not aux and cfg.hidden_size != target.hidden_size:  # (only EAGLE-3's fc changes the width)
        raise ValueError(f"the {method} head {model!r} has hidden size {cfg.hidden_size}; the target's is "
                         f"{target.hidden_size}")
    if cfg.vocab_size != target.vocab_size:
        raise ValueError(f"the {method} head {model!r} has a vocabulary of {cfg.vocab_size} tokens, the target's has "
                         f"{target.vocab_size}: speculative decoding needs the same vocabulary")
    return EagleConfig(method, cfg, raw.get("draft_vocab_size") or cfg.vocab_size, target_hidden, aux,
                       bool(raw.get("norm_before_residual", False)))


def check_eagle_head(config: EngineConfig) -> None:
    """Refuse, before any weight loads, a head that does not fit the target (its config.json
    against the target's)."""
    from jaxvllm.loader import load_config

    load_eagle_config(config.speculative_config.model, config.speculative_config.method, load_config(config.model))


def param_specs(e: EagleConfig, names: set[str]) -> list[ParamSpec]:
    """The head's parameters, in the checkpoint's names (`names`: the tensors it holds;
    optional ones, such as its own embeddings, are read when there). A head with dummy
    weights (`names` empty) has what it cannot share with the target."""
    cfg, specs = e.model, []
    d = cfg.hidden_size

    def one(path, name, shape, init="normal"):
        specs.append(ParamSpec(path, name, shape, shape, init))

    if e.method == "eagle" or e.aux_layers:  # (embedding, hidden) or EAGLE-3's three target states
        one(("fc",), "fc.weight", (d, 3 * e.target_hidden_size if e.aux_layers else 2 * d))
    if "fc.bias" in names:
        one(("fc_bias",), "fc.bias", (d,), "zeros")
    if "embed_tokens.weight" in names and e.method == "eagle3":  # (an EAGLE head's copy: the target's, as vLLM)
        one(("embed",), "embed_tokens.weight", (cfg.vocab_size, d))
    for i in range(cfg.num_layers):
        first3 = e.method == "eagle3" and i == 0  # its q/k/v read (embedding, hidden) side by side
        prefix = "midlayer." if first3 and not any(n.startswith("layers.0.") for n in names) else f"layers.{i}."

        def add(name, hf_name, hf_shape, shape=None, init="normal", *_):
            shape = shape or hf_shape
            if first3 and name in ("q_proj", "k_proj", "v_proj"):
                hf_shape, shape = (*hf_shape[:-1], 2 * d), (*shape[:-1], 2 * d)
            specs.append(ParamSpec(("layers", i, name), prefix + hf_name, hf_shape, shape, init))

        if i > 0 or e.method == "eagle3":  # (EAGLE's first layer has no input norm)
            add("input_norm", "input_layernorm.weight", (d,), init="ones")
        if first3:
            add("hidden_norm", "hidden_norm.weight", (d,), init="ones")
        attention_specs(add, cfg)
        add("post_norm", "post_attention_layernorm.weight", (d,), init="ones")
        mlp_specs(add, cfg)
    if e.method == "eagle3":
        one(("norm",), "norm.weight", (d,), "ones")
    if "lm_head.weight" in names or (not names and e.draft_vocab_size != cfg.vocab_size):
        one(("head",), "lm_head.weight", (e.draft_vocab_size, d))  # (replicated: a draft vocabulary need not split)
    return specs


def load_eagle(model: str, e: EagleConfig, *, dtype, load_format: str, seed: int, mesh: Mesh | None, device
               ) -> tuple[ModelConfig, dict]:
    """The head's (run config, params), split over `mesh` as a target's layers are."""
    files = {} if load_format == "dummy" else tensor_files(Path(model))
    if files and e.draft_vocab_size != e.model.vocab_size:  # (refused before any weight loads)
        for name, what in (("lm_head.weight", "lm_head.weight"), ("d2t", "d2t map")):
            if name not in files:
                raise ValueError(f"the eagle3 head {model!r} drafts over {e.draft_vocab_size} tokens but has no {what}")
    specs = param_specs(e, set(files))
    run_cfg = sharded_config(e.model, 1 if mesh is None else mesh.size)
    shardings, repeats = _param_shardings(run_cfg, mesh, device, specs), kv_repeats(e.model, run_cfg)
    if load_format == "dummy":
        return run_cfg, dummy_params(e.model, dtype, seed, shardings, repeats, specs)
    params = load_safetensors(Path(model), e.model, dtype, shardings, repeats, specs,
                              frozenset({"d2t", "t2d", "embed_tokens.weight"}))
    if "d2t" in files:
        from safetensors import safe_open

        with safe_open(str(files["d2t"]), framework="numpy") as f:
            d2t = f.get_tensor("d2t")
        if d2t.shape != (e.draft_vocab_size,):
            raise ValueError(f"tensor d2t of {model!r} has shape {d2t.shape}, draft_vocab_size implies "
                             f"{(e.draft_vocab_size,)}")
        params["d2t"] = put(d2t.astype(np.int32), replicated(mesh) if mesh is not None else jax.sharding.
                            SingleDeviceSharding(device))
    return run_cfg, params


def _head(params, embed, kv_caches, input_ids, hidden, inputs: ModelInputs, e: EagleConfig, cfg: ModelConfig,
          backend: str, mesh: Mesh | None):
    """The head's layers over tokens `input_ids` with the hidden states [T, H] before them:
    (the states its logits come from, the states the next position reads, caches)."""
    layers, eps, x_embed = params["layers"], cfg.rms_norm_eps, embed[input_ids]
    first = layers[0]
    if e.method == "eagle":
        x = linear(jnp.concatenate([x_embed, hidden.astype(x_embed.dtype)], -1), params["fc"], params.get("fc_bias"))
        h, kv_caches = attention(first, x, kv_caches, 0, inputs, cfg, 0, backend, mesh)
    else:
        normed = rms_norm(hidden, first["hidden_norm"], eps)
        x = normed if e.norm_before_residual else hidden
        h = jnp.concatenate([rms_norm(x_embed, first["input_norm"], eps), normed], -1)
        h, kv_caches = attention(first, h, kv_caches, 0, inputs, cfg, 0, backend, mesh)
    x = x + h
    x = x + mlp(first, rms_norm(x, first["post_norm"], eps), cfg)
    for i, layer in enumerate(layers[1:], start=1):
        h, kv_caches = attention(layer, rms_norm(x, layer["input_norm"], eps), kv_caches, i, inputs, cfg, i, backend,
                                 mesh)
        x = x + h
        x = x + mlp(layer, rms_norm(x, layer["post_norm"], eps), cfg)
    return (x if e.method == "eagle" else rms_norm(x, params["norm"], eps)), x, kv_caches


def _drafts(params, target_params, states, target: ModelConfig):
    """Each row's argmax token, in the target's ids. (`target_params`, in every step of the
    head: the target's `logits_params`, its embeddings and lm_head.)"""
    if "head" in params:
        logits = linear(states, params["head"], preferred_element_type=jnp.float32)
    else:
        logits = MODELS[target.architecture].compute_logits(target_params, states, target)
    best = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return best + params["d2t"][best] if "d2t" in params else best


def _over_step(params, target_params, kv_caches, hidden, inputs: ModelInputs, next_tokens, valid, draft_index, *,
               e: EagleConfig, cfg: ModelConfig, backend: str, mesh: Mesh | None):
    """The head over a target step's `inputs` (`hidden`: the step's hidden states; each
    token's next one `next_tokens` [T], its K/V written where `valid`); returns the head's
    states and carries at tokens `draft_index` [max_num_seqs] (the drafting rows' newest
    positions, then padding), and the caches."""
    inputs = dataclasses.replace(inputs, input_ids=next_tokens, slot_mapping=jnp.where(valid, inputs.slot_mapping, -1))
    if e.aux_layers:
        hidden = linear(hidden, params["fc"], params.get("fc_bias"))
    embed = params.get("embed", target_params["embed"])
    states, carry, kv_caches = _head(params, embed, kv_caches, next_tokens, hidden, inputs, e, cfg, backend, mesh)
    return states[draft_index], carry[draft_index], kv_caches


def _prefill(params, target_params, kv_caches, hidden, packed, last_sampled, next_tokens, valid, draft_index, *,
             e: EagleConfig, cfg: ModelConfig, backend: str, mesh: Mesh | None, layout: BatchLayout):
    """`_over_step` after a step whose tokens the host has appended (`next_tokens`, `valid`
    and `draft_index` from the host)."""
    return _over_step(params, target_params, kv_caches, hidden, layout.model_inputs(packed, last_sampled), next_tokens,
                      valid, draft_index, e=e, cfg=cfg, backend=backend, mesh=mesh)


def next_tokens_on_device(layout: BatchLayout, packed, inputs: ModelInputs, sampled, accepted, chunk_next):
    """After a step whose tokens only the device knows: each token's next one [T] and
    whether it is known [T], and each row's last accepted token's index in the step [S]. A
    token's next one is the step's next input (an accepted draft, or the prompt's next
    token in the chunk); after a row's last accepted token, the token it sampled, or for a
    chunk that samples nothing `chunk_next` [S] (the prompt's next token, -1: none)."""
    t, qsl = layout.num_tokens, inputs.query_start_loc
    q = jnp.arange(t, dtype=jnp.int32)
    row = jnp.clip(jnp.searchsorted(qsl[1:], q, side="right", method="compare_all"), 0, qsl.shape[0] - 2)
    samples = layout.sampling(packed).counts_sample
    last = qsl[1:] - qsl[:-1] - 1  # each row's last token (its offset in the row), then the accepted ones'
    if layout.spec_tokens:
        last = last - layout.drafts(packed)[1] + accepted
    offset, end = q - qsl[row], jnp.where(samples, sampled, chunk_next)
    before = offset < last[row]
    next_tokens = jnp.where(before, inputs.input_ids[jnp.minimum(q + 1, t - 1)], end[row])
    valid = (q < qsl[-1]) & (before | ((offset == last[row]) & (samples | (chunk_next >= 0))[row]))
    return next_tokens, valid, qsl[:-1] + last


def _prefill_rows(params, target_params, kv_caches, hidden, packed, last_sampled, draft_rows, sampled, accepted,
                  chunk_next, seqs, *, e: EagleConfig, cfg: ModelConfig, backend: str, mesh: Mesh | None,
                  layout: BatchLayout):
    """`_over_step` after a step with device drafts (`last_sampled`, `draft_rows`: as that
    step's forward read them; `sampled`, `accepted`: its sampler's), for the drafting rows
    `seqs` [max_num_seqs] (sequence rows of the step, then padding)."""
    inputs = layout.model_inputs(packed, last_sampled, draft_rows)
    next_tokens, valid, newest = next_tokens_on_device(layout, packed, inputs, sampled, accepted, chunk_next)
    return _over_step(params, target_params, kv_caches, hidden, inputs, next_tokens, valid, newest[seqs], e=e, cfg=cfg,
                      backend=backend, mesh=mesh)


def _decode(params, target_params, kv_caches, states, carry, positions, live, block_tables, *, e: EagleConfig,
            cfg: ModelConfig, target: ModelConfig, backend: str, mesh: Mesh | None, k: int, block_size: int,
            dynamic_loops: bool):
    """K drafts [R, K] for the first R = len(positions) rows of `_prefill`'s states: the first
    from each row's state, then one decode step a draft at `positions` [R] on (`live` rows,
    `block_tables` [R, W]); returns the drafts and the caches. (R follows the drafting
    requests, not the step's rows: the lm_head, K times a row, is most of the cost.)"""
    rows = positions.shape[0]
    tokens, carry = _drafts(params, target_params, states[:rows], target), carry[:rows]
    embed, drafts = params.get("embed", target_params["embed"]), [tokens]
    for step in range(k - 1):  # a draft at a time, each at the position after the last
        inputs = decode_inputs(tokens, positions + step, live, block_tables, block_size=block_size, backend=backend,
                               dynamic_loops=dynamic_loops)
        states, carry, kv_caches = _head(params, embed, kv_caches, tokens, carry, inputs, e, cfg, backend, mesh)
        tokens = _drafts(params, target_params, states, target)
        drafts.append(tokens)
    return jnp.stack(drafts, axis=1), kv_caches


def _decode_rows(params, target_params, kv_caches, states, carry, rows, live, block_tables, draft_rows, **kw):
    """`_decode` with device drafts: each of the persistent `rows`' newest position from
    `draft_rows` (column 1), its drafts written there (columns 2..)."""
    drafts, kv_caches = _decode(params, target_params, kv_caches, states, carry, draft_rows[rows, NEWEST], live,
                                block_tables, **kw)
    return store_drafts(draft_rows, rows, live, drafts), kv_caches


def jit_eagle(e: EagleConfig, cfg: ModelConfig, target: ModelConfig, backend: str, mesh: Mesh | None, k: int,
              block_size: int, dynamic_loops: bool = False, device_drafts: bool = False):
    """The head's two executables as the runner compiles them, the head's caches donated:
    the prefill per target layout, the decode per drafting row count (and width); with
    `device_drafts`, their forms that read and write `draft_rows`."""
    caches = None if mesh is None else kv_cache_sharding(mesh)
    out = None if mesh is None else (replicated(mesh), caches)
    prefill = jax.jit(partial(_prefill_rows if device_drafts else _prefill, e=e, cfg=cfg, backend=backend, mesh=mesh),
                      static_argnames="layout", donate_argnums=(2,),
                      out_shardings=None if mesh is None else (replicated(mesh),) * 2 + (caches,),
                      compiler_options=CACHE_STEP_COMPILER_OPTIONS)
    decode = jax.jit(partial(_decode_rows if device_drafts else _decode, e=e, cfg=cfg, target=target, backend=backend,
                             mesh=mesh, k=k, block_size=block_size, dynamic_loops=dynamic_loops),
                     donate_argnums=(2, 8) if device_drafts else (2,), out_shardings=out,
                     compiler_options=CACHE_STEP_COMPILER_OPTIONS)
    return prefill, decode


class EagleHead:
    """The head's params and KV cache (the target's block count), the target step it drafts
    after, and its compiled proposer (see the module's doc)."""

    def __init__(self, config: EngineConfig, target: ModelConfig, *, mesh: Mesh | None, device, backend: str,
                 dynamic_loops: bool, num_devices: int) -> None:
        spec = config.speculative_config
        self.k, self.block_size, self.mesh, self.device = spec.num_speculative_tokens, config.block_size, mesh, device
        self.max_num_seqs = config.max_num_seqs  # (the prefill's rows of states: one per possible drafting request)
        self.eagle = load_eagle_config(spec.model, spec.method, target)
        dtype = resolve_dtype(config.dtype, target)
        self.cfg, self.params = load_eagle(spec.model, self.eagle, dtype=dtype, load_format=config.load_format,
                                           seed=config.seed, mesh=mesh, device=device)
        self.cfg = with_cache_storage(self.cfg, dtype, device.platform)
        self.kv_spec = KVCacheSpec(self.cfg, config.block_size, dtype, num_devices)
        # Async scheduling: the drafts stay on the device (`propose_rows`).
        self.device_drafts = config.async_scheduling
        self._prefill, self._decode = jit_eagle(self.eagle, self.cfg, target, backend, mesh, self.k,
                                                config.block_size, dynamic_loops, self.device_drafts)
        self.kv_caches = None
        self.step = None  # (packed, layout, hidden) of the target step the next proposal follows

    @property
    def aux_layers(self) -> tuple[int, ...]:
        return self.eagle.aux_layers

    def allocate(self, num_blocks: int) -> None:
        """A zeroed cache of the target's block count (after a failed step, too)."""
        self.kv_caches = allocate_kv_caches(self.cfg, num_blocks, self.block_size, self.kv_spec.dtype, self.mesh,
                                            self.device)
        self.step = None

    def keep(self, packed, layout: BatchLayout, hidden, aux) -> None:
        """Hold a dispatched target step's inputs and hidden states until its tokens are known."""
        self.step = (packed, layout, aux if self.eagle.aux_layers else hidden)

    def propose(self, target_params, last_sampled, next_tokens: np.ndarray, valid: np.ndarray,
                draft_index: np.ndarray, positions: np.ndarray, live: np.ndarray, block_tables: np.ndarray,
                place) -> np.ndarray:
        """Drafts [R, K] (host) after the kept step: `_prefill`, then `_decode` for R rows."""
        packed, layout, hidden = self.step
        first = [step_input(x, place) for x in (next_tokens, valid, draft_index)]
        states, carry, self.kv_caches = self._prefill(self.params, target_params, self.kv_caches, hidden, packed,
                                                      last_sampled, *first, layout=layout)
        rest = [step_input(x, place) for x in (positions, live, block_tables)]
        drafts, self.kv_caches = self._decode(self.params, target_params, self.kv_caches, states, carry, *rest)
        self.step = None
        return np.asarray(drafts)

    def propose_rows(self, target_params, last_sampled, draft_rows_before, sampled, accepted, chunk_next: np.ndarray,
                     seqs: np.ndarray, rows: np.ndarray | None, live: np.ndarray, block_tables: np.ndarray, draft_rows,
                     place):
        """Device drafts after the kept step's sampler: `_prefill_rows` (every step: the
        head's K/V of its tokens), then for the persistent `rows` (None: none drafts)
        `_decode_rows`; returns the new draft_rows."""
        packed, layout, hidden = self.step
        self.step = None
        states, carry, self.kv_caches = self._prefill(
            self.params, target_params, self.kv_caches, hidden, packed, last_sampled, draft_rows_before, sampled,
            accepted, *[step_input(x, place) for x in (chunk_next, seqs)], layout=layout)
        if rows is None:
            return draft_rows
        rest = [step_input(x, place) for x in (rows, live, block_tables)]
        draft_rows, self.kv_caches = self._decode(self.params, target_params, self.kv_caches, states, carry, *rest,
                                                  draft_rows)
        return draft_rows

    def compile_prefill(self, target_params, packed, last_sampled, layout: BatchLayout, place,
                        draft_rows=None) -> Callable[[], None]:
        """A job that compiles, without running, the prefill after a target layout; it holds
        the shapes of this head's arrays, not them (nor this head)."""
        t, s = layout.num_tokens, layout.num_rows
        width_in = (len(self.eagle.aux_layers) or 1) * self.eagle.target_hidden_size
        hidden = jax.ShapeDtypeStruct((t, width_in), self.kv_spec.dtype, sharding=place)
        prefill, params, caches = self._prefill, structs(self.params), structs(self.kv_caches)
        if self.device_drafts:  # (the sampler's tokens and accepted counts, one per row)
            per_row = jax.ShapeDtypeStruct((s,), jnp.int32, sharding=place)
            host = [step_input(x, place) for x in (np.zeros(s, np.int32), np.zeros(self.max_num_seqs, np.int32))]
            args = (draft_rows, per_row, per_row if layout.spec_tokens else None, *host)
        else:
            args = tuple(step_input(x, place) for x in (np.zeros(t, np.int32), np.zeros(t, bool),
                                                        np.zeros(self.max_num_seqs, np.int32)))
        return lambda: prefill.lower(params, target_params, caches, hidden, packed, last_sampled, *args,
                                     layout=layout).compile()

    def compile_decode(self, target_params, rows: int, width: int, place, draft_rows=None) -> Callable[[], None]:
        """A job that compiles, without running, the decode of `rows` drafting rows."""
        states = jax.ShapeDtypeStruct((self.max_num_seqs, self.eagle.model.hidden_size), self.kv_spec.dtype,
                                      sharding=place)
        host = [np.zeros(rows, np.int32), np.zeros(rows, bool), np.zeros((rows, width), np.int32)]
        # (device drafts: host[0] the persistent rows, not positions, and draft_rows after them)
        args = [step_input(x, place) for x in host] + ([draft_rows] if self.device_drafts else [])
        decode, params, caches = self._decode, structs(self.params), structs(self.kv_caches)
        return lambda: decode.lower(params, target_params, caches, states, states, *args).compile()

    def arrays(self) -> list:
        return jax.tree.leaves((self.params, self.kv_caches))

"""A draft model for speculative decoding (vLLM's "draft_model" method): a smaller model
with the target's vocabulary proposes K tokens a step, greedily, over its own paged KV cache.

The draft's cache has the target's blocks: the same block tables and slots address both.
Two executables keep it in step with the target:

- `forward`: the draft runs over every target step's batch (the same packed buffer), so its
  cache holds every token the target computed, prefix-cache hits and recomputes included;
- `propose`: after a step's tokens are known, K decode steps from each drafting request's
  newest token, unrolled in one executable (a static trip count, each step's K/V written in
  place). The argmax of each is a draft, so the drafts' distribution q is one-hot, as in
  vLLM's V1 proposers, and the rejection sampler treats them as n-gram drafts.

Under async scheduling the host does not know a step's tokens when it dispatches the next,
so `propose_rows` drafts on the device right after the step's sampler, from each row's
newest token and position there (`last_sampled`, `draft_rows`), into `draft_rows`, where
the next step reads them (`BatchLayout.model_inputs`).
"""

from __future__ import annotations

from collections.abc import Callable
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
from jaxvllm.loader import load_model, resolve_dtype
from jaxvllm.model_config import ModelConfig
from jaxvllm.models import MODELS
from jaxvllm.sharding import FlatParams, FlatTree, as_tree, kv_cache_sharding, replicated, step_input, structs


def _forward(params, kv_caches, packed, last_sampled, draft_rows=None, *, cfg: ModelConfig, backend: str,
             mesh: Mesh | None, layout: BatchLayout):
    """The draft over a target step's batch: only its K/V is kept."""
    params = as_tree(params)  # (a FlatTree: see `DraftModel.params`)
    inputs = layout.model_inputs(packed, last_sampled, draft_rows)
    return MODELS[cfg.architecture].hidden_states(params, kv_caches, inputs, cfg, backend, mesh)[1]


def decode_inputs(tokens, positions, live, block_tables, *, block_size: int, backend: str,
                  dynamic_loops: bool) -> ModelInputs:
    """A proposer's decode step: row s computes `tokens[s]` at `positions[s]` over its
    `block_tables[s]` (rows not `live`: padding, writing nothing)."""
    rows = tokens.shape[0]
    index = jnp.arange(rows, dtype=jnp.int32)
    pos = jnp.where(live, positions, 0)
    slot = jnp.where(live, block_tables[index, pos // block_size] * block_size + pos % block_size, -1)
    return ModelInputs(tokens, pos, slot, jnp.arange(rows + 1, dtype=jnp.int32), pos + 1, block_tables, index,
                       decode_only=backend == "pallas", dynamic_loops=dynamic_loops)


def _propose(params, kv_caches, tokens, positions, live, block_tables, *, cfg: ModelConfig, backend: str,
             mesh: Mesh | None, k: int, block_size: int, dynamic_loops: bool):
    """K greedy decode steps from `tokens` [S] at `positions` [S] (rows not `live`: padding,
    writing nothing); returns the drafts [S, K] and the caches."""
    params = as_tree(params)  # (a FlatTree: see `DraftModel.params`)
    model, drafts = MODELS[cfg.architecture], []
    for step in range(k):
        inputs = decode_inputs(tokens, positions + step, live, block_tables, block_size=block_size, backend=backend,
                               dynamic_loops=dynamic_loops)
        hidden, kv_caches, _ = model.hidden_states(params, kv_caches, inputs, cfg, backend, mesh)
        tokens = jnp.argmax(model.compute_logits(params, hidden, cfg), axis=-1).astype(jnp.int32)
        drafts.append(tokens)
    return jnp.stack(drafts, axis=1), kv_caches


def _propose_rows(params, kv_caches, rows, live, block_tables, last_sampled, draft_rows, *, cfg: ModelConfig,
                  backend: str, mesh: Mesh | None, k: int, block_size: int, dynamic_loops: bool):
    """After a step's sampler (device drafts): K greedy decode steps from the newest token and
    position of each persistent row in `rows` (`last_sampled`, `draft_rows` column 1; rows
    not `live`: padding), over its `block_tables` row; the drafts go to its row of
    `draft_rows` (columns 2..)."""
    drafts, kv_caches = _propose(params, kv_caches, last_sampled[rows], draft_rows[rows, NEWEST], live, block_tables,
                                 cfg=cfg, backend=backend, mesh=mesh, k=k, block_size=block_size,
                                 dynamic_loops=dynamic_loops)
    return store_drafts(draft_rows, rows, live, drafts), kv_caches


def check_draft_model(config: EngineConfig, tokenizer) -> None:
    """Refuse, before anything loads, a draft whose vocabulary or tokenizer differs from the
    target's (`tokenizer`; the draft's own is compared when its folder has one)."""
    from jaxvllm.loader import load_config

    draft = config.speculative_config.model
    target_vocab, draft_vocab = load_config(config.model).vocab_size, load_config(draft).vocab_size
    if draft_vocab != target_vocab:
        raise ValueError(f"the draft model {draft!r} has a vocabulary of {draft_vocab} tokens, the target's has "
                         f"{target_vocab}: speculative decoding needs the same vocabulary")
    if tokenizer is None or not any(Path(draft, name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        return
    from transformers import AutoTokenizer

    if AutoTokenizer.from_pretrained(draft, local_files_only=True).get_vocab() != tokenizer.get_vocab():
        raise ValueError(f"the draft model {draft!r} has a tokenizer of its own that differs from the target's: "
                         "speculative decoding needs the same tokens")


def jit_propose(cfg: ModelConfig, backend: str, mesh: Mesh | None, k: int, block_size: int,
                dynamic_loops: bool = False):
    """The proposer as the runner compiles it (per block-table width): the caches donated."""
    caches = None if mesh is None else kv_cache_sharding(mesh)
    return jax.jit(partial(_propose, cfg=cfg, backend=backend, mesh=mesh, k=k, block_size=block_size,
                           dynamic_loops=dynamic_loops),
                   donate_argnums=(1,), out_shardings=None if mesh is None else (replicated(mesh), caches),
                   compiler_options=CACHE_STEP_COMPILER_OPTIONS)


def jit_propose_rows(cfg: ModelConfig, backend: str, mesh: Mesh | None, k: int, block_size: int,
                     dynamic_loops: bool = False):
    """The device-drafts proposer as the runner compiles it (per row count and block-table
    width): the caches and draft_rows donated."""
    caches = None if mesh is None else kv_cache_sharding(mesh)
    return jax.jit(partial(_propose_rows, cfg=cfg, backend=backend, mesh=mesh, k=k, block_size=block_size,
                           dynamic_loops=dynamic_loops),
                   donate_argnums=(1, 6), out_shardings=None if mesh is None else (replicated(mesh), caches),
                   compiler_options=CACHE_STEP_COMPILER_OPTIONS)


class DraftModel:
    """The draft's params and KV cache, and its two compiled steps (see the module's doc)."""

    params = FlatParams()  # (its steps take `flat_params`, as the runner's forward)

    def __init__(self, config: EngineConfig, *, mesh: Mesh | None, device, backend: str,
                 dynamic_loops: bool, num_devices: int) -> None:
        spec = config.speculative_config
        self.k, self.block_size, self.mesh, self.device = spec.num_speculative_tokens, config.block_size, mesh, device
        self.cfg, self.params = load_model(spec.model, dtype=config.dtype, load_format=config.load_format,
                                           seed=config.seed, mesh=mesh, device=device,
                                           use_tqdm=config.use_tqdm_on_load)
        dtype = resolve_dtype(config.dtype, self.cfg)
        self.cfg = with_cache_storage(self.cfg, dtype, device.platform)
        self.kv_spec = KVCacheSpec(self.cfg, config.block_size, dtype, num_devices)
        caches = None if mesh is None else kv_cache_sharding(mesh)
        self._forward = jax.jit(partial(_forward, cfg=self.cfg, backend=backend, mesh=mesh),
                                static_argnames="layout", donate_argnums=(1,), out_shardings=caches,
                                compiler_options=CACHE_STEP_COMPILER_OPTIONS)
        self._propose = jit_propose(self.cfg, backend, mesh, self.k, config.block_size, dynamic_loops)
        self._propose_rows = jit_propose_rows(self.cfg, backend, mesh, self.k, config.block_size, dynamic_loops)
        self.kv_caches = None

    def allocate(self, num_blocks: int) -> None:
        """A zeroed cache of the target's block count (after a failed step, too)."""
        self.kv_caches = allocate_kv_caches(self.cfg, num_blocks, self.block_size, self.kv_spec.dtype, self.mesh,
                                            self.device)

    def forward(self, packed, last_sampled, layout: BatchLayout, draft_rows=None) -> None:
        """Dispatch the draft over a target step's batch."""
        self.kv_caches = self._forward(self.flat_params, self.kv_caches, packed, last_sampled, draft_rows,
                                       layout=layout)

    def propose_rows(self, rows: np.ndarray, live: np.ndarray, block_tables: np.ndarray, last_sampled, draft_rows,
                     place):
        """Dispatch device drafts after a step's sampler (see `_propose_rows`); the new draft_rows."""
        args = [step_input(x, place) for x in (rows, live, block_tables)]
        draft_rows, self.kv_caches = self._propose_rows(self.flat_params, self.kv_caches, *args, last_sampled,
                                                        draft_rows)
        return draft_rows

    def propose(self, tokens: np.ndarray, positions: np.ndarray, live: np.ndarray, block_tables: np.ndarray,
                place) -> np.ndarray:
        """Drafts [S, K] (host) for the `live` rows' newest tokens at their positions."""
        args = [step_input(x, place) for x in (tokens, positions, live, block_tables)]
        drafts, self.kv_caches = self._propose(self.flat_params, self.kv_caches, *args)
        return np.asarray(drafts)

    def compile_forward(self, packed, last_sampled, layout: BatchLayout, draft_rows=None) -> Callable[[], None]:
        """A job that compiles, without running, the draft's forward over a target layout;
        it holds the shapes of this model's arrays, not them (nor this model)."""
        forward, params, caches = self._forward, FlatTree.of(structs(self.params)), structs(self.kv_caches)
        return lambda: forward.lower(params, caches, packed, last_sampled, draft_rows, layout=layout).compile()

    def compile_propose(self, rows: int, width: int, place, last_sampled=None, draft_rows=None) -> Callable[[], None]:
        """A job that compiles, without running, the proposer of a row count and block-table
        width (with `draft_rows`: the device-drafts one), on host inputs placed as a run
        places them."""
        params, caches = FlatTree.of(structs(self.params)), structs(self.kv_caches)
        ints, live, tables = np.zeros(rows, np.int32), np.zeros(rows, bool), np.zeros((rows, width), np.int32)
        if draft_rows is not None:
            propose_rows, args = self._propose_rows, [step_input(x, place) for x in (ints, live, tables)]
            return lambda: propose_rows.lower(params, caches, *args, last_sampled, draft_rows).compile()
        propose, args = self._propose, [step_input(x, place) for x in (ints, ints, live, tables)]
        return lambda: propose.lower(params, caches, *args).compile()

    def arrays(self) -> list:
        return jax.tree.leaves((self.params, self.kv_caches))

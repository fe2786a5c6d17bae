"""Runs the model: owns params, the device KV cache and the device sampler state, and
dispatches each step's jitted functions without waiting for them.

Per step: one host-to-device transfer (the packed batch `BatchBuilder` built), then the
model forward (compiled per token bucket and block-table width), the sampler (compiled
per row count and `SamplerFeatures`), and prompt logprobs only when a row asks. Nothing
in them branches on device data. `execute` returns a `PendingStep`; the host reads its
tokens when it needs them (after dispatching the next step, under async scheduling).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cached_property, partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, SingleDeviceSharding

from jaxvllm.batch_builder import BatchBuilder, HostBatch, default_buckets, request_features
from jaxvllm.config import ATTENTION_BACKENDS, MODEL_SPECULATIVE_METHODS, EngineConfig
from jaxvllm.input_batch import DRAFTS, NARROW_WIDTH, NEWEST, REJECTED, SMALLEST_WIDTH, BatchLayout
from jaxvllm.interrupts import defer_interrupts
from jaxvllm.kv_cache import (
    CACHE_STEP_COMPILER_OPTIONS,
    KVCacheSpec,
    allocate_kv_caches,
    kv_cache_scales,
    kv_cache_specs,
    num_kv_blocks,
    resolve_kv_cache_dtype,
    with_cache_storage,
)
from jaxvllm.loader import JNP_DTYPES, load_config, load_model, resolve_dtype
from jaxvllm.lora.manager import LoRAManager
from jaxvllm.model_config import ModelConfig, default_sampling_fields, read_generation_config
from jaxvllm.models import MODELS
from jaxvllm.models.common import logits_params
from jaxvllm.request import Request, ScheduledBatch, ScheduledRequest
from jaxvllm.sampling_params import SamplingParams
from jaxvllm.sampler import (COMMON_FEATURES, Logprobs, SamplerFeatures, SamplerState, compute_logprobs, init_state,
                             sample, state_row, write_state_row)
from jaxvllm.sharding import (FlatParams, FlatTree, as_tree, device_group, kv_cache_sharding, kv_repeats, make_mesh,
                              put, replicated, step_input, structs, to_host)
from jaxvllm.spec_decode.draft_model import DraftModel
from jaxvllm.spec_decode.eagle import EagleHead
from jaxvllm.spec_decode.rejection_sampler import sample_with_drafts
from jaxvllm.utils.compile_jobs import CompileJobs

logger = logging.getLogger(__name__)


# Prompt logprobs: the rows asked for, gathered this many at a time (one dispatch each):
# each compiled variant is per token bucket and width, not per row count.
PROMPT_LOGPROBS_CHUNK = 128
# Compiles the warm-up runs at once: one per core, a few at most.
COMPILE_THREADS = max(2, min(8, os.cpu_count() or 1))


@dataclass
class RunnerOutput:
    """What one step hands back to the host (numpy, rows = scheduled requests)."""

    sampled: np.ndarray  # [n] int32 (rows that do not sample hold junk)
    logprobs: Logprobs | None  # numpy fields, [n] rows; only when a row asked
    prompt_logprobs: Logprobs | None  # numpy fields, one row per `prompt_positions` entry
    prompt_positions: list[tuple[int, int]]  # (scheduled index, prompt position scored)
    num_accepted: np.ndarray | None = None  # [n] drafts each row accepted, in a step that verified drafts
    draft_ids: np.ndarray | None = None  # [n, K] the drafts each row verified (device drafts: unknown before)
    # There: each row's first logits row; `logprobs` then has a row per logits row, row
    # logits_start[i] + j that of row i's j-th new token.
    logits_start: np.ndarray | None = None


@dataclass
class PendingStep:
    """A dispatched step: device arrays not yet read. `result()` waits for the device."""

    batch: HostBatch
    sampled: jax.Array | None
    logprobs: Logprobs | None
    prompt_logprobs: list[Logprobs]  # per chunk of the batch's prompt rows
    accepted: jax.Array | None = None  # a speculative step's accepted drafts per row
    drafts: jax.Array | None = None  # and the drafts it verified [S, K]
    proposes: bool = False  # device drafts: the drafter drafts after its sampler
    # Until a constrained step is sampled: the forward's logits and sampling prefix.
    logits: jax.Array | None = None
    sampling_rows: jax.Array | None = None

    @property
    def awaits_bitmask(self) -> bool:
        return self.logits is not None

    def result(self) -> RunnerOutput:
        if self.awaits_bitmask:
            raise RuntimeError("a structured-output step is read before it was sampled (ModelRunner.sample)")
        n, b = self.batch.num_scheduled, self.batch
        spec = self.accepted is not None
        rows = b.layout.num_logits if spec else n
        # Every array the step returns, copied at once (one blocking read each was a device
        # round trip each on a GPU: up to 7 a step).
        sampled, logprobs, prompt_logprobs, accepted, drafts = to_host(
            (self.sampled, self.logprobs, self.prompt_logprobs, self.accepted, self.drafts))
        prompt = None
        if prompt_logprobs:  # the chunks' rows in order, less the last chunk's padding
            prompt = jax.tree.map(lambda *chunks: np.concatenate(chunks)[: len(b.prompt_rows)], *prompt_logprobs)
        return RunnerOutput(
            sampled=sampled[:n] if sampled is not None else np.zeros(n, np.int32),
            logprobs=jax.tree.map(lambda x: x[:rows], logprobs) if logprobs is not None else None,
            prompt_logprobs=prompt,
            prompt_positions=b.prompt_positions,
            num_accepted=accepted[:n] if spec else None,
            draft_ids=drafts[:n] if spec else None,
            logits_start=b.layout.views(b.packed)["logits_start"][:n].copy() if spec else None,
        )


def _forward(params, kv_caches, packed, last_sampled, lora=None, draft_rows=None, *, cfg: ModelConfig, backend: str,
             mesh: Mesh | None, aux_layers: tuple[int, ...], layout: BatchLayout):
    """The model on one step's batch: float32 logits of the sampling rows, every token's
    final hidden state (for prompt logprobs and EAGLE), the residual streams entering
    `aux_layers` side by side [T, n * hidden] (EAGLE-3's input; None without), the batch's
    sampling prefix (for the sampler, which then compiles per row count only), and the
    updated caches. Logits of a vocabulary-split lm_head are gathered: the sampler reads
    whole rows. `lora`: the LoRA slots' stacks, read in a layout with adapters (else None);
    `draft_rows`: the device drafts, in a layout that has them (`BatchLayout.model_inputs`).
    `params` may come as a `FlatTree` (the runner's steps: a cheaper dispatch)."""
    model = MODELS[cfg.architecture]
    params = as_tree(params)
    inputs = layout.model_inputs(packed, last_sampled, draft_rows)
    if layout.lora:
        params = {**params, "lora": lora}
    hidden, kv_caches, aux = model.hidden_states(params, kv_caches, inputs, cfg, backend, mesh, aux_layers)
    logits = model.compute_logits(params, hidden[inputs.logits_indices], cfg)
    if mesh is not None:
        logits = jax.lax.with_sharding_constraint(logits, replicated(mesh))
    aux = jnp.concatenate(aux, axis=-1) if aux else None
    return logits, hidden, aux, packed[: layout.sampling_size], kv_caches


def _sample(sampling_rows, logits, last_sampled, state, bitmask, draft_rows=None, *, num_rows: int,
            features: SamplerFeatures, logprobs_mode: str, spec_tokens: int = 0, device_drafts: bool = False):
    """Sample every row (`sampling_rows`: the packed batch's sampling prefix; `bitmask`: the
    structured-output masks, or None); record each sampling row's token at its persistent
    row of `last_sampled`, where the next step's decode inputs are read from. With
    `spec_tokens` K, rows verify their drafts first (`logits`: one row per verified token)
    and the accepted counts and the drafts verified come back too (else None). With device
    drafts, a `shifted` row's output index loses what its step before rejected, device
    drafts are read from `draft_rows`, and each sampling row's rejected count and newest
    position are written there for the next step."""
    layout = BatchLayout.rows_only(num_rows, spec_tokens, device_drafts)
    t = layout.sampling(sampling_rows)
    accepted = drafts = None
    if device_drafts:
        shift = layout.rejected_before(sampling_rows, draft_rows)
        t = dataclasses.replace(t, output_index=t.output_index - shift)
    if spec_tokens:
        drafts, num_drafts, logits_start = layout.drafts(sampling_rows)
        if device_drafts:  # (-1 on the host: the row's device draft)
            drafts = jnp.where(drafts < 0, draft_rows[t.slot, DRAFTS:], drafts)
        sampled, accepted, logprobs, state = sample_with_drafts(logits, t, state, features, drafts, num_drafts,
                                                                logits_start, logprobs_mode, bitmask)
    else:
        sampled, logprobs, state = sample(logits, t, state, features, logprobs_mode, bitmask)
    rows = jnp.where(t.counts_sample, t.slot, last_sampled.shape[0])  # other rows: dropped
    if device_drafts:
        rejected = num_drafts - accepted if spec_tokens else jnp.zeros_like(shift)
        draft_rows = draft_rows.at[rows, REJECTED].set(rejected, mode="drop")
        draft_rows = draft_rows.at[rows, NEWEST].set(layout.next_positions(sampling_rows) - shift - rejected,
                                                     mode="drop")
    return sampled, accepted, drafts, logprobs, last_sampled.at[rows].set(sampled, mode="drop"), state, draft_rows


def _prompt_logprobs(params, hidden, rows, *, cfg: ModelConfig, width: int) -> Logprobs:
    """Logprobs of prompt tokens `rows[1]` at the token rows `rows[0]` of `hidden` (int32
    [2, chunk]), with the top `width`: only the rows asked for meet the lm_head. (Always
    logprobs of the model's logits, whatever the logprobs mode, as vLLM.) `params`: the
    model's `logits_params`."""
    logits = MODELS[cfg.architecture].compute_logits(params, hidden[rows[0]], cfg)
    return compute_logprobs(logits, rows[1], width)


@dataclass
class StepLowering:
    """Compiles the runner's steps ahead of their first call, from the shapes and placements
    of what the steps take (never an array: one a step donated would be gone) and without
    a reference to the runner (a warm-up job left for later must not keep it alive). Each
    `lower(...).compile()` fills the cache that the runner's call then finds."""

    forward_fn: Callable
    sampler_fn: Callable
    prompt_logprobs_fn: Callable
    replicated: Any
    cfg: ModelConfig
    dtype: Any
    params: Any
    kv_caches: Any
    last_sampled: Any
    draft_rows: Any
    sampler_state: Any
    lora: Any
    forward_shapes: set  # (the runner's record of what compiled)
    sampler_variants: set

    def forward(self, layout: BatchLayout, packed: np.ndarray) -> None:
        self.forward_shapes.add(layout)
        self.forward_fn.lower(FlatTree.of(self.params), self.kv_caches, step_input(packed, self.replicated),
                              self.last_sampled, self.lora if layout.lora else None, self.draft_rows,
                              layout=layout).compile()

    def sampler(self, layout: BatchLayout, features: SamplerFeatures) -> None:
        """The sampler of a layout's rows (and drafts), on the shapes and placement the forward hands it."""
        on_device = partial(jax.ShapeDtypeStruct, sharding=self.replicated)
        sampling_rows = on_device((layout.sampling_size,), jnp.int32)
        logits = on_device((layout.num_logits, self.cfg.vocab_size), jnp.float32)
        state = self.sampler_state if features.state else None
        self.sampler_variants.add((layout.num_rows, layout.num_logits, layout.spec_tokens, features))
        self.sampler_fn.lower(sampling_rows, logits, self.last_sampled, state, None, self.draft_rows,
                              num_rows=layout.num_rows, features=features, spec_tokens=layout.spec_tokens,
                              device_drafts=layout.device_drafts).compile()

    def prompt_logprobs(self, bucket: int, width: int) -> None:
        """Prompt logprobs of a bucket's hidden states: warmed for width 0 (each token's own
        logprob and rank, what loglikelihood scoring reads), the others compile when first used."""
        hidden = jax.ShapeDtypeStruct((bucket, self.cfg.hidden_size), self.dtype, sharding=self.replicated)
        rows = step_input(np.zeros((2, min(PROMPT_LOGPROBS_CHUNK, bucket)), np.int32), self.replicated)
        self.prompt_logprobs_fn.lower(logits_params(self.params), hidden, rows, width=width).compile()


def jit_forward(cfg: ModelConfig, backend: str, mesh: Mesh | None = None, aux_layers: tuple[int, ...] = ()):
    """The model step as the runner compiles it, per layout: the KV caches donated. With a
    mesh, the model is split over its devices (tensor parallelism); None: one device.
    `aux_layers`: the layers whose inputs the step also returns (an EAGLE-3 head's)."""
    # Outputs placed as the inputs are (else a donated cache could come back placed otherwise,
    # and the next step would compile anew); an fp8 cache's scales split on KV heads with it.
    caches = None if mesh is None else kv_cache_sharding(mesh)
    out = None if mesh is None else (replicated(mesh),) * 4 + (caches,)
    return jax.jit(partial(_forward, cfg=cfg, backend=backend, mesh=mesh, aux_layers=tuple(aux_layers)),
                   static_argnames="layout", donate_argnums=(1,), out_shardings=out,
                   compiler_options=CACHE_STEP_COMPILER_OPTIONS)


def jit_sampler(logprobs_mode: str = "raw_logprobs", mesh: Mesh | None = None, keep_rows: bool = False):
    """The sampler as the runner compiles it, per (row count, features): the last sampled
    tokens, the sampler state and the device drafts donated (`keep_rows`: the state only).
    With a mesh it runs whole on every device."""
    # partial: a function of its own, so that each runner counts only its own variants
    return jax.jit(partial(_sample, logprobs_mode=logprobs_mode),
                   static_argnames=("num_rows", "features", "spec_tokens", "device_drafts"),
                   donate_argnums=(3,) if keep_rows else (2, 3, 5),
                   out_shardings=None if mesh is None else replicated(mesh))


def jit_prompt_logprobs(cfg: ModelConfig):
    return jax.jit(partial(_prompt_logprobs, cfg=cfg), static_argnames="width")


def resolve_backend(backend: str, softcapped: bool = False) -> str:
    """Resolve "auto": the Pallas kernels on a GPU, the jnp reference elsewhere (on CPU the
    kernels run in interpret mode only, for tests) and for attention soft-capping, which
    the kernels lack. "pallas" is allowed anywhere."""
    if backend not in ("auto", *ATTENTION_BACKENDS):
        raise ValueError(f"attention_backend {backend!r} is not available; choose from 'auto', {ATTENTION_BACKENDS}")
    if backend != "auto":
        return backend
    gpu = jax.default_backend() in ("gpu", "cuda", "rocm")
    if gpu and softcapped:
        logger.info("attention soft-capping: the reference attention backend (the kernels have none)")
    return "pallas" if gpu and not softcapped else "reference"


# Params that are not weights: kept through sleep(level=2), since no update refills them
# (`models.common.stack_layers`' row indices).
KEPT_ASLEEP = ("layer_rows",)


class ModelRunner:
    params = FlatParams()  # the model's weights (None while asleep), and `flat_params`: the forward's

    def __init__(self, config: EngineConfig) -> None:
        try:
            self._set_up(config)
        except BaseException:
            self._free_partial()  # (now, not when the traceback goes: a notebook keeps the last one)
            raise

    def _free_partial(self) -> None:
        """After a failed `__init__`: delete the device arrays it made (the weights, caches)."""
        compiles = self.__dict__.get("compiles")
        if compiles is not None:
            compiles.cancel()
        allocation = self.__dict__.get("_kv_allocation")
        if allocation is not None and allocation.exception() is None:  # (waits for it: a zero-fill at most)
            self.kv_caches = allocation.result()
        drafter = self.__dict__.get("drafter")
        self._delete_arrays([self.__dict__.get(name) for name in ("_params", "kv_caches", "sampler_state",
                                                                  "last_sampled", "draft_rows")],
                            drafter.arrays() if drafter is not None else [])
        self._params = self.flat_params = None

    def _delete_arrays(self, *trees) -> None:
        """Delete the device arrays in `trees` now (even if something else still refers to
        them), but not those update_weights took as they were (a trainer's)."""
        given = self.__dict__.get("_given", ())
        for array in jax.tree.leaves(trees):
            if isinstance(array, jax.Array) and not array.is_deleted() and id(array) not in given:
                array.delete()

    def _set_up(self, config: EngineConfig) -> None:
        self.config = c = config
        # This replica's devices; tensor parallelism: a mesh over them (None: one device, nothing split).
        self.devices = device_group(c.tensor_parallel_size, c.data_parallel_rank, c.data_parallel_size)
        self.mesh = make_mesh(self.devices) if len(self.devices) > 1 else None
        # (the config the split model runs with: KV heads repeated when fewer than the devices,
        # experts split whole under expert parallelism)
        start = time.perf_counter()
        self.cfg, self.params = self._load()
        self.load_seconds = time.perf_counter() - start
        self.dtype = resolve_dtype(c.dtype, self.cfg)
        self.cfg = dataclasses.replace(self.cfg, max_model_len=self.cfg.checked_max_model_len(c.max_model_len))
        spec = c.speculative_config
        # vLLM's draft max_model_len: a drafter drafts only where the K draft positions lie
        # below it (the n-gram proposer, with no model, goes by the engine's).
        # (at most the engine's: LLMEngine refuses more before any weight loads)
        self.draft_max_model_len = self.max_model_len
        if spec is not None and spec.max_model_len is not None and spec.method in MODEL_SPECULATIVE_METHODS:
            self.draft_max_model_len = min(spec.max_model_len, self.max_model_len)
        self.backend = resolve_backend(c.attention_backend, softcapped=self.cfg.attn_logit_softcapping is not None)
        # Speculative decoding's K: steps with drafts take layouts and samplers with room for K a row.
        self.spec_tokens = c.speculative_config.num_speculative_tokens if c.speculative_config else 0
        # Async scheduling with a draft model or EAGLE head: the drafts stay on the device (`draft_rows`).
        self.device_drafts = bool(c.async_scheduling and c.speculative_config is not None
                                  and c.speculative_config.method in MODEL_SPECULATIVE_METHODS)
        cpu = self.devices[0].platform == "cpu"
        # CPU steps may loop a batch-dependent number of times (`ModelInputs.dynamic_loops`).
        dynamic_loops = self.backend == "reference" and cpu
        self.builder = BatchBuilder(
            max_num_seqs=c.max_num_seqs, max_model_len=self.max_model_len, block_size=c.block_size,
            buckets=c.token_buckets or default_buckets(c.max_num_batched_tokens, cpu=cpu),
            vocab_size=self.cfg.vocab_size,
            max_logprobs=c.max_logprobs, decode_only=self.backend == "pallas",
            smallest_width=NARROW_WIDTH if self.backend == "reference" and not dynamic_loops else SMALLEST_WIDTH,
            dynamic_loops=dynamic_loops, spec_tokens=self.spec_tokens, device_drafts=self.device_drafts,
            draft_max_model_len=self.draft_max_model_len,
            lora=c.enable_lora,
            # (as the MoE experts: the Pallas grouped matmul with the Pallas kernels, on one device)
            lora_kernel=self.backend == "pallas" and self.mesh is None,
        )
        self.lora = None  # the LoRA adapters: read ones and the device slots
        if c.enable_lora:
            self.lora = LoRAManager(MODELS[self.cfg.architecture].param_specs(self.cfg), self.cfg,
                                    max_loras=c.max_loras, max_rank=c.max_lora_rank, max_cpu_loras=c.max_cpu_loras,
                                    dtype=self.dtype if c.lora_dtype == "auto" else JNP_DTYPES[c.lora_dtype],
                                    mesh=self.mesh, device=self.devices[0],
                                    kv_repeats=kv_repeats(self.checkpoint_config, self.cfg))
        # On a CPU a padding token costs what a real one does: the scheduler fills buckets to their edge.
        self.fill_buckets = tuple(self.builder.buckets) if cpu else None
        # The KV cache's element type, and for an fp8 cache its (k_scale, v_scale) per layer and KV head.
        cache_dtype = resolve_kv_cache_dtype(c.kv_cache_dtype, self.dtype)
        self.cfg = with_cache_storage(self.cfg, cache_dtype, self.devices[0].platform)
        self.kv_spec = KVCacheSpec(self.cfg, c.block_size, cache_dtype, len(self.devices))
        self.kv_scales = kv_cache_scales(c, self.cfg)
        # Speculative decoding's draft model or EAGLE head: its own params, and a cache with the
        # target's blocks (`drafter`: whichever there is).
        self.draft = self.eagle = None
        method = c.speculative_config.method if c.speculative_config is not None else None
        where = dict(mesh=self.mesh, device=self.devices[0], backend=self.backend, dynamic_loops=dynamic_loops,
                     num_devices=len(self.devices))
        if method == "draft_model":
            self.draft = DraftModel(c, **where)
        elif method in ("eagle", "eagle3"):
            self.eagle = EagleHead(c, self.cfg, **where)
        self.drafter = self.draft or self.eagle
        aux_layers = self.eagle.aux_layers if self.eagle is not None else ()
        self._forward = jit_forward(self.cfg, self.backend, self.mesh, aux_layers=aux_layers)
        # (an EAGLE head's prefill reads the step's inputs after its sampler: as its forward did)
        self._sampler = jit_sampler(c.logprobs_mode, self.mesh, keep_rows=self.device_drafts and self.eagle is not None)
        self._prompt_logprobs = jit_prompt_logprobs(self.cfg)
        self._write_row = jax.jit(write_state_row, donate_argnums=(0,))
        self._weight_index = None  # (HF name -> its places in the params, KV repeats): update_weights'
        self._asleep: set[str] = set()
        self._host_kv_scales = None  # an fp8 cache's scales while it sleeps (calculated once, as vLLM's)
        self._host_params = None  # the weights' host copy while they sleep (level 2: what no update refills)
        self._given: set[int] = set()  # ids of arrays update_weights took as they were: the caller's, not deleted
        # The forward layouts and (row count, logits rows, drafts, features) sampler variants compiled so far.
        self._forward_shapes: set[BatchLayout] = set()
        self._sampler_variants: set[tuple[int, int, int, SamplerFeatures]] = set()
        self.compiles = CompileJobs(COMPILE_THREADS)  # (the warm-up's, and those it leaves for later)
        weakref.finalize(self, self.compiles.cancel, False)  # (a dropped engine's are not compiled)
        self.sampler_state: SamplerState = self._new_sampler_state()
        # Each persistent row's last sampled token: where decode inputs come from under async scheduling.
        self.last_sampled = self._new_last_sampled()
        # Device drafts: each persistent row's rejected count, newest position and K drafts.
        self.draft_rows = self._new_draft_rows()
        start = time.perf_counter()
        self.num_blocks = num_kv_blocks(c, self.kv_spec, self.devices, self.max_model_len, self._profile,
                                        self._profile_step_bytes)
        if self.drafter is not None and c.num_gpu_blocks_override is None:  # the draft's cache shares the room
            target, draft = self.kv_spec.bytes_per_block, self.drafter.kv_spec.bytes_per_block
            self.num_blocks = self.num_blocks * target // (target + draft)
            if self.num_blocks < self.builder.max_blocks_per_seq:
                raise ValueError(f"with the draft model's KV cache, only {self.num_blocks} KV blocks fit; one "
                                 f"sequence of max_model_len={self.max_model_len} needs {self.builder.max_blocks_per_seq}")
        if self.drafter is not None:
            self.drafter.allocate(self.num_blocks)
        self.profile_seconds = time.perf_counter() - start
        logger.info("KV cache: %d blocks x %d tokens = %d tokens, %.3f GiB (%s)", self.num_blocks, c.block_size,
                    self.num_blocks * c.block_size, self.num_blocks * self.kv_spec.bytes_per_block / 2**30,
                    self.kv_spec.dtype_name)
        logger.info("Maximum concurrency for %s tokens per request: %.2fx", f"{self.max_model_len:,}",
                    self.num_blocks / self.builder.max_blocks_per_seq)  # (vLLM's line)
        self.warmup_seconds = 0.0
        # On a CPU the cache's zero-fill (page faults: up to seconds for gigabytes) runs beside
        # the warm-up, which compiles against the caches' shapes; a GPU allocates first, so
        # that the compiles' autotuning cannot take the cache's room.
        # (The future is the runner's until the caches are: a failure or Ctrl-C while they are
        # made leaves `_free_partial` the caches to delete, not a traceback to keep them.)
        with ThreadPoolExecutor(1) as pool:
            with defer_interrupts():  # (held until the runner holds the future)
                self._kv_allocation = pool.submit(self._allocate_kv_caches, self.num_blocks)
            self.kv_caches = self._kv_cache_specs(self.num_blocks) if cpu else self._kv_allocation.result()
            if not c.enforce_eager:
                self.warmup()
            self.kv_caches = self._kv_allocation.result()
            self._kv_allocation = None
        logger.info("start-up: weights loaded in %.1f s, KV cache sized in %.1f s, warm-up compiled in %.1f s",
                    self.load_seconds, self.profile_seconds, self.warmup_seconds)

    # -- KV cache ----------------------------------------------------------------------

    @property
    def max_model_len(self) -> int:
        return self.cfg.max_model_len

    def _allocate_kv_caches(self, num_blocks: int):
        return allocate_kv_caches(self.cfg, num_blocks, self.kv_spec.block_size, self.kv_spec.dtype, self.mesh,
                                  self.devices[0], self.kv_scales, self.config.calculate_kv_scales)

    def _kv_cache_specs(self, num_blocks: int):
        return kv_cache_specs(self.cfg, num_blocks, self.kv_spec.block_size, self.kv_spec.dtype, self.mesh,
                              self.devices[0], self.kv_scales is not None, self.config.calculate_kv_scales)

    def _profile_batch(self) -> HostBatch:
        """The largest step: the memory profile runs it."""
        b = self.builder
        return b.padding_batch(b.buckets[-1], b.widths[-1], COMMON_FEATURES[-1])

    def _profile(self) -> None:
        """Run the largest step once, on a cache of one sequence's blocks."""
        probe = self._allocate_kv_caches(self.builder.max_blocks_per_seq)
        self.launch(self._profile_batch(), probe)
        jax.block_until_ready((self.last_sampled, self.sampler_state))

    def _profile_step_bytes(self) -> int:
        """Device memory the largest step allocates beyond its inputs (per device): the
        forward's temporaries and outputs, from XLA's analysis of the compiled step."""
        batch = self._profile_batch()
        probe = self._kv_cache_specs(self.builder.max_blocks_per_seq)
        packed = step_input(batch.packed, self._replicated)
        compiled = self._forward.lower(self.flat_params, probe, packed, self.last_sampled,
                                       self._lora_stacks(batch.layout), self.draft_rows, layout=batch.layout).compile()
        m = compiled.memory_analysis()
        return int(m.temp_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes)

    def kv_cache_per_device(self) -> list[dict]:
        per_device = self.kv_spec.bytes_per_block // len(self.devices)
        return [{"device": str(d), "num_blocks": self.num_blocks, "bytes": self.num_blocks * per_device}
                for d in self.devices]

    # -- compile -----------------------------------------------------------------------

    def warmup(self) -> None:
        """Compile, without running, the forward of every token bucket and block-table width
        and the common sampler variants of every row count (greedy, temperature,
        temperature + top-p, temperature + top-k/top-p, and that of `generate`'s default
        params), so that nothing compiles on first use; rarer sampler variants compile when
        first used. Lowering holds the GIL but XLA's compiles do not,
        so they run on threads. Each `lower(...).compile()` fills the same cache a call
        would, and the persistent compilation cache serves a second process.

        On a CPU the engine is ready once the smallest bucket's step (and a drafter's after
        it) is compiled: the other buckets compile after, on the same threads, smallest
        first, and a step that needs one not yet compiled waits for it, or compiles it
        itself if no thread has begun it (`CompileJobs`). A GPU compiles everything first
        (its autotuning times kernels, which steps running beside it would disturb)."""
        b = self.builder
        spec = (False, True) if self.spec_tokens else (False,)  # (with drafts: every bucket but 1-token ones)
        shapes = [(bucket, w, False, s) for bucket in b.buckets for w in b.widths for s in spec if bucket > 1 or not s]
        shapes += [(bucket, w, True, False) for bucket in b.decode_only_buckets for w in b.widths]
        batches = [b.padding_batch(bucket, width, None, decode_only, s) for bucket, width, decode_only, s in shapes]
        # LoRA: each shape also with adapters (a step without any keeps the variant above)
        lora_batches = [b.padding_batch(bucket, width, None, decode_only, s, lora=True)
                        for bucket, width, decode_only, s in shapes] if self.lora is not None else []
        # (what the jobs compile against: shapes and placements, and no reference to this runner,
        # which compiles left for later must not keep alive)
        lowering = StepLowering(self._forward, self._sampler, self._prompt_logprobs, self._replicated, self.cfg,
                                self.dtype, *structs((self.params, self.kv_caches, self.last_sampled,
                                                       self.draft_rows, self.sampler_state,
                                                       self.lora.stacks if self.lora is not None else None)),
                                self._forward_shapes, self._sampler_variants)
        later_buckets = [] if self.devices[0].platform != "cpu" else b.buckets[1:]
        later: dict[int, list] = {bucket: [] for bucket in later_buckets}
        now = []
        jobs_of = lambda bucket: later.get(bucket, now)  # noqa: E731  (a bucket's jobs: before ready or after)
        samplers = set()  # (one sampler per row count and, with drafts, logits rows: verifying or not)
        variants = self._warmed_sampler_variants()
        for batch in sorted(batches + lora_batches, key=lambda batch: batch.layout.num_tokens):
            layout, jobs = batch.layout, jobs_of(batch.layout.num_tokens)
            jobs.append((("forward", layout), partial(lowering.forward, layout, batch.packed)))
            sampler = (layout.num_rows, layout.num_logits, layout.spec_tokens)
            if sampler not in samplers and not layout.lora:
                samplers.add(sampler)
                jobs += [(("sampler", *sampler, features),
                          partial(lowering.sampler, layout, features)) for features in variants]
            # A drafter runs the base model (no adapter, as in vLLM) after each target layout, LoRA's too.
            packed = step_input(batch.packed, self._replicated)
            if self.draft is not None:
                jobs.append((("draft_forward", layout), self.draft.compile_forward(
                    packed, lowering.last_sampled, layout, lowering.draft_rows)))
            if self.eagle is not None:
                jobs.append((("eagle_prefill", layout), self.eagle.compile_prefill(
                    logits_params(lowering.params), packed, lowering.last_sampled, layout, self._replicated,
                    lowering.draft_rows)))
        for bucket in b.buckets:
            jobs_of(bucket).append((("prompt_logprobs", bucket, 0), partial(lowering.prompt_logprobs, bucket, 0)))
        if self.draft is not None:  # its proposer per row count and width
            for rows, bucket in {b.rows_for(bucket): bucket for bucket in reversed(b.buckets)}.items():
                jobs_of(bucket).extend((("draft_propose", rows, width), self.draft.compile_propose(
                    rows, width, self._replicated, lowering.last_sampled, lowering.draft_rows)) for width in b.widths)
        if self.eagle is not None:  # its decode per row count of drafting requests
            for rows in sorted({self._eagle_rows(n) for n in range(1, self.config.max_num_seqs + 1)}):
                job = self.eagle.compile_decode(logits_params(lowering.params), rows, b.widths[-1], self._replicated,
                                                lowering.draft_rows)
                jobs_of(b.bucket_for(min(rows, b.buckets[-1]))).append((("eagle_decode", rows), job))
        now.append((("write_row",), self._compile_write_row))
        if self.lora is not None:
            now.append((("lora_write",), self.lora.compile_write))
        ready = b.buckets[: len(b.buckets) - len(later_buckets)]
        self.compiles.run(now, [job for bucket in later_buckets for job in later[bucket]],
                          desc=f"Compiling token buckets {ready[0]}-{ready[-1]}")
        self.warmup_seconds = self.compiles.ready_seconds
        decode_only = f" (and decode-only ones of {b.decode_only_buckets})" if b.decode_only_buckets else ""
        logger.info("warm-up: compiled token buckets %s%s x %d block-table widths %s and %d sampler variants in %.1f s "
                    "(%d compilations, %d from the persistent cache)%s", ready, decode_only, len(b.widths), b.widths,
                    sum(key[0] == "sampler" for key, _ in now), self.warmup_seconds, self.compiles.counts.compilations,
                    self.compiles.counts.cache_hits,
                    f"; buckets {later_buckets} compile now, smallest first" if later_buckets else "")

    def _warmed_sampler_variants(self) -> tuple[SamplerFeatures, ...]:
        """`COMMON_FEATURES`, and the variant of `generate`'s default params if it is another
        (the checkpoint's recommended settings: Qwen2.5's repetition penalty needs the state)."""
        fields = default_sampling_fields(self.config, read_generation_config(self.config))
        try:
            request = Request("", [0], SamplingParams(**fields), max_tokens=1, vocab_size=self.cfg.vocab_size)
        except ValueError:  # (LLM.generate refuses them too, with the message)
            return COMMON_FEATURES
        default = request_features(request)
        return COMMON_FEATURES + (() if default in COMMON_FEATURES else (default,))

    def _compile_write_row(self) -> None:
        # (the row as `execute` passes it, host numpy: a device row compiled another executable)
        row = jax.tree.map(lambda x: np.zeros(x.shape[1:], x.dtype), self.sampler_state)
        self._write_row.lower(self.sampler_state, 0, row).compile()

    # -- one step ----------------------------------------------------------------------

    def _lora_stacks(self, layout: BatchLayout) -> dict | None:
        return self.lora.stacks if layout.lora else None

    def execute(self, scheduled: ScheduledBatch | list[ScheduledRequest]) -> PendingStep:
        """Build and dispatch one step; nothing here waits for the device."""
        slots = None
        if self.lora is not None:  # the step's adapters into device slots first
            requests = scheduled.requests if isinstance(scheduled, ScheduledBatch) else [s.request for s in scheduled]
            slots = self.lora.slots_for(r.lora_id for r in requests)
        batch = self.builder.prepare(scheduled, slots)
        for row, request in batch.admitted:  # their device sampler state, before the step reads it
            self.sampler_state = self._write_row(self.sampler_state, row, state_row(request, self.cfg.vocab_size))
        return self.launch(batch)

    def launch(self, batch: HostBatch, kv_caches=None) -> PendingStep:
        """Dispatch a built step: one transfer, the forward, the sampler, prompt logprobs if asked.
        (`kv_caches`: a probe cache for the memory profile instead of the engine's.) A step
        with structured-output rows is sampled later, by `sample`, with their bitmask."""
        layout = batch.layout
        packed = step_input(batch.packed, self._replicated)
        self.compiles.wait(("forward", layout))
        logits, hidden, aux, sampling_rows, caches = self._forward(
            self.flat_params, self.kv_caches if kv_caches is None else kv_caches, packed, self.last_sampled,
            self._lora_stacks(layout), self.draft_rows, layout=layout
        )
        step = PendingStep(batch, None, None, [])
        if kv_caches is None:
            self.kv_caches = caches
            self._forward_shapes.add(layout)
            if self.draft is not None:
                self.compiles.wait(("draft_forward", layout))
                self.draft.forward(packed, self.last_sampled, layout, self.draft_rows)
            if self.eagle is not None:
                self.eagle.keep(packed, layout, hidden, aux)
            step.proposes = layout.device_drafts
        chunk = min(PROMPT_LOGPROBS_CHUNK, layout.num_tokens)
        if len(batch.prompt_rows):
            self.compiles.wait(("prompt_logprobs", layout.num_tokens, batch.prompt_width))
        for start in range(0, len(batch.prompt_rows), chunk):
            part = np.stack([batch.prompt_rows[start : start + chunk], batch.prompt_targets[start : start + chunk]])
            rows = np.zeros((2, chunk), np.int32)  # (padding: row 0, token 0; dropped on the host)
            rows[:, : part.shape[1]] = part
            step.prompt_logprobs.append(self._prompt_logprobs(logits_params(self.params), hidden,
                                                              step_input(rows, self._replicated),
                                                              width=batch.prompt_width))
        if batch.features is not None:
            step.logits, step.sampling_rows = logits, sampling_rows
            if not batch.features.grammar:
                self.sample(step)
        elif step.proposes and self.eagle is not None:  # prompt chunks only, no sampler: the head's K/V
            # of them all the same (nothing sampled: zeros placed as the sampler's outputs are)
            nothing = put(np.zeros(layout.num_rows, np.int32), self.last_sampled.sharding)
            self._propose_on_device(step, self.last_sampled, self.draft_rows, nothing,
                                    nothing if layout.spec_tokens else None)
        return step

    def sample(self, step: PendingStep, bitmask: np.ndarray | None = None) -> None:
        """Dispatch a step's sampler (`bitmask`: its structured-output masks, [rows, words])."""
        features, layout = step.batch.features, step.batch.layout
        state = self.sampler_state if features.state else None
        mask = step_input(bitmask, self._replicated) if features.grammar else None
        self._sampler_variants.add((layout.num_rows, layout.num_logits, layout.spec_tokens, features))
        self.compiles.wait(("sampler", layout.num_rows, layout.num_logits, layout.spec_tokens, features))
        before = (self.last_sampled, self.draft_rows)  # (as the step's forward read them)
        step.sampled, step.accepted, step.drafts, step.logprobs, self.last_sampled, state, draft_rows = self._sampler(
            step.sampling_rows, step.logits, self.last_sampled, state, mask, self.draft_rows,
            num_rows=layout.num_rows, features=features, spec_tokens=layout.spec_tokens,
            device_drafts=layout.device_drafts,
        )
        step.logits = step.sampling_rows = None
        if features.state:
            self.sampler_state = state
        if layout.device_drafts:
            self.draft_rows = draft_rows
            if step.proposes:  # (not the memory profile's step)
                self._propose_on_device(step, *before, step.sampled, step.accepted)

    def _propose_on_device(self, step: PendingStep, last_sampled_before, draft_rows_before, sampled, accepted
                           ) -> None:
        """Device drafts after a step's sampler (`sampled`, `accepted`: its outputs), for the
        rows it marked (`HostBatch.proposing`): the draft model's K decode steps over as many
        rows as a bucket of them has (each row a padded token's cost on a CPU), at the
        narrowest block-table width that holds them; or the EAGLE head's prefill over the
        step (every step, one that samples nothing too) and its decode for those rows."""
        b, batch = self.builder, step.batch
        seqs = batch.proposing
        n = len(seqs)
        proposing = batch.layout.views(batch.packed)["slot"][seqs]  # (their persistent rows)
        if self.eagle is not None:
            rows, width = np.zeros(self._eagle_rows(n), np.int32), b.widths[-1]
        else:
            if not n:
                return
            rows, width = np.zeros(b.rows_for(b.bucket_for(n)), np.int32), None
        rows[:n] = proposing
        live = np.arange(len(rows)) < n
        tables = self._row_tables(proposing, len(rows), width)
        if self.draft is not None:
            self.compiles.wait(("draft_propose", len(rows), tables.shape[1]))
            self.draft_rows = self.draft.propose_rows(rows, live, tables, self.last_sampled, self.draft_rows,
                                                      self._replicated)
            return
        padded = np.zeros(self.config.max_num_seqs, np.int32)
        padded[:n] = seqs
        self._wait_for_eagle(batch.layout, len(rows) if n else None)
        self.draft_rows = self.eagle.propose_rows(logits_params(self.params), last_sampled_before,
                                                  draft_rows_before, sampled, accepted, batch.chunk_next,
                                                  padded, rows if n else None, live, tables, self.draft_rows,
                                                  self._replicated)

    def propose_drafts(self, request_ids: list[str], tokens: list[int], positions: list[int],
                       block_ids: list[list[int]]) -> np.ndarray:
        """The draft model's drafts [n, K] for running requests whose newest token (not yet
        computed) is `tokens[i]` at `positions[i]`; their blocks (`block_ids`) must already
        hold K more tokens from there (the engine allocates them)."""
        b = self.builder
        rows = b.rows_for(b.bucket_for(len(request_ids)))  # (a row count of the buckets')
        live = np.arange(rows) < len(request_ids)
        token, position = np.zeros(rows, np.int32), np.zeros(rows, np.int32)
        token[: len(tokens)], position[: len(positions)] = tokens, positions
        tables = self._draft_tables(request_ids, block_ids, rows)
        self.compiles.wait(("draft_propose", rows, tables.shape[1]))
        return self.draft.propose(token, position, live, tables, self._replicated)[: len(request_ids)]

    def propose_eagle(self, scheduled: ScheduledBatch, drafting: list[Request], block_ids: list[list[int]]
                      ) -> np.ndarray:
        """After the step `scheduled` (its tokens appended): the EAGLE head's K/V for each of
        its tokens whose next token is known, then drafts [n, K] for the requests
        `drafting` of that step, each from its newest token; their blocks (`block_ids`)
        must already hold K more tokens from there (the engine allocates them)."""
        layout = self.eagle.step[1]
        next_tokens, valid = np.zeros(layout.num_tokens, np.int32), np.zeros(layout.num_tokens, bool)
        starts, lens = scheduled.starts.tolist(), scheduled.num_new_tokens.tolist()
        first = np.cumsum([0] + lens[:-1]).tolist()  # each chunk's first token in the batch
        for request, start, n, q in zip(scheduled.requests, starts, lens, first):
            if not request.is_finished:
                ahead = request.token_ids[start + 1 : start + n + 1]  # (rejected drafts' positions: none)
                next_tokens[q : q + len(ahead)] = ahead
                valid[q : q + len(ahead)] = True
        at = {id(request): i for i, request in enumerate(scheduled.requests)}
        draft_index = np.zeros(self.config.max_num_seqs, np.int32)
        for j, request in enumerate(drafting):  # the newest computed position: the step's last accepted
            i = at[id(request)]
            draft_index[j] = first[i] + request.num_tokens - 2 - starts[i]
        rows = self._eagle_rows(len(drafting))
        positions = np.zeros(rows, np.int32)
        positions[: len(drafting)] = [r.num_tokens - 1 for r in drafting]
        tables = self._draft_tables([r.request_id for r in drafting], block_ids, rows, self.builder.widths[-1])
        self._wait_for_eagle(layout, rows)
        drafts = self.eagle.propose(logits_params(self.params), self.last_sampled, next_tokens, valid, draft_index,
                                    positions, np.arange(rows) < len(drafting), tables, self._replicated)
        return drafts[: len(drafting)]

    def _wait_for_eagle(self, layout: BatchLayout, rows: int | None) -> None:
        """Until the EAGLE head's prefill after `layout`, and its decode of `rows` (if any), are compiled."""
        self.compiles.wait(("eagle_prefill", layout))
        if rows is not None:
            self.compiles.wait(("eagle_decode", rows))

    def _eagle_rows(self, n: int) -> int:
        """The EAGLE decode's row count for `n` drafting requests: the next power of two (its
        lm_head runs K times a row, the main cost of a small batch's drafts on a CPU)."""
        return min(1 << max(n - 1, 0).bit_length(), self.config.max_num_seqs)

    def _draft_tables(self, request_ids: list[str], block_ids: list[list[int]], rows: int, width: int | None = None
                      ) -> np.ndarray:
        """Block tables [rows, width] of drafting requests (their rows' blocks updated first);
        `width` by default the narrowest that holds them."""
        ib = self.builder.input_batch
        for rid, blocks in zip(request_ids, block_ids):
            row = ib.row_of[rid]
            if len(blocks) != ib.num_blocks[row]:
                ib.set_blocks(row, blocks)
        return self._row_tables(np.array([ib.row_of[rid] for rid in request_ids], np.int64), rows, width)

    def _row_tables(self, rows: np.ndarray, num_rows: int, width: int | None = None) -> np.ndarray:
        """The block tables [num_rows, width] of persistent `rows` (then padding); `width` by
        default the narrowest that holds them."""
        ib = self.builder.input_batch
        width = width or self.builder.width_for(int(ib.num_blocks[rows].max(initial=1)))
        tables = np.zeros((num_rows, width), np.int32)
        tables[: len(rows)] = ib.block_table[rows, :width]
        return tables

    def release(self, request_ids) -> None:
        """Requests that left the running set (finished, aborted, preempted) give back their row."""
        self.builder.release(request_ids)

    def recover(self) -> bool:
        """After a failed step: no request keeps its row, and donated buffers that the step
        consumed without handing back are made anew. Returns whether the KV cache was (its
        contents are then gone)."""
        self.builder.release_all()
        gone = lambda tree: any(isinstance(x, jax.Array) and x.is_deleted() for x in jax.tree.leaves(tree))  # noqa: E731
        if gone(self.sampler_state):
            self.sampler_state = self._new_sampler_state()
        if gone(self.last_sampled):
            self.last_sampled = self._new_last_sampled()
        if gone(self.draft_rows):
            self.draft_rows = self._new_draft_rows()
        if self.lora is not None and gone(self.lora.stacks):
            self.lora.clear_slots()
        if self.eagle is not None:
            self.eagle.step = None
        if gone(self.kv_caches) or (self.drafter is not None and gone(self.drafter.kv_caches)):
            self.kv_caches = self._allocate_kv_caches(self.num_blocks)
            if self.drafter is not None:
                self.drafter.allocate(self.num_blocks)
            return True
        return False

    def _new_sampler_state(self) -> SamplerState:
        """Per-row sampler state, whole on every device of the mesh (the sampler is replicated)."""
        return jax.tree.map(lambda x: put(x, self._replicated), init_state(self.config.max_num_seqs, self.cfg.vocab_size))

    def _new_last_sampled(self) -> jax.Array:
        return put(np.zeros(self.config.max_num_seqs, np.int32), self._replicated)

    def _new_draft_rows(self) -> jax.Array | None:
        if not self.device_drafts:
            return None
        return put(np.zeros((self.config.max_num_seqs, 2 + self.spec_tokens), np.int32), self._replicated)

    @cached_property
    def _replicated(self):
        """Where per-step inputs and sampler buffers live: whole on every device of the mesh, or
        on the default device (committed there, as the params are: jit keys on it)."""
        return SingleDeviceSharding(self.devices[0]) if self.mesh is None else replicated(self.mesh)

    # -- sleep mode ------------------------------------------------------------------------

    @property
    def asleep(self) -> set[str]:
        """What sleep freed and no wake_up brought back: "weights", "kv_cache"."""
        return self._asleep

    @property
    def weights_gone(self) -> bool:
        """Whether the weights are asleep with nothing to wake them from (a failed reload_weights)."""
        return "weights" in self._asleep and self._host_params is None

    def sleep(self, level: int) -> None:
        """vLLM's sleep: the KV cache freed; the weights copied to host memory (level 1) or
        dropped (level 2). Their shapes and placements are kept, so that waking compiles nothing.
        A drafter's weights (draft model, EAGLE head) go to host memory at either level: nothing
        would refill dropped ones (update_weights is the target's), and they are small."""
        # (the drafter's own params: an EAGLE head is given the target's embedding and lm_head a call at a time)
        own, own_caches = (self.drafter.params, self.drafter.kv_caches) if self.drafter is not None else (None, None)
        self._params_struct = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                                           (self.params, own))
        # Level 2 drops the weights, not what no update refills: the stacks' row indices.
        kept = self.params if level == 1 else {k: v for k, v in self.params.items() if k in KEPT_ASLEEP}
        self._host_params = jax.device_get((kept, own))
        self._host_kv_scales = jax.device_get(self.kv_caches[2]) if len(self.kv_caches) == 3 else None
        freed = jax.tree.leaves((self.kv_caches, own, own_caches))
        # Asleep before anything is deleted: a failure part-way leaves an engine that wakes.
        # The target's weights are let go, not deleted: a JAX trainer's arrays given to
        # update_weights are the params themselves, and stay the trainer's (their memory is
        # freed when nothing else holds them).
        self._asleep = {"weights", "kv_cache"}
        self.params = self.kv_caches = None
        if self.drafter is not None:
            self.drafter.params = self.drafter.kv_caches = None
        if self.eagle is not None:
            self.eagle.step = None  # (a finished step's hidden states)
        for array in freed:
            array.delete()

    def wake_up(self, tags: list[str]) -> None:
        """Bring back what `tags` name: "weights" (level 1's copies; after level 2, buffers of
        undefined contents, for `update_weights` or `reload_weights` to fill), "kv_cache" (empty);
        a drafter's too (its weights: the host copy at either level)."""
        if "weights" in tags and "weights" in self._asleep:
            if self.weights_gone:
                raise RuntimeError("no weights to wake: reload_weights() failed part-way; call it again")
            (host, _), (structs, _) = self._host_params, self._params_struct
            placed = jax.tree.map(lambda x, s: put(x, s.sharding), host, {k: structs[k] for k in host})
            zeros = lambda s: jnp.zeros(s.shape, s.dtype, device=s.sharding)  # noqa: E731
            self.params = {k: placed[k] if k in placed else jax.tree.map(zeros, s) for k, s in structs.items()}
            self._wake_drafter_weights()
            self._asleep.discard("weights")
            self._host_params = None  # (after: a failure before leaves an engine that wakes)
        if "kv_cache" in tags and "kv_cache" in self._asleep:
            self.kv_caches = self._allocate_kv_caches(self.num_blocks)
            if self._host_kv_scales is not None:  # (the scales as they were: read, or calculated once)
                k, v, fresh = self.kv_caches
                self.kv_caches = (k, v, put(self._host_kv_scales, fresh.sharding))
                self._host_kv_scales = None
            if self.drafter is not None:
                self.drafter.allocate(self.num_blocks)
            self._asleep.discard("kv_cache")

    def _wake_drafter_weights(self) -> None:
        """The drafter's weights from their host copy, placed as before."""
        (_, host), (_, structs) = self._host_params, self._params_struct
        if self.drafter is not None:
            self.drafter.params = jax.tree.map(lambda x, s: put(x, s.sharding), host, structs)

    def reload_weights(self) -> None:
        """Read the weights from the checkpoint again, onto their devices (vLLM's collective_rpc
        "reload_weights"): what sleep(2) dropped, or weights changed by update_weights. A
        drafter's, which nothing changes, come back from their host copy if asleep."""
        self.params = None  # (let go first, for the memory: see `sleep`)
        if "weights" in self._asleep and not self.weights_gone:
            self._wake_drafter_weights()
        # Asleep until the new weights are in: a failed read (a missing file, an I/O error)
        # leaves an engine that refuses steps by name, for another reload_weights to fill
        # (or, asleep before, one that wakes from the host copy as it was).
        self._asleep.add("weights")
        _, self.params = self._load()
        self._asleep.discard("weights")
        self._host_params = None

    @cached_property
    def checkpoint_config(self) -> ModelConfig:
        """The checkpoint's own config (its KV heads before their repetition over devices)."""
        return load_config(self.config.model, self.config.hf_overrides)

    def _load(self) -> tuple[ModelConfig, dict]:
        """The checkpoint's weights on this replica's devices, and the config they run with."""
        c = self.config
        return load_model(c.model, dtype=c.dtype, load_format=c.load_format, seed=c.seed, mesh=self.mesh,
                          device=self.devices[0], expert_parallel=c.enable_expert_parallel,
                          quantization=c.quantization, hf_overrides=c.hf_overrides, use_tqdm=c.use_tqdm_on_load)

    def update_weights(self, weights) -> int:
        """Replace the named weights (see `jaxvllm.weight_update`), or all of them from a pytree
        of the params' own structure; the others stay. Returns how many tensors went in.
        Online-quantized weights are quantized as they were at load; a quantized checkpoint's
        are refused."""
        from jaxvllm.weight_update import across_processes, replaced_params, same_layout

        if self.cfg.quant_method:
            raise ValueError(f"update_weights on a quantized checkpoint ({self.cfg.quant_method}) is not supported: "
                             "its weights were quantized (and calibrated) offline, which an update of full-precision "
                             "tensors cannot repeat; load the full-precision model, with quantization='fp8' to have "
                             "updates quantized as they come")
        multiprocess = jax.process_count() > 1
        if same_layout(self.params, weights):
            if multiprocess:
                leaves = jax.tree_util.tree_flatten_with_path(weights)[0]
                pairs = across_processes([(jax.tree_util.keystr(k), a) for k, a in leaves], self._replicated)
                weights = jax.tree.unflatten(jax.tree.structure(weights), [a for _, a in pairs])
            self.params, count = replaced_params(self.params, weights)
            # The caller's arrays, and what was placed from them (an uncommitted array's
            # placement shares its buffer): shutdown deletes neither.
            given = [isinstance(a, jax.Array) for a in jax.tree.leaves(weights)]
            taken = [a for a, g in zip(jax.tree.leaves(weights), given) if g]
            taken += [p for p, g in zip(jax.tree.leaves(self.params), given) if g]
        else:
            count, taken = self._update_named(weights, multiprocess), []  # (copies: see weight_update)
        # Only the arrays the params hold count: a dead array's id may come back for another
        # (a KV cache, which shutdown would then not delete), and an RL loop's ids would pile up.
        self._given = (self._given | {id(a) for a in taken}) & {id(p) for p in jax.tree.leaves(self.params)}
        return count

    def _update_named(self, weights, multiprocess: bool) -> int:
        """update_weights from HF-named tensors; how many went in."""
        from jaxvllm.weight_update import across_processes, named_tensors, updated_params, weight_index

        if self._weight_index is None:
            original = self.checkpoint_config
            layout = dataclasses.replace(original, stack_layers=self.cfg.stack_layers,
                                         merge_projections=self.cfg.merge_projections)
            self._weight_index = (weight_index(MODELS[self.cfg.architecture].param_specs(layout)),
                                  kv_repeats(original, self.cfg))
        index, repeats = self._weight_index
        skip = frozenset({"lm_head.weight"}) if self.cfg.tie_word_embeddings else frozenset()
        pairs = named_tensors(weights)
        if multiprocess:
            pairs = across_processes(pairs, self._replicated)
        self.params, count = updated_params(self.params, pairs, index, repeats, skip, self.config.quantization,
                                            self.dtype)
        return count

    def weight_bytes_per_device(self) -> list[int]:
        """Bytes of the weights held on each of this replica's devices, in device order."""
        held = dict.fromkeys(self.devices, 0)
        for array in jax.tree.leaves(self.params):
            for device in array.sharding.device_set:
                bits = jax.dtypes.itemsize_bits(array.dtype)  # (int4: two to a byte)
                held[device] += math.prod(array.sharding.shard_shape(array.shape)) * bits // 8
        return list(held.values())

    def num_compiled_buckets(self) -> int:
        """Compiled forward shapes (token bucket x block-table width, and the decode-only
        variants of the pallas backend)."""
        return len(self._forward_shapes)

    def num_compiled_sampler_variants(self) -> int:
        return len(self._sampler_variants)

    # -- lifecycle -----------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return getattr(self, "builder", None) is None

    def close(self) -> None:
        """Free the device memory now: weights, KV cache and sampler state are deleted
        (even if something else still refers to this runner) and the compiled steps dropped;
        arrays update_weights took as they were (a trainer's) are let go, not deleted.
        The runner cannot run again; calling close twice is harmless."""
        if self.closed:
            return
        self.compiles.cancel()
        with defer_interrupts():  # (a Ctrl-C in here left a runner open over deleted arrays)
            draft = self.drafter.arrays() if self.drafter is not None else []
            draft += self.lora.arrays() if self.lora is not None else []
            self._delete_arrays(self.params, self.kv_caches, self.sampler_state, self.last_sampled, draft)
            self.params = self.kv_caches = self.sampler_state = self.last_sampled = self._host_params = None
            self._forward = self._sampler = self._prompt_logprobs = self._write_row = None
            self.draft = self.eagle = self.drafter = self.lora = None
            self.builder = None

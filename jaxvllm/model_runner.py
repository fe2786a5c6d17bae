"""Runs the model: owns params, the device KV cache and the persistent batch; builds each
step's packed batch and dispatches its jitted functions without waiting for them.

Per step: one host-to-device transfer (the packed batch), then the model forward
(compiled per token bucket and block-table width), the sampler (compiled per row count
and `SamplerFeatures`), and prompt logprobs only when a row asks. Nothing in them
branches on device data. `execute` returns a `PendingStep`; the host reads its tokens
when it needs them (after dispatching the next step, under async scheduling).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from functools import cached_property, partial
from itertools import chain

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, SingleDeviceSharding
from tqdm.auto import tqdm

from jaxvllm.config import EngineConfig, ModelConfig
from jaxvllm.input_batch import BatchLayout, InputBatch, block_table_widths
from jaxvllm.layers import ATTENTION_BACKENDS, allocate_kv_caches, resolve_kv_cache_dtype
from jaxvllm.loader import load_kv_scales, load_model, resolve_dtype
from jaxvllm.models import MODELS
from jaxvllm.request import Request, ScheduledRequest
from jaxvllm.sampler import (
    COMMON_FEATURES,
    MAX_BAD_WORD_TOKENS,
    MAX_BAD_WORDS,
    Logprobs,
    SamplerFeatures,
    SamplerState,
    SamplingTensors,
    compute_logprobs,
    init_state,
    sample,
    write_state_row,
)
from jaxvllm.sampling_params import DEFAULT_MAX_LOGPROBS, resolve_logprobs
from jaxvllm.sharding import (device_group, gather_over_processes, kv_cache_sharding, local_devices, make_mesh,
                              put, replicated, step_input, to_host)

logger = logging.getLogger(__name__)

# Without a device memory figure (CPU), the KV cache gets this much memory at most.
CPU_KV_CACHE_BYTES = 2 << 30

# The attention kernels (Triton) and the K/V scatter address one device's layer cache with
# 32-bit element offsets: it must hold fewer elements than this.
MAX_CACHE_ELEMENTS = 2**31 - 1


def max_kv_blocks(cfg: ModelConfig, block_size: int, num_devices: int) -> int:
    """The most blocks whose per-device layer cache [kv_heads / devices, blocks, block_size,
    head_dim] stays addressable with 32-bit offsets."""
    return MAX_CACHE_ELEMENTS // (cfg.num_kv_heads // num_devices * block_size * cfg.head_dim)


def default_buckets(max_num_batched_tokens: int, smallest: int = 16) -> list[int]:
    """Powers of two from `smallest`, ending with `max_num_batched_tokens` itself."""
    buckets, b = [], smallest
    while b < max_num_batched_tokens:
        buckets.append(b)
        b *= 2
    return buckets + [max_num_batched_tokens]


def device_memory_stats(device) -> dict | None:
    """A device's allocator figures (bytes_limit, bytes_in_use, ...); None on CPU."""
    return device.memory_stats()


def device_total_memory(stats: dict) -> float:
    """A device's total memory, from JAX's allocator limit: that is XLA_PYTHON_CLIENT_MEM_FRACTION
    (JAX's default 0.75) of the total. JAX reports no total of its own."""
    return stats["bytes_limit"] / float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.75"))


# Prompt logprobs need logits for every prompt row: computed this many rows at a time.
PROMPT_LOGPROBS_CHUNK = 256


@dataclass
class RunnerOutput:
    """What one step hands back to the host (numpy, rows = scheduled requests)."""

    sampled: np.ndarray  # [n] int32 (rows that do not sample hold junk)
    logprobs: Logprobs | None  # numpy fields, [n] rows; only when a row asked
    prompt_logprobs: Logprobs | None  # numpy fields, one row per `prompt_positions` entry
    prompt_positions: list[tuple[int, int]]  # (scheduled index, prompt position scored)


@dataclass
class HostBatch:
    """One step as the host built it: the packed buffer, its layout and sampler variant."""

    layout: BatchLayout
    packed: np.ndarray  # int32 [layout.size]
    features: SamplerFeatures | None  # None: no row samples, the sampler is not run
    num_scheduled: int
    prompt_rows: list[int]  # token rows whose prompt logprobs are read back
    prompt_positions: list[tuple[int, int]]  # (scheduled index, prompt position scored), per prompt row
    prompt_width: int = 0  # top logprobs per prompt row
    # Structured outputs: (sampling row, grammar) of each constrained row. Their bitmask
    # is filled once the tokens before are known: the sampler runs then (`ModelRunner.sample`).
    grammar_rows: list = field(default_factory=list)


@dataclass
class PendingStep:
    """A dispatched step: device arrays not yet read. `result()` waits for the device."""

    batch: HostBatch
    sampled: jax.Array | None
    logprobs: Logprobs | None
    prompt_logprobs: Logprobs | None
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
        rows_of = lambda lp, rows: jax.tree.map(lambda x: to_host(x)[rows], lp)  # noqa: E731
        return RunnerOutput(
            sampled=to_host(self.sampled)[:n] if self.sampled is not None else np.zeros(n, np.int32),
            logprobs=rows_of(self.logprobs, slice(0, n)) if self.logprobs is not None else None,
            prompt_logprobs=rows_of(self.prompt_logprobs, b.prompt_rows) if b.prompt_rows else None,
            prompt_positions=b.prompt_positions,
        )


def _forward(params, kv_caches, packed, last_sampled, *, cfg: ModelConfig, backend: str, mesh: Mesh | None,
             layout: BatchLayout):
    """The model on one step's batch: float32 logits of the sampling rows, every token's
    final hidden state (for prompt logprobs), the batch's sampling prefix (for the
    sampler, which then compiles per row count only), and the updated caches. Logits of
    a vocabulary-split lm_head are gathered: the sampler reads whole rows."""
    model = MODELS[cfg.architecture]
    inputs = layout.model_inputs(packed, last_sampled)
    hidden, kv_caches = model.hidden_states(params, kv_caches, inputs, cfg, backend, mesh)
    logits = model.compute_logits(params, hidden[inputs.logits_indices], cfg)
    if mesh is not None:
        logits = jax.lax.with_sharding_constraint(logits, replicated(mesh))
    return logits, hidden, packed[: layout.sampling_size], kv_caches


def _sample(sampling_rows, logits, last_sampled, state, bitmask, *, num_rows: int, features: SamplerFeatures,
            logprobs_mode: str):
    """Sample every row (`sampling_rows`: the packed batch's sampling prefix; `bitmask`: the
    structured-output masks, or None); record each sampling row's token at its persistent
    row of `last_sampled`, where the next step's decode inputs are read from."""
    t = BatchLayout.rows_only(num_rows).sampling(sampling_rows)
    sampled, logprobs, state = sample(logits, t, state, features, logprobs_mode, bitmask)
    rows = jnp.where(t.counts_sample, t.slot, last_sampled.shape[0])  # other rows: dropped
    return sampled, logprobs, last_sampled.at[rows].set(sampled, mode="drop"), state


def _prompt_logprobs(params, hidden, packed, *, cfg: ModelConfig, layout: BatchLayout, width: int) -> Logprobs:
    """Logprobs of each row's next prompt token (-1 = none), with the top `width`, chunked
    over rows. (Always logprobs of the model's logits, whatever the logprobs mode, as vLLM.)"""
    model = MODELS[cfg.architecture]
    targets = layout.prompt_targets(packed)
    rows = hidden.shape[0]
    chunk = min(rows, PROMPT_LOGPROBS_CHUNK)
    padded = -(-rows // chunk) * chunk
    hidden = jnp.pad(hidden, ((0, padded - rows), (0, 0))).reshape(padded // chunk, chunk, -1)
    ids = jnp.pad(jnp.maximum(targets, 0), (0, padded - rows)).reshape(padded // chunk, chunk)
    out = jax.lax.map(lambda xs: compute_logprobs(model.compute_logits(params, xs[0], cfg), xs[1], width), (hidden, ids))
    return jax.tree.map(lambda x: x.reshape(padded, *x.shape[2:])[:rows], out)


def sequence_rows(max_num_seqs: int, bucket: int) -> int:
    """Sequence rows of a token bucket's batch (static per bucket): every sequence brings
    at least one token, so a bucket of T tokens never holds more than T sequences."""
    return min(max_num_seqs, bucket)


def jit_forward(cfg: ModelConfig, backend: str, mesh: Mesh | None = None, kv_scaled: bool = False):
    """The model step as the runner compiles it, per layout: the KV caches donated. With a
    mesh, the model is split over its devices (tensor parallelism); None: one device.
    `kv_scaled`: an fp8 cache, each layer's (k_cache, v_cache, scales)."""
    # Outputs placed as the inputs are (else a donated cache could come back placed otherwise,
    # and the next step would compile anew); an fp8 cache's scales split on KV heads with it.
    caches = None if mesh is None else kv_cache_sharding(mesh)
    if mesh is not None and kv_scaled:
        caches = [(caches,) * 3] * cfg.num_layers
    out = None if mesh is None else (replicated(mesh),) * 3 + (caches,)
    return jax.jit(partial(_forward, cfg=cfg, backend=backend, mesh=mesh), static_argnames="layout",
                   donate_argnums=(1,), out_shardings=out)


def jit_sampler(logprobs_mode: str = "raw_logprobs", mesh: Mesh | None = None):
    """The sampler as the runner compiles it, per (row count, features): the last sampled
    tokens and the sampler state donated. With a mesh it runs whole on every device."""
    # partial: a function of its own, so that each runner counts only its own variants
    return jax.jit(partial(_sample, logprobs_mode=logprobs_mode), static_argnames=("num_rows", "features"),
                   donate_argnums=(2, 3), out_shardings=None if mesh is None else replicated(mesh))


def jit_prompt_logprobs(cfg: ModelConfig):
    return jax.jit(partial(_prompt_logprobs, cfg=cfg), static_argnames=("layout", "width"))


class ModelRunner:
    def __init__(self, config: EngineConfig) -> None:
        self.config = c = config
        # This replica's devices; tensor parallelism: a mesh over them (None: one device, nothing split).
        self.devices = device_group(c.tensor_parallel_size, c.data_parallel_rank, c.data_parallel_size)
        self.mesh = make_mesh(self.devices) if len(self.devices) > 1 else None
        # (the config the split model runs with: KV heads repeated when fewer than the devices,
        # experts split whole under expert parallelism)
        self.cfg, self.params = load_model(c.model, dtype=c.dtype, load_format=c.load_format, seed=c.seed,
                                           mesh=self.mesh, device=self.devices[0],
                                           expert_parallel=c.enable_expert_parallel)
        self.dtype = resolve_dtype(c.dtype, self.cfg)
        # The KV cache's element type, and for an fp8 cache its (k_scale, v_scale) per layer and KV head.
        self.kv_cache_dtype = resolve_kv_cache_dtype(c.kv_cache_dtype, self.dtype)
        self.kv_scales = self._kv_scales() if c.kv_cache_dtype != "auto" else None
        self.max_model_len = c.max_model_len or self.cfg.max_position_embeddings
        if self.max_model_len > self.cfg.max_position_embeddings:
            raise ValueError(
                f"max_model_len {self.max_model_len} exceeds the model's max_position_embeddings "
                f"({self.cfg.max_position_embeddings})"
            )
        # EngineConfig.__post_init__ checked each argument's type and range (and max_num_seqs <= tokens).
        self.buckets = sorted(set(c.token_buckets or default_buckets(c.max_num_batched_tokens)))
        if self.buckets[-1] < c.max_num_batched_tokens:
            raise ValueError(
                f"the largest token bucket ({self.buckets[-1]}) is below max_num_batched_tokens ({c.max_num_batched_tokens})"
            )
        self.backend = self._resolve_backend(c.attention_backend, softcapped=self.cfg.attn_logit_softcapping is not None)
        self.block_size = c.block_size
        self.max_blocks_per_seq = -(-self.max_model_len // c.block_size)
        self.widths = block_table_widths(self.max_blocks_per_seq)
        self.input_batch = InputBatch(c.max_num_seqs, self.max_blocks_per_seq)
        self._forward = jit_forward(self.cfg, self.backend, self.mesh, kv_scaled=self.kv_scales is not None)
        self._sampler = jit_sampler(c.logprobs_mode, self.mesh)
        self._prompt_logprobs = jit_prompt_logprobs(self.cfg)
        self._write_row = jax.jit(write_state_row, donate_argnums=(0,))
        self.sampler_state: SamplerState = self._new_sampler_state()
        # Each persistent row's last sampled token: where decode inputs come from under async scheduling.
        self.last_sampled = self._new_last_sampled()
        self.num_blocks = self._addressable(self._num_kv_blocks())
        self.kv_caches = self._allocate_kv_caches(self.num_blocks)
        self._log_kv_cache()
        self.warmup_seconds = 0.0 if c.enforce_eager else self.warmup()

    @staticmethod
    def _resolve_backend(backend: str, softcapped: bool = False) -> str:
        """Resolve "auto": the Pallas kernels on a GPU, the jnp reference elsewhere (on CPU
        the kernels run in interpret mode only, for tests) and for attention soft-capping,
        which the kernels lack. "pallas" is allowed anywhere."""
        if backend == "auto":
            gpu = jax.default_backend() in ("gpu", "cuda", "rocm")
            if gpu and softcapped:
                logger.info("attention soft-capping: the reference attention backend (the kernels have none)")
            return "pallas" if gpu and not softcapped else "reference"
        if backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend {backend!r} is not available; choose from 'auto', {ATTENTION_BACKENDS}")
        return backend

    # -- KV cache sizing -------------------------------------------------------------

    @property
    def bytes_per_block(self) -> int:
        """All devices together (each holds 1 / tensor_parallel_size of every block)."""
        c = self.cfg
        itemsize = jnp.dtype(self.kv_cache_dtype).itemsize  # fp8: 1, half a 16-bit cache's: twice the blocks
        return 2 * c.num_layers * c.num_kv_heads * self.block_size * c.head_dim * itemsize

    @property
    def kv_cache_dtype_name(self) -> str:
        return jnp.dtype(self.kv_cache_dtype).name

    def _kv_scales(self) -> np.ndarray:
        """An fp8 cache's scales, float32 [num_layers, num_kv_heads, 2]: the checkpoint's k_scale /
        v_scale (per tensor or per KV head), else 1.0 (vLLM's default); with
        calculate_kv_scales, 1.0 until the first batch sets them."""
        if self.config.load_format == "dummy" or self.config.calculate_kv_scales:
            return np.ones((self.cfg.num_layers, self.cfg.num_kv_heads, 2), np.float32)
        scales, found = load_kv_scales(self.config.model, self.cfg)
        logger.info("fp8 KV cache: %d of %d k/v scales from the checkpoint, the others 1.0",
                    found, 2 * self.cfg.num_layers)
        return scales

    def kv_cache_per_device(self) -> list[dict]:
        per_device = self.bytes_per_block // len(self.devices)
        return [{"device": str(d), "num_blocks": self.num_blocks, "bytes": self.num_blocks * per_device}
                for d in self.devices]

    def _addressable(self, num_blocks: int) -> int:
        """Cap the block count at what 32-bit offsets address (a tiny model on a large GPU
        would get more); an explicit override past it is refused."""
        limit = max_kv_blocks(self.cfg, self.block_size, len(self.devices))
        if num_blocks <= limit:
            return num_blocks
        if self.config.num_gpu_blocks_override is not None:
            raise ValueError(f"num_gpu_blocks_override={num_blocks} exceeds the {limit} KV blocks that 32-bit "
                             "offsets address in one device's cache")
        logger.info("KV cache: capped at %d blocks (from %d): one device's layer cache must hold fewer than "
                    "2^31 elements for the kernels' 32-bit offsets", limit, num_blocks)
        return limit

    def _num_kv_blocks(self) -> int:
        """vLLM's meaning: the engine may use gpu_memory_utilization of each device's total
        memory for weights, activations and the KV cache. Profile the largest step, then
        size the cache from the device with the least room left."""
        c = self.config
        if c.num_gpu_blocks_override is not None:
            if c.num_gpu_blocks_override < 1:
                raise ValueError(f"num_gpu_blocks_override must be >= 1, got {c.num_gpu_blocks_override}")
            return c.num_gpu_blocks_override
        mine = local_devices(self.devices)  # (across processes, each profiles its own devices)
        stats = device_memory_stats(mine[0])
        if not stats or "bytes_limit" not in stats:  # CPU: enough for every sequence, within a fixed budget
            wanted = c.max_num_seqs * self.max_blocks_per_seq
            return max(self.max_blocks_per_seq, min(wanted, CPU_KV_CACHE_BYTES // self.bytes_per_block))
        # Profile: run the largest step with a one-sequence cache and measure the peak.
        probe = self._allocate_kv_caches(self.max_blocks_per_seq)
        batch = self.padding_batch(self.buckets[-1], self.widths[-1], COMMON_FEATURES[-1])
        probe_shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), probe)
        peaks_before = {d: device_memory_stats(d).get("peak_bytes_in_use", 0) for d in mine}
        self.launch(batch, probe)
        jax.block_until_ready((self.last_sampled, self.sampler_state))
        del probe
        per_device = self.bytes_per_block / len(self.devices)
        fits = []
        for device in mine:
            stats = device_memory_stats(device)
            peak = stats.get("peak_bytes_in_use", stats["bytes_in_use"])
            if peak <= peaks_before[device] and peak > stats["bytes_in_use"]:
                # The allocator's peak never resets: this one is an earlier engine's, in memory
                # since freed (a second LLM in a notebook). The step's own, from XLA's figures.
                peak = stats["bytes_in_use"] + self._step_bytes(batch, probe_shapes)
            wanted = c.gpu_memory_utilization * device_total_memory(stats)
            if wanted > stats["bytes_limit"]:
                logger.info(
                    "%s: gpu_memory_utilization=%s asks for %.2f GiB, JAX's allocator allows %.2f GiB "
                    "(XLA_PYTHON_CLIENT_MEM_FRACTION, set before jax starts, raises it)",
                    device, c.gpu_memory_utilization, wanted / 2**30, stats["bytes_limit"] / 2**30,
                )
            budget = min(wanted, stats["bytes_limit"])
            fits.append((int((budget - peak) // per_device), device, peak, budget))
        num_blocks, device, peak, budget = min(fits, key=lambda f: f[0])
        num_blocks = min(num_blocks, *gather_over_processes(num_blocks))  # every process allocates the same cache
        if num_blocks < self.max_blocks_per_seq:
            raise ValueError(
                f"only {max(num_blocks, 0)} KV blocks fit in gpu_memory_utilization={c.gpu_memory_utilization} "
                f"on {device} (peak use {peak / 2**30:.2f} GiB of {budget / 2**30:.2f} GiB); one sequence of "
                f"max_model_len={self.max_model_len} needs {self.max_blocks_per_seq}"
            )
        return num_blocks

    def _step_bytes(self, batch: HostBatch, kv_shapes) -> int:
        """Device memory one step of `batch` allocates beyond its inputs (per device):
        the forward's temporaries and outputs, from XLA's analysis of the compiled step."""
        packed = step_input(batch.packed, self._replicated)
        compiled = self._forward.lower(self.params, kv_shapes, packed, self.last_sampled,
                                       layout=batch.layout).compile()
        m = compiled.memory_analysis()
        return int(m.temp_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes)

    def _log_kv_cache(self) -> None:
        logger.info(
            "KV cache: %d blocks x %d tokens = %d tokens, %.3f GiB (%s)",
            self.num_blocks, self.block_size, self.num_blocks * self.block_size,
            self.num_blocks * self.bytes_per_block / 2**30, self.kv_cache_dtype_name,
        )

    # -- compile -----------------------------------------------------------------------

    def warmup(self) -> float:
        """Compile, before serving, the forward of every token bucket and block-table width
        and the common sampler variants of every row count (greedy, temperature,
        temperature + top-k/top-p); rarer sampler variants compile when first used."""
        start = time.perf_counter()
        shapes = [(b, w, False) for b in self.buckets for w in self.widths]
        shapes += [(b, w, True) for b in self.decode_only_buckets for w in self.widths]
        for bucket, width, decode_only in tqdm(shapes, desc="Compiling token buckets", dynamic_ncols=True):
            self.launch(self.padding_batch(bucket, width, None, decode_only))
        for rows in sorted({self.rows_for(b) for b in self.buckets}):
            bucket = next(b for b in self.buckets if self.rows_for(b) == rows)
            for features in COMMON_FEATURES:
                self.launch(self.padding_batch(bucket, self.widths[0], features))
        self.sampler_state = self._write_row(self.sampler_state, 0, jax.tree.map(lambda x: x[0], self.sampler_state))
        jax.block_until_ready((self.kv_caches, self.last_sampled, self.sampler_state))
        seconds = time.perf_counter() - start
        decode_only = f" (and decode-only ones of {self.decode_only_buckets})" if self.decode_only_buckets else ""
        logger.info("warm-up: compiled %d token buckets %s%s x %d block-table widths %s and %d sampler variants "
                    "in %.1f s", len(self.buckets), self.buckets, decode_only, len(self.widths), self.widths,
                    self.num_compiled_sampler_variants(), seconds)
        return seconds

    def padding_batch(self, bucket: int, width: int, features: SamplerFeatures | None,
                      decode_only: bool = False) -> HostBatch:
        """An all-padding batch of a bucket's shape: writes nothing to the cache."""
        layout = BatchLayout(bucket, self.rows_for(bucket), width, decode_only)
        return HostBatch(layout, layout.empty()[0], features, 0, [], [])

    @cached_property
    def decode_only_buckets(self) -> list[int]:
        """Buckets that also compile a decode-only forward (`ModelInputs.decode_only`): on the
        pallas backend, those a step of one token per sequence can take (up to max_num_seqs
        tokens). The reference backend gains nothing from it: none."""
        if self.backend != "pallas":
            return []
        return [b for b in self.buckets if b <= self.bucket_for(self.config.max_num_seqs)]

    # -- one step: host side -------------------------------------------------------------

    def rows_for(self, bucket: int) -> int:
        return sequence_rows(self.config.max_num_seqs, bucket)

    def bucket_for(self, num_tokens: int) -> int:
        for b in self.buckets:
            if b >= num_tokens:
                return b
        raise ValueError(f"{num_tokens} tokens exceed the largest bucket {self.buckets[-1]}")

    def width_for(self, num_blocks: int) -> int:
        return next(w for w in self.widths if w >= num_blocks)

    def prepare(self, scheduled: list[ScheduledRequest]) -> HostBatch:
        """Host side of a step: admit new requests to the persistent batch, then fill one
        packed buffer from its rows (numpy gathers) and the few per-step values."""
        n, bs, ib = len(scheduled), self.block_size, self.input_batch
        if n > self.config.max_num_seqs:
            raise ValueError(f"{n} sequences scheduled, max_num_seqs is {self.config.max_num_seqs}")
        rows, starts, lens, samples = [], [], [], []
        pending = []  # scheduled index of rows whose last input token is still on the device
        host_tokens = []
        grammar_rows = []  # (sampling row, grammar) of structured-output rows
        row_of, num_blocks = ib.row_of, ib.num_blocks
        for i, s in enumerate(scheduled):
            request = s.request
            row = row_of.get(request.request_id)
            if row is None:
                row = self._admit(request)
            if len(s.block_ids) != num_blocks[row]:
                ib.set_blocks(row, s.block_ids)
            start, num_new = s.start, s.num_new_tokens
            rows.append(row)
            starts.append(start)
            lens.append(num_new)
            samples.append(s.samples)
            if s.samples and request.grammar is not None:
                grammar_rows.append((i, request.grammar))
            end = start + num_new
            token_ids = request.token_ids
            if end > len(token_ids):  # the last token was sampled by the step before
                pending.append(i)
                end = len(token_ids)
            if end > start:
                host_tokens.append(token_ids[start:end])
        max_blocks = max(map(num_blocks.__getitem__, rows), default=1)
        rows, starts, lens = (np.array(x, np.int32) for x in (rows, starts, lens))
        samples = np.array(samples, bool)

        num_tokens = int(lens.sum())
        bucket = self.bucket_for(num_tokens)
        decode_only = num_tokens == n and bucket in self.decode_only_buckets  # one token per sequence
        layout = BatchLayout(bucket, self.rows_for(bucket), self.width_for(max_blocks), decode_only)
        packed, v = layout.empty()

        qsl = v["query_start_loc"]
        qsl[n + 1 :] = num_tokens
        np.cumsum(lens, out=qsl[1 : n + 1])
        last = qsl[1 : n + 1] - 1  # each sequence's last token row
        seq_of_token = np.repeat(np.arange(n, dtype=np.int32), lens)
        token_pos = np.arange(num_tokens, dtype=np.int32) - qsl[seq_of_token] + starts[seq_of_token]
        v["positions"][:num_tokens] = token_pos
        tables = ib.block_table[rows, : layout.width]
        v["block_tables"][:n] = tables
        v["slot_mapping"][:num_tokens] = tables[seq_of_token, token_pos // bs] * bs + token_pos % bs
        v["seq_lens"][:n] = starts + lens
        v["logits_indices"][:n] = last

        ids = v["input_ids"][:num_tokens]
        flat = np.fromiter(chain.from_iterable(host_tokens), np.int32)
        if pending:  # those tokens come from the device's last sampled ids, at the request's row
            v["prev_row"][last[pending]] = rows[pending]
            from_host = np.ones(num_tokens, bool)
            from_host[last[pending]] = False
            ids[from_host] = flat
        else:
            ids[:] = flat

        features = self._fill_sampling_rows(v, rows, starts + lens, samples, bool(grammar_rows))
        prompt_rows, prompt_positions, prompt_width = self._fill_prompt_targets(v, scheduled)
        return HostBatch(layout, packed, features, n, prompt_rows, prompt_positions, prompt_width, grammar_rows)

    def _fill_sampling_rows(self, v: dict[str, np.ndarray], rows: np.ndarray, ends: np.ndarray,
                            samples: np.ndarray, grammar: bool = False) -> SamplerFeatures | None:
        """The sampling rows, gathered from the persistent batch; returns the sampler
        variant they need (None when no row samples)."""
        ib, n = self.input_batch, len(rows)
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty", "top_k", "seeds"):
            v[name][:n] = getattr(ib, name)[rows]
        output_index = ends - ib.num_prompt_tokens[rows]  # outputs before the one sampled
        v["output_index"][:n] = output_index
        v["slot"][:n] = rows
        v["use_state"][:n] = ib.use_state[rows]
        v["suppress_stop"][:n] = output_index < ib.min_tokens[rows]
        v["counts_sample"][:n] = samples
        v["want_logprobs"][:n] = samples & ib.want_logprobs[rows]
        if not samples.any():
            return None
        wanted = samples & ib.want_logprobs[rows]
        width = self.logprobs_width(int(ib.num_logprobs[rows][wanted].max())) if wanted.any() else 0
        return SamplerFeatures.of(layout_tensors(v, n), samples, bad_words=ib.has_bad_words[rows], logprobs_width=width,
                                  grammar=grammar)

    def logprobs_width(self, k: int) -> int:
        """Top logprobs computed in a step whose rows ask for up to k: vLLM's default
        max_logprobs (20) unless more is asked, then the engine's max_logprobs; at most the
        vocabulary. Two widths at most, so two sampler variants."""
        vocab = self.cfg.vocab_size
        width = DEFAULT_MAX_LOGPROBS if k <= DEFAULT_MAX_LOGPROBS else resolve_logprobs(self.config.max_logprobs, vocab)
        return max(1, min(width, vocab))

    def _fill_prompt_targets(self, v: dict[str, np.ndarray], scheduled: list[ScheduledRequest]):
        """Rows whose prompt logprobs are asked for: (token rows, (scheduled index, prompt
        position), the top-logprobs width they need)."""
        prompt_rows, prompt_positions, width = [], [], 0
        qsl = v["query_start_loc"]
        for i, s in enumerate(scheduled):
            if s.request.num_prompt_logprobs is None:
                continue
            width = max(width, s.request.num_prompt_logprobs)
            # The row of position p scores prompt token p + 1 (the first prompt token has none).
            for pos in range(s.start, min(s.start + s.num_new_tokens, s.request.num_prompt_tokens - 1)):
                row = int(qsl[i]) + pos - s.start
                v["prompt_targets"][row] = s.request.prompt_token_ids[pos + 1]
                prompt_rows.append(row)
                prompt_positions.append((i, pos + 1))
        return prompt_rows, prompt_positions, self.logprobs_width(width) if prompt_rows else 0

    # -- persistent rows -------------------------------------------------------------------

    def _admit(self, request: Request) -> int:
        """Give a request its persistent row; write its sampler state row when it uses one."""
        row = self.input_batch.add(request)
        if not request.uses_sampler_state:
            return row
        params, vocab = request.params, self.cfg.vocab_size
        outputs = request.output_token_ids
        bias = np.zeros(vocab, np.float32)
        if params.allowed_token_ids is not None:
            bias[:] = -np.inf
            bias[params.allowed_token_ids] = 0.0
        for token, value in (params.logit_bias or {}).items():
            bias[token] += value
        prompt_mask = np.zeros(vocab, bool)
        prompt_mask[request.prompt_token_ids] = True
        counts = np.bincount(np.asarray(outputs, np.int64), minlength=vocab).astype(np.int32)
        stop_mask = np.zeros(vocab, bool)
        stop_mask[list(request.eos_token_ids) + params.stop_token_ids] = True
        bad_words = np.full((MAX_BAD_WORDS, MAX_BAD_WORD_TOKENS), -1, np.int32)
        for i, word in enumerate(request.bad_words_token_ids):
            bad_words[i, MAX_BAD_WORD_TOKENS - len(word):] = word
        recent = np.full(MAX_BAD_WORD_TOKENS - 1, -1, np.int32)
        tail = outputs[len(outputs) - min(len(outputs), MAX_BAD_WORD_TOKENS - 1):]
        recent[len(recent) - len(tail):] = tail
        state_row = SamplerState(bias, prompt_mask, counts, stop_mask, bad_words, recent)
        self.sampler_state = self._write_row(self.sampler_state, row, state_row)
        return row

    def release(self, request_ids) -> None:
        """Requests that left the running set (finished, aborted, preempted) give back their row."""
        for rid in request_ids:
            self.input_batch.remove(rid)

    # -- one step: device side ---------------------------------------------------------------

    def execute(self, scheduled: list[ScheduledRequest]) -> PendingStep:
        """Build and dispatch one step; nothing here waits for the device."""
        return self.launch(self.prepare(scheduled))

    def launch(self, batch: HostBatch, kv_caches=None) -> PendingStep:
        """Dispatch a built step: one transfer, the forward, the sampler, prompt logprobs if asked.
        (`kv_caches`: a probe cache for the memory profile instead of the engine's.) A step
        with structured-output rows is sampled later, by `sample`, with their bitmask."""
        layout = batch.layout
        packed = step_input(batch.packed, self._replicated)
        logits, hidden, sampling_rows, caches = self._forward(
            self.params, self.kv_caches if kv_caches is None else kv_caches, packed, self.last_sampled, layout=layout
        )
        if kv_caches is None:
            self.kv_caches = caches
        step = PendingStep(batch, None, None, None)
        if batch.prompt_rows:
            step.prompt_logprobs = self._prompt_logprobs(self.params, hidden, packed, layout=layout,
                                                         width=batch.prompt_width)
        if batch.features is not None:
            step.logits, step.sampling_rows = logits, sampling_rows
            if not batch.features.grammar:
                self.sample(step)
        return step

    def sample(self, step: PendingStep, bitmask: np.ndarray | None = None) -> None:
        """Dispatch a step's sampler (`bitmask`: its structured-output masks, [rows, words])."""
        features = step.batch.features
        state = self.sampler_state if features.state else None
        mask = step_input(bitmask, self._replicated) if features.grammar else None
        step.sampled, step.logprobs, self.last_sampled, state = self._sampler(
            step.sampling_rows, step.logits, self.last_sampled, state, mask,
            num_rows=step.batch.layout.num_rows, features=features,
        )
        step.logits = step.sampling_rows = None
        if features.state:
            self.sampler_state = state

    def recover(self) -> bool:
        """After a failed step: no request keeps its row, and donated buffers that the step
        consumed without handing back are made anew. Returns whether the KV cache was (its
        contents are then gone)."""
        self.release(list(self.input_batch.row_of))
        gone = lambda tree: any(isinstance(x, jax.Array) and x.is_deleted() for x in jax.tree.leaves(tree))  # noqa: E731
        if gone(self.sampler_state):
            self.sampler_state = self._new_sampler_state()
        if gone(self.last_sampled):
            self.last_sampled = self._new_last_sampled()
        if gone(self.kv_caches):
            self.kv_caches = self._allocate_kv_caches(self.num_blocks)
            return True
        return False

    def _allocate_kv_caches(self, num_blocks: int):
        return allocate_kv_caches(self.cfg, num_blocks, self.block_size, self.kv_cache_dtype, self.mesh,
                                  self.devices[0], self.kv_scales, self.config.calculate_kv_scales)

    def _new_sampler_state(self) -> SamplerState:
        """Per-row sampler state, whole on every device of the mesh (the sampler is replicated)."""
        return jax.tree.map(lambda x: put(x, self._replicated), init_state(self.config.max_num_seqs, self.cfg.vocab_size))

    def _new_last_sampled(self) -> jax.Array:
        return put(np.zeros(self.config.max_num_seqs, np.int32), self._replicated)

    @cached_property
    def _replicated(self):
        """Where per-step inputs and sampler buffers live: whole on every device of the mesh, or
        on the default device (committed there, as the params are: jit keys on it)."""
        return SingleDeviceSharding(self.devices[0]) if self.mesh is None else replicated(self.mesh)

    def num_compiled_buckets(self) -> int:
        """Compiled forward shapes (token bucket x block-table width, and the decode-only
        variants of the pallas backend)."""
        return self._forward._cache_size()

    def num_compiled_sampler_variants(self) -> int:
        return self._sampler._cache_size()

    # -- lifecycle -----------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self.params is None

    def close(self) -> None:
        """Free the device memory now: weights, KV cache and sampler state are deleted
        (even if something else still refers to this runner) and the compiled steps dropped.
        The runner cannot run again; calling close twice is harmless."""
        if self.closed:
            return
        for array in jax.tree.leaves((self.params, self.kv_caches, self.sampler_state, self.last_sampled)):
            if isinstance(array, jax.Array) and not array.is_deleted():
                array.delete()
        self.params = self.kv_caches = self.sampler_state = self.last_sampled = None
        self._forward = self._sampler = self._prompt_logprobs = self._write_row = None
        self.input_batch = None


def layout_tensors(views: dict[str, np.ndarray], n: int) -> SamplingTensors:
    """The first n sampling rows of a host buffer's views, for `SamplerFeatures.of`."""
    return SamplingTensors(**{k: views[k][:n] for k in SamplingTensors.__dataclass_fields__})

"""Runs the model: owns params and the device KV cache, builds the padded flat batch,
and calls ONE jitted step (model + sampler) per engine step, compiled per token bucket.
"""

from __future__ import annotations

import logging
import time
from functools import partial
from itertools import chain

import jax
import jax.numpy as jnp
import numpy as np

from jaxvllm.batch import ModelInputs
from jaxvllm.config import EngineConfig, ModelConfig
from jaxvllm.layers import ATTENTION_BACKENDS, allocate_kv_caches
from jaxvllm.loader import load_model, resolve_dtype
from jaxvllm.models import MODELS
from jaxvllm.request import ScheduledRequest
from jaxvllm.sampler import SamplingTensors, sample

logger = logging.getLogger(__name__)

# Without a device memory figure (CPU), the KV cache gets this much memory at most.
CPU_KV_CACHE_BYTES = 2 << 30


def default_buckets(max_num_batched_tokens: int, smallest: int = 16) -> list[int]:
    """Powers of two from `smallest`, ending with `max_num_batched_tokens` itself."""
    buckets, b = [], smallest
    while b < max_num_batched_tokens:
        buckets.append(b)
        b *= 2
    return buckets + [max_num_batched_tokens]


def device_memory_stats() -> dict | None:
    """The first device's allocator figures (bytes_limit, bytes_in_use, ...); None on CPU."""
    return jax.devices()[0].memory_stats()


def _step(params, kv_caches, inputs: ModelInputs, sampling: SamplingTensors, *, cfg: ModelConfig, backend: str):
    logits, kv_caches = MODELS[cfg.architecture].forward(params, kv_caches, inputs, cfg, backend)
    return sample(logits, sampling), kv_caches


class ModelRunner:
    def __init__(self, config: EngineConfig) -> None:
        self.config = c = config
        self.cfg, self.params = load_model(c.model, dtype=c.dtype, load_format=c.load_format, seed=c.seed)
        self.dtype = resolve_dtype(c.dtype, self.cfg)
        self.max_model_len = c.max_model_len or self.cfg.max_position_embeddings
        if self.max_model_len > self.cfg.max_position_embeddings:
            raise ValueError(
                f"max_model_len {self.max_model_len} exceeds the model's max_position_embeddings "
                f"({self.cfg.max_position_embeddings})"
            )
        if c.max_num_seqs < 1 or c.block_size < 1:
            raise ValueError("max_num_seqs and block_size must be >= 1")
        if c.max_num_batched_tokens < c.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({c.max_num_batched_tokens}) must be >= max_num_seqs ({c.max_num_seqs}) "
                "so that a full decode batch fits in one step"
            )
        self.buckets = sorted(set(c.token_buckets or default_buckets(c.max_num_batched_tokens)))
        if self.buckets[-1] < c.max_num_batched_tokens:
            raise ValueError(
                f"the largest token bucket ({self.buckets[-1]}) is below max_num_batched_tokens ({c.max_num_batched_tokens})"
            )
        self.backend = self._resolve_backend(c.attention_backend)
        self.block_size = c.block_size
        self.max_blocks_per_seq = -(-self.max_model_len // c.block_size)
        self._step = jax.jit(partial(_step, cfg=self.cfg, backend=self.backend), donate_argnums=(1,))
        self.num_blocks = self._num_kv_blocks()
        self.kv_caches = allocate_kv_caches(self.cfg, self.num_blocks, c.block_size, self.dtype)
        self._log_kv_cache()
        self.warmup_seconds = self.warmup()

    @staticmethod
    def _resolve_backend(backend: str) -> str:
        if backend == "auto":
            return "reference"  # the Pallas backend arrives with the kernels issue
        if backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend {backend!r} is not available; choose from 'auto', {ATTENTION_BACKENDS}")
        return backend

    # -- KV cache sizing -------------------------------------------------------------

    @property
    def bytes_per_block(self) -> int:
        c = self.cfg
        return 2 * c.num_layers * c.num_kv_heads * self.block_size * c.head_dim * jnp.dtype(self.dtype).itemsize

    def _num_kv_blocks(self) -> int:
        c = self.config
        if c.num_gpu_blocks_override is not None:
            if c.num_gpu_blocks_override < 1:
                raise ValueError(f"num_gpu_blocks_override must be >= 1, got {c.num_gpu_blocks_override}")
            return c.num_gpu_blocks_override
        stats = device_memory_stats()
        if not stats or "bytes_limit" not in stats:  # CPU: enough for every sequence, within a fixed budget
            wanted = c.max_num_seqs * self.max_blocks_per_seq
            return max(self.max_blocks_per_seq, min(wanted, CPU_KV_CACHE_BYTES // self.bytes_per_block))
        # Profile: run the largest bucket with a one-sequence cache and measure the peak.
        probe = allocate_kv_caches(self.cfg, self.max_blocks_per_seq, self.block_size, self.dtype)
        sampled, probe = self._step(self.params, probe, *self._dummy_batch(self.buckets[-1]))
        jax.block_until_ready(sampled)
        del probe
        stats = device_memory_stats()
        peak = stats.get("peak_bytes_in_use", stats["bytes_in_use"])
        free = c.gpu_memory_utilization * stats["bytes_limit"] - peak
        num_blocks = int(free // self.bytes_per_block)
        if num_blocks < self.max_blocks_per_seq:
            raise ValueError(
                f"only {max(num_blocks, 0)} KV blocks fit in gpu_memory_utilization={c.gpu_memory_utilization} "
                f"(peak use {peak / 2**30:.2f} GiB of {stats['bytes_limit'] / 2**30:.2f} GiB); one sequence of "
                f"max_model_len={self.max_model_len} needs {self.max_blocks_per_seq}"
            )
        return num_blocks

    def _log_kv_cache(self) -> None:
        logger.info(
            "KV cache: %d blocks x %d tokens = %d tokens, %.3f GiB (%s)",
            self.num_blocks, self.block_size, self.num_blocks * self.block_size,
            self.num_blocks * self.bytes_per_block / 2**30, jnp.dtype(self.dtype).name,
        )

    # -- compile -----------------------------------------------------------------------

    def warmup(self) -> float:
        """Compile every token bucket now, so that serving never compiles."""
        start = time.perf_counter()
        for bucket in self.buckets:
            sampled, self.kv_caches = self._step(self.params, self.kv_caches, *self._dummy_batch(bucket))
        jax.block_until_ready(sampled)
        seconds = time.perf_counter() - start
        logger.info("warm-up: compiled %d token buckets %s in %.1f s", len(self.buckets), self.buckets, seconds)
        return seconds

    def _dummy_batch(self, num_tokens: int) -> tuple[ModelInputs, SamplingTensors]:
        """All-padding batch of a bucket's shape: writes nothing to the cache."""
        return self.prepare([], num_tokens)

    # -- one step ----------------------------------------------------------------------

    def bucket_for(self, num_tokens: int) -> int:
        for b in self.buckets:
            if b >= num_tokens:
                return b
        raise ValueError(f"{num_tokens} tokens exceed the largest bucket {self.buckets[-1]}")

    def prepare(self, scheduled: list[ScheduledRequest], num_padded: int | None = None):
        """Host side: the flat numpy batch padded to a bucket, and the sampling rows."""
        n, rows, bs = len(scheduled), self.config.max_num_seqs, self.block_size
        if n > rows:
            raise ValueError(f"{n} sequences scheduled, max_num_seqs is {rows}")
        lens = np.fromiter((s.num_new_tokens for s in scheduled), np.int32, n)
        starts = np.fromiter((s.start for s in scheduled), np.int32, n)
        num_tokens = int(lens.sum())
        padded = num_padded or self.bucket_for(num_tokens)

        query_start_loc = np.full(rows + 1, num_tokens, np.int32)
        query_start_loc[0] = 0
        np.cumsum(lens, out=query_start_loc[1 : n + 1])
        seq_of_token = np.repeat(np.arange(n, dtype=np.int32), lens)
        token_pos = np.arange(num_tokens, dtype=np.int32) - query_start_loc[seq_of_token] + starts[seq_of_token]

        block_tables = np.zeros((rows, self.max_blocks_per_seq), np.int32)
        for i, s in enumerate(scheduled):
            block_tables[i, : len(s.block_ids)] = s.block_ids

        input_ids = np.zeros(padded, np.int32)
        input_ids[:num_tokens] = np.fromiter(
            chain.from_iterable(s.request.token_ids[s.start : s.start + s.num_new_tokens] for s in scheduled),
            np.int32, num_tokens,
        )
        positions = np.zeros(padded, np.int32)
        positions[:num_tokens] = token_pos
        slot_mapping = np.full(padded, -1, np.int32)
        slot_mapping[:num_tokens] = block_tables[seq_of_token, token_pos // bs] * bs + token_pos % bs
        seq_lens = np.zeros(rows, np.int32)
        seq_lens[:n] = starts + lens
        logits_indices = np.zeros(rows, np.int32)
        logits_indices[:n] = query_start_loc[1 : n + 1] - 1

        temperature = np.zeros(rows, np.float32)
        seeds = np.zeros(rows, np.uint32)
        output_index = np.zeros(rows, np.int32)
        for i, s in enumerate(scheduled):
            temperature[i] = s.request.params.temperature
            seeds[i] = s.request.seed
            output_index[i] = s.request.num_output_tokens
        inputs = ModelInputs(input_ids, positions, slot_mapping, query_start_loc, seq_lens, block_tables, logits_indices)
        return inputs, SamplingTensors(temperature, seeds, output_index)

    def execute(self, scheduled: list[ScheduledRequest]) -> np.ndarray:
        """Run one step; returns the sampled token of each scheduled row [n]."""
        if not scheduled:
            return np.zeros(0, np.int32)
        inputs, sampling = self.prepare(scheduled)
        sampled, self.kv_caches = self._step(self.params, self.kv_caches, inputs, sampling)
        return np.asarray(sampled)[: len(scheduled)]

    def num_compiled_buckets(self) -> int:
        return self._step._cache_size()

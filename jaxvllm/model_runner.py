"""Runs the model: owns params and the device KV cache, builds the padded flat batch,
and calls ONE jitted step (model + sampler) per engine step, compiled per token bucket.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from functools import partial
from itertools import chain

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from jaxvllm.batch import ModelInputs
from jaxvllm.config import EngineConfig, ModelConfig
from jaxvllm.layers import ATTENTION_BACKENDS, allocate_kv_caches
from jaxvllm.loader import load_model, resolve_dtype
from jaxvllm.models import MODELS
from jaxvllm.request import Request, ScheduledRequest
from jaxvllm.sampler import (
    Logprobs,
    SamplerState,
    SamplingTensors,
    compute_logprobs,
    empty_logprobs,
    init_state,
    sample,
    write_state_row,
)

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


# Prompt logprobs need logits for every prompt row: computed this many rows at a time.
PROMPT_LOGPROBS_CHUNK = 256


@dataclass
class RunnerOutput:
    """What one step hands back to the host (numpy, rows = scheduled requests)."""

    sampled: np.ndarray  # [n] int32
    logprobs: Logprobs | None  # numpy fields, [n] rows; only when a row asked
    prompt_logprobs: Logprobs | None  # numpy fields, one row per `prompt_positions` entry
    prompt_positions: list[tuple[int, int]]  # (scheduled index, prompt position scored)


def _prompt_logprobs(params, hidden, targets, cfg: ModelConfig) -> Logprobs:
    """Logprobs of each row's next prompt token (`targets`, -1 = none), chunked over rows."""
    model = MODELS[cfg.architecture]
    rows = hidden.shape[0]
    chunk = min(rows, PROMPT_LOGPROBS_CHUNK)
    padded = -(-rows // chunk) * chunk
    hidden = jnp.pad(hidden, ((0, padded - rows), (0, 0))).reshape(padded // chunk, chunk, -1)
    ids = jnp.pad(jnp.maximum(targets, 0), (0, padded - rows)).reshape(padded // chunk, chunk)
    out = jax.lax.map(lambda xs: compute_logprobs(model.compute_logits(params, xs[0], cfg), xs[1]), (hidden, ids))
    return jax.tree.map(lambda x: x.reshape(padded, *x.shape[2:])[:rows], out)


def _step(params, kv_caches, sampler_state, inputs: ModelInputs, sampling: SamplingTensors, prompt_targets,
          *, cfg: ModelConfig, backend: str):
    model = MODELS[cfg.architecture]
    hidden, kv_caches = model.hidden_states(params, kv_caches, inputs, cfg, backend)
    logits = model.compute_logits(params, hidden[inputs.logits_indices], cfg)
    sampled, logprobs, sampler_state = sample(logits, sampling, sampler_state)
    prompt_logprobs = jax.lax.cond(
        jnp.any(prompt_targets >= 0),
        lambda: _prompt_logprobs(params, hidden, prompt_targets, cfg),
        lambda: empty_logprobs(hidden.shape[0]),
    )
    return sampled, logprobs, prompt_logprobs, kv_caches, sampler_state


def sequence_rows(max_num_seqs: int, bucket: int) -> int:
    """Sequence rows of a token bucket's batch (static per bucket): every sequence brings
    at least one token, so a bucket of T tokens never holds more than T sequences."""
    return min(max_num_seqs, bucket)


def jit_step(cfg: ModelConfig, backend: str):
    """The engine step as the runner compiles it: KV caches and sampler state donated."""
    return jax.jit(partial(_step, cfg=cfg, backend=backend), donate_argnums=(1, 2))


def sampling_tensors(scheduled: list[ScheduledRequest], rows: int, slots: dict[str, int]) -> SamplingTensors:
    """Per-row sampling parameters (`slots`: request id -> SamplerState row); padding rows
    are greedy with neutral settings."""
    n = len(scheduled)
    floats = np.zeros((rows, 6), np.float32)
    floats[:] = (0.0, 1.0, 0.0, 0.0, 0.0, 1.0)
    ints = np.zeros((rows, 4), np.int64)
    flags = np.zeros((rows, 4), bool)
    if n:
        floats[:n] = [s.request.sampling_floats for s in scheduled]
        ints[:n] = [
            (s.request.params.top_k, s.request.seed, s.request.num_output_tokens, slots.get(s.request.request_id, 0))
            for s in scheduled
        ]
        flags[:n] = [
            (s.request.uses_sampler_state, s.request.num_output_tokens < s.request.params.min_tokens,
             s.samples, s.samples and s.request.params.logprobs is not None)
            for s in scheduled
        ]
    f, i, b = floats.T.copy(), ints.T.copy(), flags.T.copy()
    return SamplingTensors(
        temperature=f[0], top_p=f[1], min_p=f[2], presence_penalty=f[3], frequency_penalty=f[4],
        repetition_penalty=f[5], top_k=i[0].astype(np.int32), seeds=i[1].astype(np.uint32),
        output_index=i[2].astype(np.int32), slot=i[3].astype(np.int32),
        use_state=b[0], suppress_stop=b[1], counts_sample=b[2], want_logprobs=b[3],
    )


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
        self._step = jit_step(self.cfg, self.backend)
        self._write_row = jax.jit(write_state_row, donate_argnums=(0,))
        self.sampler_state: SamplerState = init_state(c.max_num_seqs, self.cfg.vocab_size)
        self._slots: dict[str, int] = {}  # request id -> its SamplerState row
        self._free_slots = list(range(c.max_num_seqs))
        self.num_blocks = self._num_kv_blocks()
        self.kv_caches = allocate_kv_caches(self.cfg, self.num_blocks, c.block_size, self.dtype)
        self._log_kv_cache()
        self.warmup_seconds = self.warmup()

    @staticmethod
    def _resolve_backend(backend: str) -> str:
        """Resolve "auto": the Pallas kernels on a GPU, the jnp reference elsewhere (on CPU
        the kernels run in interpret mode only, for tests). "pallas" is allowed anywhere."""
        if backend == "auto":
            return "pallas" if jax.default_backend() in ("gpu", "cuda", "rocm") else "reference"
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
        outputs = self._step(self.params, probe, self.sampler_state, *self._dummy_batch(self.buckets[-1]))
        self.sampler_state = outputs[-1]
        jax.block_until_ready(outputs)
        del probe, outputs
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
        for bucket in tqdm(self.buckets, desc="Compiling token buckets", dynamic_ncols=True):
            *outputs, self.kv_caches, self.sampler_state = self._step(
                self.params, self.kv_caches, self.sampler_state, *self._dummy_batch(bucket)
            )
        zeros = np.zeros(self.cfg.vocab_size)
        self.sampler_state = self._write_row(self.sampler_state, 0, zeros, zeros > 0, zeros.astype(np.int32), zeros > 0)
        jax.block_until_ready((outputs, self.sampler_state))
        seconds = time.perf_counter() - start
        logger.info("warm-up: compiled %d token buckets %s in %.1f s", len(self.buckets), self.buckets, seconds)
        return seconds

    def _dummy_batch(self, num_tokens: int):
        """All-padding batch of a bucket's shape: writes nothing to the cache."""
        return self.prepare([], num_tokens)[:3]

    # -- one step ----------------------------------------------------------------------

    def rows_for(self, bucket: int) -> int:
        return sequence_rows(self.config.max_num_seqs, bucket)

    def bucket_for(self, num_tokens: int) -> int:
        for b in self.buckets:
            if b >= num_tokens:
                return b
        raise ValueError(f"{num_tokens} tokens exceed the largest bucket {self.buckets[-1]}")

    def prepare(self, scheduled: list[ScheduledRequest], num_padded: int | None = None):
        """Host side: the flat numpy batch padded to a bucket, and the sampling rows."""
        n, bs = len(scheduled), self.block_size
        if n > self.config.max_num_seqs:
            raise ValueError(f"{n} sequences scheduled, max_num_seqs is {self.config.max_num_seqs}")
        lens = np.fromiter((s.num_new_tokens for s in scheduled), np.int32, n)
        starts = np.fromiter((s.start for s in scheduled), np.int32, n)
        num_tokens = int(lens.sum())
        padded = num_padded or self.bucket_for(num_tokens)
        # Small steps (latency, few long decodes) get fewer rows, hence fewer logits to
        # compute and more split-K partitions per sequence.
        rows = self.rows_for(padded)

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

        sampling = sampling_tensors(scheduled, rows, self._slots)
        prompt_targets = np.full(padded, -1, np.int32)
        prompt_positions = []
        for i, s in enumerate(scheduled):
            if s.request.params.prompt_logprobs is None:
                continue
            # The row of position p scores prompt token p + 1 (the first prompt token has none).
            for pos in range(s.start, min(s.start + s.num_new_tokens, s.request.num_prompt_tokens - 1)):
                row = int(query_start_loc[i]) + pos - s.start
                prompt_targets[row] = s.request.prompt_token_ids[pos + 1]
                prompt_positions.append((i, pos + 1, row))
        inputs = ModelInputs(input_ids, positions, slot_mapping, query_start_loc, seq_lens, block_tables, logits_indices)
        return inputs, sampling, prompt_targets, prompt_positions

    # -- per-request sampler state -------------------------------------------------------

    def _admit(self, request: Request) -> None:
        """Give a request that needs sampler state a slot, and write its rows once."""
        if not request.uses_sampler_state or request.request_id in self._slots:
            return
        slot = self._free_slots.pop()
        self._slots[request.request_id] = slot
        params, vocab = request.params, self.cfg.vocab_size
        bias = np.zeros(vocab, np.float32)
        if params.allowed_token_ids is not None:
            bias[:] = -np.inf
            bias[params.allowed_token_ids] = 0.0
        for token, value in (params.logit_bias or {}).items():
            bias[token] += value
        prompt_mask = np.zeros(vocab, bool)
        prompt_mask[request.prompt_token_ids] = True
        counts = np.bincount(np.asarray(request.output_token_ids, np.int64), minlength=vocab).astype(np.int32)
        stop_mask = np.zeros(vocab, bool)
        stop_mask[list(request.eos_token_ids) + params.stop_token_ids] = True
        self.sampler_state = self._write_row(self.sampler_state, slot, bias, prompt_mask, counts, stop_mask)

    def release(self, request_ids) -> None:
        """Requests that left the running set (finished, aborted, preempted) give back their slot."""
        for rid in request_ids:
            slot = self._slots.pop(rid, None)
            if slot is not None:
                self._free_slots.append(slot)

    # -- one step ----------------------------------------------------------------------

    def execute(self, scheduled: list[ScheduledRequest]) -> RunnerOutput:
        """Run one step: a token for each scheduled row; logprobs copied back only when asked."""
        if not scheduled:
            return RunnerOutput(np.zeros(0, np.int32), None, None, [])
        for s in scheduled:
            self._admit(s.request)
        inputs, sampling, prompt_targets, prompt_positions = self.prepare(scheduled)
        sampled, logprobs, prompt_logprobs, self.kv_caches, self.sampler_state = self._step(
            self.params, self.kv_caches, self.sampler_state, inputs, sampling, prompt_targets
        )
        n = len(scheduled)

        def to_host(lp: Logprobs, rows) -> Logprobs:
            return jax.tree.map(lambda x: np.asarray(x)[rows], lp)

        return RunnerOutput(
            sampled=np.asarray(sampled)[:n],
            logprobs=to_host(logprobs, slice(0, n)) if sampling.want_logprobs.any() else None,
            prompt_logprobs=to_host(prompt_logprobs, [r for _, _, r in prompt_positions]) if prompt_positions else None,
            prompt_positions=[(i, pos) for i, pos, _ in prompt_positions],
        )

    def num_compiled_buckets(self) -> int:
        return self._step._cache_size()

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
        for array in jax.tree.leaves((self.params, self.kv_caches, self.sampler_state)):
            if isinstance(array, jax.Array) and not array.is_deleted():
                array.delete()
        self.params = self.kv_caches = self.sampler_state = None
        self._step = self._write_row = None
        self._slots.clear()

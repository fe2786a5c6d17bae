"""The device KV cache: its shape and element type, how many blocks fit, and its allocation.

K and V are one array each for all layers, [num_kv_heads, num_layers, num_blocks,
block_size, head_dim] (the layout is documented in `pallas_kernels/__init__.py`), split on
KV heads under a mesh: a step takes two cache arguments (three with an fp8 cache's scales)
whatever the depth, and each layer's kernels read its pages in place. An fp8 cache adds
each layer's float32 (k_scale, v_scale) per KV head. The cache is
allocated once: on a GPU after a profiling run of the largest step has shown how much
memory is left (vLLM's `gpu_memory_utilization`), on a CPU for every sequence within a
fixed budget (`CPU_KV_CACHE_BYTES`); the block pool that hands its blocks out is
`jaxvllm/kv_cache_manager.py`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, SingleDeviceSharding

from jaxvllm.config import EngineConfig
from jaxvllm.loader import load_kv_scales
from jaxvllm.model_config import ModelConfig
from jaxvllm.sharding import gather_over_processes, kv_cache_sharding, local_devices, put
from pallas_kernels.common import bits_dtype, from_bits

logger = logging.getLogger(__name__)

# Without a device memory figure (CPU), the KV cache gets this much memory at most.
CPU_KV_CACHE_BYTES = 2 << 30

# The attention kernels and the K/V scatter index a KV head's rows (tokens of every layer)
# with 32-bit integers: one device's cache must hold fewer rows per head than this. (Its
# element offsets are 64-bit past 4 GiB, which Pallas' Triton lowering switches to itself.)
MAX_CACHE_ROWS = 2**31 - 1

# Compile options of every step that takes KV caches. XLA:GPU's rematerialization pass
# counts a donated cache more than once, so over caches sized to fill the device it finds
# every step over its memory limit and recomputes instructions in vain (design page,
# "Stacked layer weights"). A limit of 10x the device's memory keeps the pass from
# running; the cache's sizing already leaves the step's temporaries room.
CACHE_STEP_COMPILER_OPTIONS = {"xla_gpu_memory_limit_slop_factor": 1000}

# kv_cache_dtype (config.KV_CACHE_DTYPES, vLLM's engine argument) -> the cache's element
# type; "auto" (absent here): the model's dtype.
_FP8_DTYPES = {"fp8": jnp.float8_e4m3fn, "fp8_e4m3": jnp.float8_e4m3fn, "fp8_e5m2": jnp.float8_e5m2}


def resolve_kv_cache_dtype(kv_cache_dtype: str, model_dtype):
    """The KV cache's element type for `kv_cache_dtype` (checked by `EngineConfig`) and the
    model's dtype."""
    return _FP8_DTYPES.get(kv_cache_dtype, model_dtype)


def with_cache_storage(cfg: ModelConfig, dtype, platform: str) -> ModelConfig:
    """`cfg` with `kv_cache_bits` set when a cache of `dtype` is best stored as unsigned ints
    of its width: a 16-bit or fp8 cache on a CPU. XLA:CPU has no scatter or gather of
    narrow floats and converts the operand to a wider float, the whole cache around every
    layer's write and read, so the step moves the bits (`pallas_kernels.common.as_bits`).
    The step takes and returns the bits; each layer views them as `dtype` and back, and
    those same-width bitcasts cancel out. Elsewhere the cache is stored as itself."""
    if platform != "cpu" or bits_dtype(dtype) is None:
        return cfg
    return dataclasses.replace(cfg, kv_cache_bits=jnp.dtype(dtype).name)


def cache_view(cache: jax.Array, cfg: ModelConfig) -> jax.Array:
    """A stored K or V cache as its element type (`with_cache_storage`), to inspect it."""
    return cache if cfg.kv_cache_bits is None else from_bits(cache, cfg.kv_cache_bits)


def device_memory_stats(device) -> dict | None:
    """A device's allocator figures (bytes_limit, bytes_in_use, ...); None on CPU."""
    return device.memory_stats()


def device_total_memory(stats: dict) -> float:
    """A device's total memory, from JAX's allocator limit: that is XLA_PYTHON_CLIENT_MEM_FRACTION
    (JAX's default 0.75) of the total. JAX reports no total of its own."""
    return stats["bytes_limit"] / float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.75"))


@dataclass(frozen=True)
class KVCacheSpec:
    """What one block of the cache holds, over all layers and devices."""

    cfg: ModelConfig  # the config the (possibly split) model runs with
    block_size: int
    dtype: Any  # the cache's element type
    num_devices: int = 1

    @property
    def bytes_per_block(self) -> int:
        """All devices together (each holds 1 / num_devices of every block)."""
        c = self.cfg
        itemsize = jnp.dtype(self.dtype).itemsize  # fp8: 1, half a 16-bit cache's: twice the blocks
        return 2 * c.num_layers * c.num_kv_heads * self.block_size * c.head_dim * itemsize

    @property
    def dtype_name(self) -> str:
        return jnp.dtype(self.dtype).name

    @property
    def max_blocks(self) -> int:
        """The most blocks whose per-device cache keeps fewer than 2^31 rows per KV head
        (num_layers * blocks * block_size), which 32-bit indices address."""
        return MAX_CACHE_ROWS // (self.cfg.num_layers * self.block_size)

    def addressable(self, num_blocks: int, override: bool = False) -> int:
        """Cap the block count at what 32-bit indices address (a tiny model on a large GPU
        would get more); an explicit override past it is refused. A 1-byte (fp8) cache of
        2^31 to 2^32 elements per device is also cut below 2^31: Pallas' Triton lowering
        keeps 32-bit element offsets up to 4 GiB, which overflow past 2^31 elements."""
        limit = self.max_blocks
        c = self.cfg
        elements = c.num_layers * c.num_kv_heads // self.num_devices * self.block_size * c.head_dim  # a block's
        if jnp.dtype(self.dtype).itemsize == 1 and (2**31 - 1) // elements < min(num_blocks, limit) <= 2**32 // elements:
            limit = (2**31 - 1) // elements
        if num_blocks <= limit:
            return num_blocks
        if override:
            raise ValueError(f"num_gpu_blocks_override={num_blocks} exceeds the {limit} KV blocks that 32-bit "
                             "offsets address in one device's cache")
        logger.info("KV cache: capped at %d blocks (from %d): one device's cache must hold fewer than 2^31 "
                    "rows per KV head for the kernels' 32-bit indices", limit, num_blocks)
        return limit


def kv_cache_scales(config: EngineConfig, cfg: ModelConfig) -> np.ndarray | None:
    """An fp8 cache's scales, float32 [num_layers, num_kv_heads, 2]: the checkpoint's k_scale /
    v_scale (per tensor or per KV head), else 1.0 (vLLM's default); with
    calculate_kv_scales, 1.0 until the first batch sets them. None: a cache in the
    model's dtype, which has none."""
    if config.kv_cache_dtype == "auto":
        return None
    if config.load_format == "dummy" or config.calculate_kv_scales:
        return np.ones((cfg.num_layers, cfg.num_kv_heads, 2), np.float32)
    scales, found = load_kv_scales(config.model, cfg)
    logger.info("fp8 KV cache: %d of %d k/v scales from the checkpoint, the others 1.0", found, 2 * cfg.num_layers)
    return scales


def num_kv_blocks(config: EngineConfig, spec: KVCacheSpec, devices: list, max_model_len: int,
                  profile: Callable[[], None], step_bytes: Callable[[], int]) -> int:
    """vLLM's meaning: the engine may use gpu_memory_utilization of each device's total
    memory for weights, activations and the KV cache. `profile()` runs the largest step
    once; the cache is sized from the device with the least room left after it.
    `step_bytes()` is that step's own memory from XLA's analysis, for when the allocator's
    peak predates it. `num_gpu_blocks_override`, then `kv_cache_memory_bytes` (a device's
    share), skip the profile. Capped at what 32-bit offsets address."""
    if config.num_gpu_blocks_override is not None:
        return spec.addressable(config.num_gpu_blocks_override, override=True)
    max_blocks_per_seq = -(-max_model_len // spec.block_size)
    per_device = spec.bytes_per_block / len(devices)  # (a block's bytes on each device)
    if config.kv_cache_memory_bytes is not None:
        num_blocks = int(config.kv_cache_memory_bytes // per_device)
        if num_blocks < max_blocks_per_seq:
            raise ValueError(f"kv_cache_memory_bytes={config.kv_cache_memory_bytes} holds {num_blocks} KV blocks "
                             f"of {int(per_device)} bytes a device; one sequence of "
                             f"max_model_len={max_model_len} needs {max_blocks_per_seq}. "
                             f"{_estimate(num_blocks, spec.block_size, 'kv_cache_memory_bytes')}")
        return spec.addressable(num_blocks)
    mine = local_devices(devices)  # (across processes, each profiles its own devices)
    stats = device_memory_stats(mine[0])
    if not stats or "bytes_limit" not in stats:  # CPU: enough for every sequence, within a fixed budget
        wanted = config.max_num_seqs * max_blocks_per_seq
        return spec.addressable(max(max_blocks_per_seq, min(wanted, CPU_KV_CACHE_BYTES // spec.bytes_per_block)))
    peaks_before = {d: device_memory_stats(d).get("peak_bytes_in_use", 0) for d in mine}
    profile()
    fits = []
    for device in mine:
        stats = device_memory_stats(device)
        peak = stats.get("peak_bytes_in_use", stats["bytes_in_use"])
        if peak <= peaks_before[device] and peak > stats["bytes_in_use"]:
            # The allocator's peak never resets: this one is an earlier engine's, in memory
            # since freed (a second LLM in a notebook). The step's own, from XLA's figures.
            peak = stats["bytes_in_use"] + step_bytes()
        wanted = config.gpu_memory_utilization * device_total_memory(stats)
        if wanted > stats["bytes_limit"]:
            logger.info(
                "%s: gpu_memory_utilization=%s asks for %.2f GiB, JAX's allocator allows %.2f GiB "
                "(XLA_PYTHON_CLIENT_MEM_FRACTION, set before jax starts, raises it)",
                device, config.gpu_memory_utilization, wanted / 2**30, stats["bytes_limit"] / 2**30,
            )
        budget = min(wanted, stats["bytes_limit"])
        fits.append((int((budget - peak) // per_device), device, peak, budget))
    num_blocks, device, peak, budget = min(fits, key=lambda f: f[0])
    num_blocks = min(num_blocks, *gather_over_processes(num_blocks))  # every process allocates the same cache
    if num_blocks < max_blocks_per_seq:
        raise ValueError(
            f"only {max(num_blocks, 0)} KV blocks fit in gpu_memory_utilization={config.gpu_memory_utilization} "
            f"on {device} (peak use {peak / 2**30:.2f} GiB of {budget / 2**30:.2f} GiB); one sequence of "
            f"max_model_len={max_model_len} needs {max_blocks_per_seq}. "
            f"{_estimate(num_blocks, spec.block_size, 'gpu_memory_utilization')}"
        )
    return spec.addressable(num_blocks)


def kv_cache_specs(
    cfg: ModelConfig, num_blocks: int, block_size: int, dtype, mesh: Mesh | None = None, device=None,
    scales: bool = False, calculate_scales: bool = False,
) -> tuple[jax.ShapeDtypeStruct, ...]:
    """The shapes, types and placements of what `allocate_kv_caches` returns: what a step
    compiles against, so that a warm-up need not wait for the zero-fill."""
    shape = (cfg.num_kv_heads, cfg.num_layers, num_blocks, block_size, cfg.head_dim)
    if cfg.kv_cache_bits is not None:  # stored as bits (`with_cache_storage`)
        dtype = bits_dtype(cfg.kv_cache_bits)
    place = kv_cache_sharding(mesh) if mesh is not None else SingleDeviceSharding(device or jax.devices()[0])
    cache = jax.ShapeDtypeStruct(shape, dtype, sharding=place)
    if not scales:
        return cache, cache
    scales_shape = (cfg.num_kv_heads, cfg.num_layers, 3 if calculate_scales else 2)
    return cache, cache, jax.ShapeDtypeStruct(scales_shape, jnp.float32, sharding=place)


def allocate_kv_caches(
    cfg: ModelConfig, num_blocks: int, block_size: int, dtype, mesh: Mesh | None = None, device=None,
    scales: np.ndarray | None = None, calculate_scales: bool = False,
) -> tuple[jax.Array, ...]:
    """Zeroed (k_cache, v_cache), each [num_kv_heads, num_layers, num_blocks, block_size,
    head_dim], split on KV heads over `mesh` (each device allocates only its part), else on
    `device` (default: the first). With `scales` (an fp8 cache: float32 [num_layers,
    num_kv_heads, 2], each layer's and KV head's (k_scale, v_scale)), (k_cache, v_cache,
    scales): [num_kv_heads, num_layers, 2], split on KV heads with the cache, or with
    `calculate_scales` [num_kv_heads, num_layers, 3], (k_scale, v_scale, 1): to calculate
    from the first batch (`layers.calculate_kv_scales`). Each is a donated argument of every step."""
    cache = kv_cache_specs(cfg, num_blocks, block_size, dtype, mesh, device)[0]
    place = cache.sharding
    caches = (jnp.zeros(cache.shape, cache.dtype, device=place), jnp.zeros(cache.shape, cache.dtype, device=place))
    if scales is None:
        return caches
    scales = np.asarray(scales, np.float32)
    if scales.shape != (cfg.num_layers, cfg.num_kv_heads, 2):
        raise ValueError(f"KV cache scales must be [num_layers={cfg.num_layers}, num_kv_heads={cfg.num_kv_heads}, 2] "
                         f"(k_scale, v_scale), got {scales.shape}")
    if calculate_scales:
        scales = np.concatenate([scales, np.ones_like(scales[..., :1])], axis=-1)
    return (*caches, put(np.ascontiguousarray(scales.swapaxes(0, 1)), place))  # split on KV heads as the cache


def _estimate(num_blocks: int, block_size: int, knob: str) -> str:
    """vLLM's advice when one sequence of max_model_len does not fit."""
    estimate = max(num_blocks, 0) * block_size
    known = f"Based on the available memory, the estimated maximum model length is {estimate}. " if estimate else ""
    return f"{known}Try increasing `{knob}` or decreasing `max_model_len` when initializing the engine."

"""Building blocks of the decoder: norm, rotary embedding, MLP, and paged attention.

Attention is where backends plug in: `attention_backend` picks the implementation of
the same contract (see `pallas_kernels/ragged_paged_attention.py`): "reference" (plain
jnp, any device) or "pallas" (the Pallas kernels: split-K decode kernel for 1-token
sequences, ragged kernel for the rest, both in every step; compiled on GPU, interpret
mode on CPU). The K/V write is XLA's scatter on the donated cache for both.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P, SingleDeviceSharding

from jaxvllm.batch import ModelInputs
from jaxvllm.config import ModelConfig, RopeConfig
from jaxvllm.sharding import AXIS, kv_cache_sharding
from pallas_kernels import mixed_paged_attention, ragged_paged_attention_reference, write_kv_reference

ATTENTION_BACKENDS = ("reference", "pallas")


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm over the last axis, computed in float32 and cast back, as transformers does."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * x32.astype(x.dtype)


def apply_rope(x: jax.Array, positions: jax.Array, rope: RopeConfig) -> jax.Array:
    """Rotate x [T, heads, head_dim] by its positions (HF's rotate-half convention)."""
    head_dim = x.shape[-1]
    inv_freq = jnp.asarray(rope.inv_freq(head_dim))
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [T, D/2]
    angles = jnp.concatenate([angles, angles], axis=-1)[:, None, :]  # [T, 1, D]
    cos, sin = jnp.cos(angles).astype(x.dtype), jnp.sin(angles).astype(x.dtype)
    half = head_dim // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


def paged_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    kv_cache: tuple[jax.Array, jax.Array],
    inputs: ModelInputs,
    *,
    sm_scale: float,
    sliding_window: int | None,
    backend: str,
    mesh: Mesh | None = None,
) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """Write this step's k/v into the cache, then attend; returns (out, new cache).

    With a mesh, each device does this for its own heads (`jax.shard_map`): q/k/v and the
    cache are split on heads, the batch's index arrays replicated."""
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; choose from {ATTENTION_BACKENDS}")
    local = partial(_paged_attention, sm_scale=sm_scale, sliding_window=sliding_window, backend=backend)
    if mesh is None:
        return local(q, k, v, kv_cache, inputs)
    heads = P(None, AXIS)
    return jax.shard_map(
        local, mesh=mesh, in_specs=(heads, heads, heads, P(AXIS), P()), out_specs=(heads, P(AXIS)),
        check_vma=False,  # Pallas calls carry no varying-axis annotations
    )(q, k, v, kv_cache, inputs)


def _paged_attention(q, k, v, kv_cache, inputs: ModelInputs, *, sm_scale, sliding_window, backend):
    k_cache, v_cache = write_kv_reference(*kv_cache, k, v, inputs.slot_mapping)
    attend = mixed_paged_attention if backend == "pallas" else ragged_paged_attention_reference
    out = attend(
        q,
        k_cache,
        v_cache,
        inputs.positions,
        inputs.query_start_loc,
        inputs.seq_lens,
        inputs.block_tables,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
    )
    return out, (k_cache, v_cache)


def allocate_kv_caches(
    cfg: ModelConfig, num_blocks: int, block_size: int, dtype, mesh: Mesh | None = None, device=None
) -> list[tuple[jax.Array, jax.Array]]:
    """Zeroed per-layer (k_cache, v_cache), each [num_kv_heads, num_blocks, block_size, head_dim],
    split on KV heads over `mesh` (each device allocates only its part), else on `device`
    (default: the first)."""
    shape = (cfg.num_kv_heads, num_blocks, block_size, cfg.head_dim)
    device = kv_cache_sharding(mesh) if mesh is not None else SingleDeviceSharding(device or jax.devices()[0])
    return [(jnp.zeros(shape, dtype, device=device), jnp.zeros(shape, dtype, device=device))
            for _ in range(cfg.num_layers)]

"""Write new K/V rows into the paged cache through a slot mapping.

Layout: see `pallas_kernels/__init__.py` ([num_kv_heads, num_blocks, block_size, head_dim]).

Both attention backends use this XLA scatter, no Pallas kernel: under `jit` with the
caches donated (the model runner donates them) XLA updates the buffers in place, so a
step writes T rows per layer and never copies the cache, which is all a kernel could do.
"""

import jax
import jax.numpy as jnp

from pallas_kernels.common import as_bits, fp8_max, from_bits, is_fp8, per_head_scale


def write_kv_reference(
    k_cache: jax.Array,
    v_cache: jax.Array,
    k: jax.Array,
    v: jax.Array,
    slot_mapping: jax.Array,
    k_scale: jax.Array | float | None = None,
    v_scale: jax.Array | float | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Scatter `k`, `v` [T, num_kv_heads, head_dim] into slots `slot_mapping` [T].

    Into an fp8 (float8_e4m3fn or float8_e5m2) cache the rows are quantized: x / scale in
    float32 (scale: `k_scale` / `v_scale`, per tensor or per KV head, None = 1.0), clipped
    to the type's range (+-448 for e4m3, whose cast would make NaN of anything beyond),
    then cast. Any other cache takes them cast to its dtype (divided by the scale if one
    is given).

    A negative slot marks a padding row: it is dropped, never written (a plain
    negative index would wrap around and clobber the last block). Under `jit` with the
    caches donated, XLA updates them in place. A 16-bit or fp8 cache is scattered as its
    bits (`as_bits`), which XLA:CPU does in place where it converts a float one whole.
    """
    num_kv_heads, num_blocks, block_size, head_dim = k_cache.shape
    if k.shape != (slot_mapping.shape[0], num_kv_heads, head_dim) or v.shape != k.shape:
        raise ValueError(
            f"k/v must be [T={slot_mapping.shape[0]}, {num_kv_heads}, {head_dim}], got {k.shape} and {v.shape}"
        )
    num_slots = num_blocks * block_size
    slots = jnp.where(slot_mapping < 0, num_slots, slot_mapping)  # out of range -> dropped
    if slots.shape[0] == 1:
        # XLA makes a one-row scatter a dynamic-update-slice, which reads the old row back
        # in case it is dropped; with several layers' pages in one cache, XLA:CPU then reads
        # every layer's old row from the step's input cache and copies the whole cache twice
        # per layer. A second, dropped row keeps it a scatter, updated in place.
        slots = jnp.pad(slots, (0, 1), constant_values=num_slots)
        k, v = (jnp.pad(x, ((0, 1), (0, 0), (0, 0))) for x in (k, v))

    def write(cache, new, scale):
        new = new.swapaxes(0, 1)  # [kv_heads, T, head_dim]
        if scale is not None:
            new = new.astype(jnp.float32) / per_head_scale(scale, num_kv_heads)[:, None, None]
        if is_fp8(cache.dtype):
            new = jnp.clip(new.astype(jnp.float32), -fp8_max(cache.dtype), fp8_max(cache.dtype))
        flat = as_bits(cache.reshape(num_kv_heads, num_slots, head_dim))
        flat = flat.at[:, slots].set(as_bits(new.astype(cache.dtype)), mode="drop")
        return from_bits(flat, cache.dtype).reshape(cache.shape)

    return write(k_cache, k, k_scale), write(v_cache, v, v_scale)

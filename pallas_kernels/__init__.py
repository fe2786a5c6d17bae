"""Attention kernels over a paged KV cache, each beside a plain-jnp reference of the same contract.

Cache layout (per layer, K and V as separate arrays):

    k_cache, v_cache: [num_kv_heads, num_blocks, block_size, head_dim]

Token slot `s` lives at block `s // block_size`, offset `s % block_size`. Head-major keeps
each (head, block) page contiguous in memory, which is what a decode kernel that walks
one KV head's pages wants to load, and it is the layout of JAX's own Pallas
`paged_attention`, so the two can be benchmarked on the same arrays. Sharding the cache
by KV heads (tensor parallelism) splits the leading axis.
"""

from pallas_kernels.kv_cache_write import write_kv_reference
from pallas_kernels.ragged_paged_attention import ragged_paged_attention_reference

__all__ = ["ragged_paged_attention_reference", "write_kv_reference"]

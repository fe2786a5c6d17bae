"""Attention kernels over a paged KV cache, each beside a plain-jnp reference of the same contract.

Cache layout (per layer, K and V as separate arrays):

    k_cache, v_cache: [num_kv_heads, num_blocks, block_size, head_dim]

in the queries' dtype, or float8_e4m3fn / float8_e5m2 (an fp8 KV cache: stored = K / k_scale,
V / v_scale, with float32 scales per tensor or per KV head that the write, the kernels and
the references take as `k_scale` / `v_scale`; the kernels convert each fp8 tile after loading it, to the
queries' dtype or, in the decode kernel under bf16 queries, to float16, and fold the scales
into the softmax scale and the output).

The pages of several layers may share one K and one V array (an engine's cache for every
layer, [num_kv_heads, num_layers, num_blocks, block_size, head_dim], viewed as
[num_kv_heads, num_layers * num_blocks, ...], a free reshape): the caller then shifts a
layer's block ids and slots by its first block (layer l's: l * num_blocks), and passes
the whole cache to each layer's call, so nothing is sliced out or copied.

Token slot `s` lives at block `s // block_size`, offset `s % block_size`. Head-major keeps
each (head, block) page contiguous in memory, which is what a decode kernel that walks
one KV head's pages wants to load, and it is the layout of JAX's own Pallas
`paged_attention`, so the two can be benchmarked on the same arrays. Sharding the cache
by KV heads (tensor parallelism) splits the leading axis. The kernels view one head's
cache as [num_blocks * block_size, head_dim] rows (a free reshape) and look a key's row
up as block_tables[s, j // block_size] * block_size + j % block_size, so block_size
need not be a power of 2 nor divide the kernels' KV tile.

Kernels (Pallas, Triton GPU backend; `interpret=True` by default on CPU):

- `paged_decode_attention`: one query token per sequence, split-K (flash-decoding).
- `ragged_paged_attention`: prefill, chunked prefill and mixed batches (query tiles).
- `mixed_paged_attention`: the engine's `pallas` backend; 1-token sequences to the
  decode kernel, the rest to the ragged kernel, one contract with the reference.
- KV write: XLA's scatter (`write_kv_reference`) on the donated cache, in place.

And one that is not attention: `grouped_matmul` (`grouped_matmul.py`), the MoE experts'
grouped matmul, `jax.lax.ragged_dot`'s contract over row tiles sorted by expert. Weight-only
quantized matmuls (int4 values, or int8, dequantized in registers): `int4_matmul.py` (dense
W4A16) and `grouped_int4_matmul.py` (the experts' W4A16 / W8A16 grouped matmul).
"""

from pallas_kernels.grouped_matmul import grouped_matmul, grouped_matmul_reference
from pallas_kernels.kv_cache_write import write_kv_reference
from pallas_kernels.mixed_attention import mixed_paged_attention
from pallas_kernels.paged_decode_attention import paged_decode_attention, paged_decode_attention_reference
from pallas_kernels.ragged_paged_attention import ragged_paged_attention, ragged_paged_attention_reference

__all__ = [
    "grouped_matmul",
    "grouped_matmul_reference",
    "mixed_paged_attention",
    "paged_decode_attention",
    "paged_decode_attention_reference",
    "ragged_paged_attention",
    "ragged_paged_attention_reference",
    "write_kv_reference",
]

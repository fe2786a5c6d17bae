"""Paged KV block bookkeeping on the host: which physical blocks each request owns.

The device cache itself is a fixed array of `num_blocks` blocks per layer (see
`pallas_kernels/__init__.py`); this module only hands out block ids.
"""

from __future__ import annotations

from collections import OrderedDict

from jaxvllm.request import Request


class BlockPool:
    """Fixed pool of block ids with reference counts and an O(1) free queue.

    The free queue is an insertion-ordered dict: allocation pops the oldest free block,
    freeing appends at the end, and (for prefix caching) a free block can be taken out
    of the middle in O(1) when it is hit again. `block_hashes` is the hook for prefix
    caching: the hash of a full block's contents, or None.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.block_hashes: list[bytes | None] = [None] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} blocks, {len(self._free)} free")
        blocks = [self._free.popitem(last=False)[0] for _ in range(n)]
        for b in blocks:
            self.ref_counts[b] = 1
            self.block_hashes[b] = None
        return blocks

    def free(self, blocks: list[int]) -> None:
        """Drop one reference from each block; blocks reaching zero join the free queue in order."""
        for b in blocks:
            if self.ref_counts[b] <= 0:
                raise RuntimeError(f"block {b} freed more often than allocated")
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self._free[b] = None


class KVCacheManager:
    """Per-request block lists over a `BlockPool` (vLLM V1's KVCacheManager, without prefix caching yet)."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.req_blocks: dict[str, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate_slots(self, request: Request, num_new_tokens: int) -> list[int] | None:
        """Make room for `num_new_tokens` more tokens of `request`; None when blocks run out.

        Returns the newly allocated block ids (possibly none); on None nothing changed.
        """
        blocks = self.req_blocks.setdefault(request.request_id, [])
        total = request.num_computed_tokens + num_new_tokens
        need = self.blocks_needed(total) - len(blocks)
        if need > self.pool.num_free_blocks:
            return None
        new = self.pool.allocate(need) if need > 0 else []
        blocks.extend(new)
        return new

    def free(self, request: Request) -> None:
        """Release a request's blocks, tail first, so that its head blocks stay longest in a cache."""
        blocks = self.req_blocks.pop(request.request_id, [])
        self.pool.free(blocks[::-1])

    def get_block_ids(self, request_id: str) -> list[int]:
        return self.req_blocks.get(request_id, [])

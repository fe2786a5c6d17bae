"""Paged KV block bookkeeping on the host: which physical blocks each request owns,
and which full blocks hold known contents (automatic prefix caching, as in vLLM V1).

The device cache itself is a fixed array of `num_blocks` blocks per layer (see
`pallas_kernels/__init__.py`); this module only hands out block ids.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from jaxvllm.request import Request, ScheduledBatch, ScheduledRequest


def _first_block_keys(request: Request) -> bytes:
    """What a request's first block hash adds to its tokens (and so every later block's,
    through the parents): its cache salt and LoRA adapter (id and reading), as vLLM's extra
    keys, so that requests with different salts or adapters never share cached KV. The
    salt's length comes first, so no salt can spell another salt with an adapter."""
    if not request.cache_salt and not request.lora_id:
        return b""
    salt = request.cache_salt.encode() if request.cache_salt else b""
    return (len(salt).to_bytes(8, "little") + salt + request.lora_id.to_bytes(8, "little")
            + request.lora_version.to_bytes(8, "little"))


def hash_block(parent: bytes | None, token_ids: Sequence[int], extra: bytes = b"") -> bytes:
    """Content hash of one full block: sha256 over the parent block's hash, the token ids
    and extra keys (the request's cache salt on its first block).

    A full-width 256-bit cryptographic hash: an accidental collision, which would let a
    request read another prefix's K/V, is as likely as guessing a sha256 preimage.
    """
    h = hashlib.sha256(parent if parent is not None else b"jaxvllm-root")
    h.update(array("q", token_ids).tobytes())  # int64, as numpy's (no numpy call: one per block filled)
    if extra:
        h.update(len(extra).to_bytes(8, "little") + extra)
    return h.digest()


class BlockPool:
    """Fixed pool of block ids with reference counts and an O(1) free queue.

    The free queue is an insertion-ordered dict, in eviction (LRU) order: allocation
    pops the oldest free block, freeing appends at the end, and a cached free block that
    is hit again is taken out of the middle in O(1). A freed block keeps its hash and
    contents until it is popped for reuse.

    Several blocks may hold the same contents (a full prompt hit recomputes its last
    block; two requests fill the same prefix at once). As vLLM's, each is registered: a
    lookup finds the first, and when it is evicted the next copy takes its place.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.block_hashes: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}  # hash -> the block a lookup finds
        self.copies: dict[bytes, dict[int, None]] = {}  # hash -> the other blocks with those contents, in order
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def free_blocks(self) -> list[int]:
        """Free block ids in eviction order (next to be reused first)."""
        return list(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} blocks, {len(self._free)} free")
        blocks = [self._free.popitem(last=False)[0] for _ in range(n)]
        for b in blocks:
            self._evict(b)
            self.ref_counts[b] = 1
        return blocks

    def _evict(self, block: int) -> None:
        h = self.block_hashes[block]
        if h is None:
            return
        self.block_hashes[block] = None
        copies = self.copies.get(h)
        if self.cached[h] != block:  # (a copy)
            del copies[block]
        elif copies:  # the next copy is found from now on
            self.cached[h] = next(iter(copies))
            del copies[self.cached[h]]
        else:
            del self.cached[h]
        if copies is not None and not copies:
            del self.copies[h]

    def touch(self, blocks: Sequence[int]) -> None:
        """Take a reference on cached blocks; a free one leaves the free queue in O(1)."""
        for b in blocks:
            if self.ref_counts[b] == 0:
                del self._free[b]
            self.ref_counts[b] += 1

    def free(self, blocks: Sequence[int]) -> None:
        """Drop one reference from each block; blocks reaching zero join the free queue in order."""
        for b in blocks:
            if self.ref_counts[b] <= 0:
                raise RuntimeError(f"block {b} freed more often than allocated")
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self._free[b] = None

    def cache(self, block: int, block_hash: bytes) -> bool:
        """Register a full block's contents; the first block with given contents stays the one
        found, later ones are its copies. Returns whether this block was registered."""
        if self.block_hashes[block] is not None:
            return False
        self.block_hashes[block] = block_hash
        if block_hash in self.cached:
            self.copies.setdefault(block_hash, {})[block] = None
        else:
            self.cached[block_hash] = block
        return True

    def uncache(self, block: int) -> None:
        """Forget a block's contents (they were never written)."""
        self._evict(block)

    def reset_prefix_cache(self) -> None:
        self.cached = {}  # (first: from here on no lookup finds a block)
        self.copies = {}
        self.block_hashes = [None] * self.num_blocks

    def release_all(self) -> None:
        """Every block free, made anew from the cache map alone: whatever a failure left half
        done (a block taken and not recorded, a reference dropped twice) is whole again.
        Free blocks keep their eviction order, then the others follow; cached ones stay cached."""
        self.ref_counts = [0] * self.num_blocks
        hashes: list[bytes | None] = [None] * self.num_blocks
        entries = [(h, b) for h, b in self.cached.items()] + [(h, b) for h, c in self.copies.items() for b in c]
        self.cached, self.copies = {}, {}
        for block_hash, block in entries:
            if hashes[block] is None and self.block_hashes[block] == block_hash:  # (else half made: forgotten)
                hashes[block] = block_hash
                if block_hash in self.cached:
                    self.copies.setdefault(block_hash, {})[block] = None
                else:
                    self.cached[block_hash] = block
        self.block_hashes = hashes
        order = list(self._free)
        self._free = OrderedDict.fromkeys(order + sorted(set(range(self.num_blocks)).difference(order)))


@dataclass
class PrefixCacheStats:
    """vLLM's: lookups at a request's first admission; those of a request readmitted (after
    a preemption or a failure) apart, as they find its own blocks."""

    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of those, tokens found in cached blocks
    preempted_queries: int = 0  # prompt and output tokens looked up on readmission
    preempted_hits: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManager:
    """Per-request block lists over a `BlockPool`, sharing cached full blocks (vLLM V1's KVCacheManager)."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self.req_blocks: dict[str, list[int]] = {}
        self._num_registered: dict[str, int] = {}  # how many of a request's blocks are in the cache map
        self._uncommitted: list[int] = []  # registered for a step not yet dispatched
        self.stats = PrefixCacheStats()

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        """The share of blocks in use (vLLM's KV cache usage)."""
        return 1 - self.pool.num_free_blocks / self.pool.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_hashes(self, request: Request) -> list[bytes]:
        """Hashes of the request's full blocks, extended as tokens are appended (kept across preemption)."""
        hashes, bs = request.block_hashes, self.block_size
        for i in range(len(hashes), request.num_tokens // bs):
            parent = hashes[-1] if hashes else None
            extra = _first_block_keys(request) if i == 0 else b""
            hashes.append(hash_block(parent, request.token_ids[i * bs : (i + 1) * bs], extra))
        return hashes

    def get_computed_blocks(self, request: Request) -> list[int]:
        """The longest run of cached blocks that prefixes the request (nothing is taken yet).

        At least the last token is left out, so that the step computes logits to sample from,
        and with prompt logprobs from position k on, the tokens from k - 1 on (the row of
        position p scores prompt token p + 1).
        """
        if not self.enable_prefix_caching or not request.read_prefix_cache:
            return []
        max_tokens = request.num_tokens - 1
        if request.prompt_logprobs_start is not None:
            max_tokens = min(max_tokens, request.prompt_logprobs_start - 1)
        max_blocks = max_tokens // self.block_size
        hits = []
        for h in self.block_hashes(request)[:max_blocks]:
            block = self.pool.cached.get(h)
            if block is None:
                break
            hits.append(block)
        return hits

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed_blocks: Sequence[int] = ()
    ) -> list[int] | None:
        """Make room for `num_new_tokens` more tokens of `request`, after `computed_blocks`
        (cache hits, on admission); None when blocks run out, and then nothing changed.

        Returns the newly allocated block ids. Nothing enters the prefix cache here: the
        step that writes the blocks may never run (the request may be preempted later in
        the same schedule); `cache_blocks` registers them once that is settled.
        """
        blocks = self.req_blocks.get(request.request_id, [])
        num_computed = request.num_computed_tokens + len(computed_blocks) * self.block_size
        total = num_computed + num_new_tokens
        need = self.blocks_needed(total) - len(blocks) - len(computed_blocks)
        reviving = sum(1 for b in computed_blocks if self.pool.ref_counts[b] == 0)
        if need > self.pool.num_free_blocks - reviving:
            return None
        self.req_blocks[request.request_id] = blocks
        self.pool.touch(computed_blocks)
        blocks.extend(computed_blocks)
        new = self.pool.allocate(need) if need > 0 else []
        blocks.extend(new)
        return new

    def grow(self, requests: Sequence[Request], num_blocks: Sequence[int]) -> bool:
        """Append `num_blocks[i]` new blocks to each running request's blocks, in order (the
        blocks `allocate_slots` would give them one after another); False, changing nothing,
        when fewer are free."""
        total = sum(num_blocks)
        if total > self.pool.num_free_blocks:
            return False
        new, req_blocks = self.pool.allocate(total), self.req_blocks
        end = 0
        for request, n in zip(requests, num_blocks):
            req_blocks[request.request_id].extend(new[end : end + n])
            end += n
        return True

    def cache_blocks(self, scheduled: ScheduledBatch | Iterable[ScheduledRequest], candidates=None) -> None:
        """Register the blocks that the scheduled chunks fill: call it once the step that
        computes them is certain to run (the scheduler does, once no more preemption can
        take a request out of the step). Device order then puts their writes before any
        later step's reads. Only tokens known on the host can be hashed; a block ending in
        a token still on the device waits for a later step.

        `candidates`: the indices of the chunks that may fill blocks not yet registered,
        when the caller knows the others do not (default: all of them)."""
        if not self.enable_prefix_caching:
            return
        if not isinstance(scheduled, ScheduledBatch):
            for s in scheduled:
                self._register(s.request, min(s.start + s.num_new_tokens, len(s.request.token_ids)) // self.block_size)
            return
        requests, registered = scheduled.requests, self._num_registered
        num_full = scheduled.host_ends // self.block_size
        if candidates is None:
            known = np.array([registered.get(r.request_id, 0) for r in requests], np.int64)
            candidates = np.flatnonzero(num_full > known)  # (requests that filled a block)
        for i in candidates.tolist():
            self._register(requests[i], int(num_full[i]))

    def _register(self, request: Request, num_full: int) -> None:
        """Enter a request's first `num_full` blocks (those not in yet) into the prefix cache."""
        start = self._num_registered.get(request.request_id, 0)
        if num_full <= start:
            return
        blocks, hashes = self.req_blocks[request.request_id], self.block_hashes(request)
        for i in range(start, num_full):
            if self.pool.cache(blocks[i], hashes[i]):
                self._uncommitted.append(blocks[i])
        self._num_registered[request.request_id] = num_full

    def commit(self) -> None:
        """The step of the blocks registered since the last commit is dispatched: keep them."""
        self._uncommitted.clear()

    def rollback(self) -> None:
        """The step of the blocks registered since the last commit failed before it was
        dispatched: forget them, so that nobody reads K/V that was never written. (Their
        requests are preempted by the engine's recovery, which frees the blocks.)"""
        for block in self._uncommitted:
            self.pool.uncache(block)
        self._uncommitted.clear()

    def record_prefix_hits(self, num_queried: int, num_hit: int, readmitted: bool) -> None:
        if not self.enable_prefix_caching:
            return
        if readmitted:
            self.stats.preempted_queries += num_queried
            self.stats.preempted_hits += num_hit
        else:
            self.stats.queries += num_queried
            self.stats.hits += num_hit

    def free(self, request: Request) -> None:
        """Release a request's blocks, tail first: its head blocks (the likeliest shared prefix)
        stay cached longest."""
        blocks = self.req_blocks.pop(request.request_id, [])
        self._num_registered.pop(request.request_id, None)
        self.pool.free(blocks[::-1])

    def release_all(self) -> None:
        """Every request gives up its blocks (after a failure, when all of them are
        recomputed): the pool is made anew, the prefix cache kept."""
        self.req_blocks.clear()
        self._num_registered.clear()
        self._uncommitted.clear()
        self.pool.release_all()

    def get_block_ids(self, request_id: str) -> list[int]:
        return self.req_blocks.get(request_id, [])

    def reset_prefix_cache(self) -> None:
        """Forget every cached block's contents (e.g. after changing weights); owners keep their blocks."""
        self.pool.reset_prefix_cache()
        self._uncommitted.clear()
        for rid in self._num_registered:
            self._num_registered[rid] = len(self.req_blocks.get(rid, []))  # don't re-register old blocks
        self.stats = PrefixCacheStats()

"""The adapters an engine serves: read ones on the host, and the device's slots.

vLLM's two caches: up to `max_cpu_loras` adapters kept read on the host (least recently
used dropped first, pinned ones never; a dropped one is read again from its folder when
next asked for), and `max_loras` device slots (`jaxvllm.lora.weights`). A step's adapters
take slots before it runs: one already there keeps its slot, another goes into a free
slot or the least recently used one that the step does not use, as one transfer and one
jitted write with the slot a traced index, so that a swap never recompiles.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from pathlib import Path
from typing import Iterable

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P, SingleDeviceSharding

from jaxvllm.lora.adapter import (CONFIG_FILE, WEIGHTS_FILE, LoRAAdapter, LoRATarget, lora_targets, read_adapter,
                                  slot_arrays)
from jaxvllm.lora.request import LoRARequest
from jaxvllm.lora.weights import write_slot
from jaxvllm.model_config import ModelConfig
from jaxvllm.models.common import ParamSpec
from jaxvllm.sharding import AXIS, param_partition, put


class LoRAManager:
    """The model runner's adapters: `stacks` (per target weight name, (A, (B per part)) with
    a slot axis after the rows, see `jaxvllm.lora.weights`) is what a step with adapters reads."""

    def __init__(self, specs: list[ParamSpec], cfg: ModelConfig, *, max_loras: int, max_rank: int,
                 max_cpu_loras: int, dtype, mesh: Mesh | None = None, device=None, kv_repeats: int = 1) -> None:
        self.targets: list[LoRATarget] = lora_targets(specs)
        self.max_loras, self.max_rank, self.max_cpu_loras, self.dtype = max_loras, max_rank, max_cpu_loras, dtype
        self.kv_repeats = kv_repeats  # (each checkpoint KV head's copies over devices)
        self.requests: dict[int, LoRARequest] = {}  # every adapter added, by id
        self.stamps: dict[int, tuple] = {}  # each added id's files (mtime, size) when read
        # Each added id's reading, numbered across the engine's life: a prefix cached with one
        # never serves another (an id removed and added again, or replaced, may be new weights).
        self.versions: dict[int, int] = {}
        self._readings = 0
        self.host: OrderedDict[int, LoRAAdapter] = OrderedDict()  # read ones, least recently used first
        self.pinned: set[int] = set()
        # Removed while requests used them, not read again since: forgotten once unused (`forget`).
        self.removed: set[int] = set()
        self.slot_loads = self.host_reads = 0
        shardings = {t.name: self._shardings(t, cfg, mesh, device) for t in self.targets}
        self._stack_shardings = {name: stack for name, (stack, _) in shardings.items()}
        self._slot_shardings = {name: slot for name, (_, slot) in shardings.items()}
        self._write = jax.jit(write_slot, donate_argnums=(0,), out_shardings=self._stack_shardings)
        self.clear_slots()

    def clear_slots(self) -> None:
        """Every device slot empty (zeros): at start, and after a failed write consumed them."""
        self.slot_ids: list[int | None] = [None] * self.max_loras  # each device slot's adapter
        self._slot_order: list[int] = list(range(self.max_loras))  # least recently used slot first

        def zeros(shape, sharding):
            return put(np.zeros((shape[0], self.max_loras, *shape[1:]), self.dtype), sharding)

        self.stacks = {t.name: jax.tree.map(zeros, t.slot_shapes(self.max_rank), self._stack_shardings[t.name],
                                            is_leaf=_is_shape) for t in self.targets}

    @staticmethod
    def _shardings(t: LoRATarget, cfg: ModelConfig, mesh: Mesh | None, device) -> tuple:
        """Placements of (A, (B per part)): of the stacks, and of one slot's arrays. A split
        weight's out axes split B (column-parallel; a merged weight's parts on their first
        axis, its heads or columns), its in axes A (row-parallel), as vLLM splits them."""
        parts = len(t.part_out)
        if mesh is None:
            single = SingleDeviceSharding(device or jax.devices()[0])
            one = (single, (single,) * parts)
            return one, one
        split = tuple(param_partition(("layers", t.name), cfg, mesh.size))
        split += (None,) * (len(t.out) + len(t.inputs) - len(split))
        column = any(split[: len(t.out)])
        inputs = split[len(t.out):]
        a = (None, None, *inputs)  # one slot: [rows, R, *in]
        b = [(None, *(split[: len(t.out)] if parts == 1 else (AXIS if column else None,)), None) for _ in range(parts)]
        named = lambda spec: NamedSharding(mesh, P(*spec))  # noqa: E731
        stacked = lambda spec: named((spec[0], None, *spec[1:]))  # noqa: E731
        return (stacked(a), tuple(map(stacked, b))), (named(a), tuple(map(named, b)))

    # -- the host cache ------------------------------------------------------------------

    def add(self, request: LoRARequest, replace: bool = False) -> bool:
        """Read an adapter (checked against the model) unless held; False if it was.
        `replace`: an id held from another folder, or from files changed since, is read
        again and replaces the old one, in its device slot too (an adapter trained further,
        under the same id: adapter-only RL)."""
        lora_id = request.lora_int_id
        known = self.requests.get(lora_id)
        if known is not None and not _same_folder(known, request) and not replace:
            raise ValueError(f"lora_int_id {lora_id} is adapter {known.lora_name!r} ({known.lora_path}); "
                             f"{request.lora_name!r} ({request.lora_path}) needs an id of its own")
        new_reading = known is None or (replace and self.changes(request))
        if not new_reading and lora_id in self.host:
            self.host.move_to_end(lora_id)
            return False
        stamp = _stamp(request)  # (before reading: a save that lands meanwhile counts as a change)
        adapter = read_adapter(request, self.targets, self.max_rank, self.kv_repeats)
        if new_reading:
            self._readings += 1
            self.versions[lora_id], self.stamps[lora_id] = self._readings, stamp
        self.requests[lora_id] = request
        self._keep(adapter)
        if new_reading and lora_id in self.slot_ids:
            self._load(lora_id, self.slot_ids.index(lora_id))
        return known is None

    def changes(self, request: LoRARequest) -> bool:
        """Whether `request` is new weights for its id: an id not held, another folder,
        or files written since the id's were read."""
        known = self.requests.get(request.lora_int_id)
        return known is None or not _same_folder(known, request) or self.stamps[request.lora_int_id] != _stamp(request)

    def _keep(self, adapter: LoRAAdapter) -> None:
        self.host[adapter.request.lora_int_id] = adapter
        self.removed.discard(adapter.request.lora_int_id)  # (read again for its requests: held, as vLLM's)
        self.host_reads += 1
        for lora_id in list(self.host):
            if len(self.host) <= self.max_cpu_loras:
                break
            if lora_id not in self.pinned and lora_id != adapter.request.lora_int_id:
                del self.host[lora_id]

    def remove(self, lora_id: int, in_use: bool = False) -> bool:
        """Forget an adapter held on the host (and its device slot); False if none is, as
        vLLM's (whose registered adapters are its host cache). `in_use`: unfinished requests
        run with it; as in vLLM, they go on, the adapter read again from its folder when
        next loaded."""
        if lora_id not in self.host:
            return False
        self.host.pop(lora_id)
        self.pinned.discard(lora_id)
        self.slot_ids = [None if s == lora_id else s for s in self.slot_ids]
        if in_use:
            self.removed.add(lora_id)
        else:
            self.forget(lora_id)
        return True

    def forget(self, lora_id: int) -> None:
        """Drop an id's folder and reading (an adapter removed, or removed while in use and
        unused since): the id may name any folder next, read as new weights."""
        self.requests.pop(lora_id, None)
        self.versions.pop(lora_id, None)
        self.stamps.pop(lora_id, None)
        self.removed.discard(lora_id)

    def pin(self, lora_id: int) -> bool:
        """Keep an adapter held on the host there and, once loaded, on the device."""
        if lora_id not in self.host:  # (vLLM's words)
            raise ValueError(f"Pinning failed. LoRA {lora_id} is not registered.")
        if lora_id not in self.pinned and len(self.pinned) >= self.max_loras:
            raise ValueError(f"already {len(self.pinned)} adapters pinned, as many as max_loras={self.max_loras}")
        self.pinned.add(lora_id)
        return True

    def list(self) -> set[int]:
        """The adapters held on the host (`max_cpu_loras` at most, least recently used ones
        dropped), as vLLM's `list_loras`; an adapter dropped is read again when a request uses it."""
        return set(self.host)

    # -- device slots ----------------------------------------------------------------------

    def slots_for(self, lora_ids: Iterable[int]) -> dict[int, int]:
        """Each adapter id (> 0) of a step -> its device slot, loading those not there.
        At most `max_loras` distinct ids (the scheduler's promise)."""
        wanted = sorted(set(lora_ids) - {0})
        if len(wanted) > self.max_loras:
            raise ValueError(f"{len(wanted)} adapters in one step; max_loras is {self.max_loras}")
        slots = {lora_id: self.slot_ids.index(lora_id) for lora_id in wanted if lora_id in self.slot_ids}
        for lora_id in wanted:
            if lora_id not in slots:
                slots[lora_id] = slot = self._free_slot(set(slots.values()))
                self._load(lora_id, slot)
        for slot in slots.values():  # most recently used last
            self._slot_order.remove(slot)
            self._slot_order.append(slot)
        return slots

    def _free_slot(self, taken: set[int]) -> int:
        free = [s for s in self._slot_order if s not in taken]
        empty = [s for s in free if self.slot_ids[s] is None]
        unpinned = [s for s in free if self.slot_ids[s] not in self.pinned]
        return (empty or unpinned or free)[0]

    def _load(self, lora_id: int, slot: int) -> None:
        adapter = self.host.get(lora_id)
        if adapter is None:  # dropped from the host cache: read again
            if lora_id not in self.requests:
                raise ValueError(f"LoRA adapter {lora_id} is not known to the engine (removed?)")
            adapter = read_adapter(self.requests[lora_id], self.targets, self.max_rank, self.kv_repeats)
            self._keep(adapter)
        else:
            self.host.move_to_end(lora_id)
        arrays = slot_arrays(adapter, self.targets, self.max_rank, self.dtype)
        arrays = jax.tree.map(put, arrays, self._slot_shardings)
        self.slot_ids[slot] = None  # (a failed write leaves the slot empty, never half-written)
        try:
            self.stacks = self._write(self.stacks, np.int32(slot), arrays)
        except BaseException:  # (the stacks are donated: a failed write may have consumed them)
            if any(x.is_deleted() for x in jax.tree.leaves(self.stacks)):
                self.clear_slots()
            raise
        self.slot_ids[slot] = lora_id
        self.slot_loads += 1

    def compile_write(self) -> None:
        """Compile the slot write (the warm-up's), so that no load compiles."""
        one = {t.name: jax.tree.map(lambda shape, s: jax.ShapeDtypeStruct(shape, self.dtype, sharding=s),
                                    t.slot_shapes(self.max_rank), self._slot_shardings[t.name], is_leaf=_is_shape)
               for t in self.targets}
        self._write.lower(self.stacks, np.int32(0), one).compile()

    def arrays(self) -> list:
        return jax.tree.leaves(self.stacks)



def _same_folder(a: LoRARequest, b: LoRARequest) -> bool:
    return os.path.abspath(a.lora_path) == os.path.abspath(b.lora_path)


def _stamp(request: LoRARequest) -> tuple:
    """The adapter's files as (mtime, size) each: a retrained save changes them."""
    stamp = []
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        try:
            st = (Path(request.lora_path) / name).stat()
            stamp.append((st.st_mtime_ns, st.st_size))
        except OSError:
            stamp.append(None)
    return tuple(stamp)


def _is_shape(x) -> bool:
    return isinstance(x, tuple) and bool(x) and isinstance(x[0], int)

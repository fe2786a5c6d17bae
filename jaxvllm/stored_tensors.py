"""Views of a checkpoint's tensors as the loader reads them: each presents HF's layout
([out, in] for a weight, [out, groups] for its scales) and is indexed with slices as
safetensors' `get_slice` is, so that each device reads only its block, whatever the
format stores.

- `RawSlice`: a float8 tensor (safetensors' numpy reader has none), as a memory map.
- `RowRepeat`: block scales [out / block, ...] with each row repeated over its block;
  `OneValue`: a per-tensor scale as one such block.
- `PackedView`: 4- or 8-bit values in int32 words (GPTQ, AWQ, compressed-tensors), as signed
  values; `packed_view` says which layout each format's tensors have; `act_order` reads GPTQ's
  act-order groups as a permutation of the inputs.
"""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np

RAW_DTYPES = {"F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2}
# AutoAWQ interleaves each int32 word: the value of column c of 8 sits in nibble AWQ_NIBBLE[c].
AWQ_NIBBLE = (0, 4, 1, 5, 2, 6, 3, 7)


def safetensors_header(file: Path) -> tuple[int, dict]:
    """Where a safetensors file's data starts, and its header (each tensor's dtype, shape and offsets)."""
    with open(file, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        return 8 + size, json.loads(f.read(size))


class RawSlice:
    """A float8 tensor of a safetensors file (an 8-byte header length, the JSON header, then
    the data), read as a numpy memory map of the file's own layout."""

    def __init__(self, file: Path, name: str, data_start: int, header: dict) -> None:
        entry = header[name]
        begin, end = entry["data_offsets"]
        shape, dtype = tuple(entry["shape"]), RAW_DTYPES[entry["dtype"]]
        self.array = (np.memmap(file, dtype=dtype, mode="r", offset=data_start + begin, shape=shape)
                      if end > begin else np.zeros(shape, dtype))

    def get_shape(self) -> list[int]:
        return list(self.array.shape)

    def __getitem__(self, index):
        return self.array[index]


class RowRepeat:
    """A block-scale tensor [rows / block, ...] read as [rows, ...]: each of its rows repeated
    over its block (the last block may be partial), so block scales take a weight's layout."""

    def __init__(self, tensor_slice, block: int, rows: int) -> None:
        self.slice, self.block, self.rows = tensor_slice, block, rows

    def get_shape(self) -> list[int]:
        return [self.rows, *self.slice.get_shape()[1:]]

    def __getitem__(self, index: tuple[slice, ...]) -> np.ndarray:
        lo, hi = index[0].indices(self.rows)[:2]
        first = lo // self.block
        blocks = np.asarray(self.slice[(slice(first, (hi - 1) // self.block + 1), *index[1:])])
        return blocks[np.arange(lo, hi) // self.block - first]


class PackedView:
    """A 2-D tensor read as `shape` (HF's layout), stored transposed or not, and with `bits`-bit
    values (4 or 8) packed along `packed_axis` (of `shape`) into int32 words, 32 / bits to a
    word, the value of position c in slot `slots[c]` of its word (slot k: the `bits` bits
    from bit k * bits; low slot first by default), each read as int16 minus `offset` (what
    makes the format's unsigned values signed)."""

    def __init__(self, tensor_slice, name: str, shape: tuple[int, int], *, transposed: bool = False,
                 packed_axis: int | None = None, bits: int = 4, slots: tuple[int, ...] | None = None,
                 offset: int = 0, columns: np.ndarray | None = None) -> None:
        self.per_word = 32 // bits
        stored = list(shape)
        if packed_axis is not None:
            stored[packed_axis] = -(-shape[packed_axis] // self.per_word)
        stored = tuple(reversed(stored) if transposed else stored)
        got = tuple(tensor_slice.get_shape())
        if got != stored:
            raise ValueError(f"tensor {name} has shape {got}, config.json implies {stored}")
        if packed_axis is not None and tensor_slice.get_dtype() != "I32":
            raise ValueError(f"tensor {name} is {tensor_slice.get_dtype()}; packed {bits}-bit values are int32 words "
                             f"(I32)")
        self.slice, self.shape, self.transposed, self.packed_axis = tensor_slice, shape, transposed, packed_axis
        slots = range(self.per_word) if slots is None else slots
        self.shifts, self.mask = bits * np.asarray(slots, np.uint32), np.uint32((1 << bits) - 1)
        self.offset, self.columns = offset, columns

    def get_shape(self) -> list[int]:
        return list(self.shape)

    def __getitem__(self, index: tuple[slice, ...]) -> np.ndarray:
        ranges = [sl.indices(n)[:2] for sl, n in zip(index, self.shape)]
        if self.columns is None:
            return self._read(ranges)
        # columns out of order: all of them read, those asked for taken
        return self._read([ranges[0], (0, self.shape[1])])[:, self.columns[slice(*ranges[1])]]

    def _read(self, ranges: list[tuple[int, int]]) -> np.ndarray:
        """The block [a, b) of each axis of `shape`, in the stored order of columns."""
        stored_index = [slice(a, b) for a, b in ranges]
        if self.packed_axis is not None:
            lo, hi = ranges[self.packed_axis]
            stored_index[self.packed_axis] = slice(lo // self.per_word, -(-hi // self.per_word))
        if self.transposed:
            stored_index.reverse()
        block = np.asarray(self.slice[tuple(stored_index)])
        block = block.T if self.transposed else block
        if self.packed_axis is None:
            return block
        words = np.moveaxis(block, self.packed_axis, -1).astype(np.uint32)
        values = ((words[..., None] >> self.shifts) & self.mask).reshape(*words.shape[:-1], -1)
        first = lo % self.per_word
        values = values[..., first : first + hi - lo].astype(np.int16) - np.int16(self.offset)
        return np.moveaxis(values, -1, self.packed_axis)


class OneValue:
    """A one-value tensor (stored [1] or []) read as `shape` (all ones: [1, 1])."""

    def __init__(self, tensor_slice, name: str, shape: tuple[int, ...]) -> None:
        got = tuple(tensor_slice.get_shape())
        if int(np.prod(got)) != 1:
            raise ValueError(f"tensor {name} has shape {got}; a per-tensor scale has one value")
        self.slice, self.shape = tensor_slice, shape

    def get_shape(self) -> list[int]:
        return list(self.shape)

    def __getitem__(self, index):
        return np.asarray(self.slice[...]).reshape(self.shape)[index]


def act_order(g_idx: np.ndarray, group: int, name: str) -> np.ndarray:
    """The permutation that makes GPTQ's act-order groups runs: input j of the permuted
    weight is input perm[j] of the checkpoint's, and inputs [g * group, (g + 1) * group)
    are group g's; an error unless every group has `group` inputs."""
    g_idx = np.asarray(g_idx).astype(np.int64)
    counts = np.bincount(g_idx, minlength=-(-len(g_idx) // group))
    if (counts != group).any():
        raise ValueError(f"tensor {name} gives groups of {sorted(set(counts.tolist()))} inputs; act-order needs "
                         f"groups of group_size {group}")
    return np.argsort(g_idx, kind="stable").astype(np.int32)


def packed_view(fmt, name: str, tensor_slice, shape: tuple[int, ...], perms: dict | None = None):
    """`tensor_slice` as `jaxvllm.quantization.CheckpointFormat` `fmt` stores it, read in HF's
    layout (`shape`): b-bit values and zero points signed (value - 2^(b-1): 8 for 4 bits, 128
    for 8), so that `(value - zero) * scale` is the weight.
    - GPTQ (4 or 8 bits): `qweight` [in / (32 / b), out], packed along in; `qzeros` [groups,
      out / (32 / b)] packed along out, each one less than the zero point in the original
      ("gptq") checkpoint format; `scales` [groups, out].
    - AWQ: `qweight` [in, out / 8] and `qzeros` [groups, out / 8], both packed along out in
      AutoAWQ's interleaved order; `scales` [groups, out].
    - compressed-tensors: `weight_packed` [out, in / 8] packed along in, `weight_zero_point`
      [out / 8, groups] packed along out, both stored plus 8; `weight_scale` [out, groups].
    `perms`: each act-order module's permutation (`act_order`), its values read in that order."""
    role = name.rsplit(".", 1)[-1]
    if fmt.block[0] == 0 and role == fmt.scale_name:  # one scale a tensor, stored [1] or []
        return OneValue(tensor_slice, name, shape)
    if not fmt.packing:
        return tensor_slice
    ct = fmt.packing == "compressed-tensors"
    bits = ml_dtypes.iinfo(fmt.value_dtype).bits
    slots, half = AWQ_NIBBLE if fmt.packing == "awq" else None, 1 << (bits - 1)
    if role == fmt.value_name:
        return PackedView(tensor_slice, name, shape, transposed=not ct, packed_axis=0 if fmt.packing == "awq" else 1,
                          bits=bits, slots=slots, offset=half, columns=(perms or {}).get(name.rsplit(".", 1)[0]))
    if role == fmt.zero_name:
        return PackedView(tensor_slice, name, shape, transposed=not ct, packed_axis=0, bits=bits, slots=slots,
                          offset=half - 1 if fmt.packing == "gptq" else half)
    if role == fmt.scale_name and not ct:
        return PackedView(tensor_slice, name, shape, transposed=True)
    return tensor_slice

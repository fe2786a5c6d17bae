"""New weights into a loaded model's params, in place of the old (`LLM.update_weights`):
HF tensors by name, as vLLM's `load_weights` takes them, turned into the params' layout
on the device.

Each HF tensor name maps to one place in the params (`weight_index`): a parameter, or one
layer's row of a stack (or element of a list), a part of a merged parameter (the CPU's
qkv_proj, gate_up_proj), one expert of a stack. The new value is made with jnp from the
tensor where it already lies (a jax array is never moved through the host): HF's [out,
in] reshaped to the head-explicit layout, K/V heads repeated as under tensor parallelism,
experts transposed, merged with the parts not updated, written into its row of the stack,
cast, and placed on the param's own sharding. A value on other devices than its param is
moved there first (device to device). The params never share a buffer with the caller's
arrays (as vLLM's `load_weights` copies into its own): a trainer may donate its arrays to
its next step. Every name and shape is checked before any param changes, so a bad one
changes nothing.
"""

from __future__ import annotations

import hashlib
import zlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxvllm.layers import InputMajorWeight
from jaxvllm.loader import KV_SCALE_NAME, repeated_kv
from jaxvllm.model_config import KV_GROUPS, SIDE_BY_SIDE
from jaxvllm.models.common import ParamSpec, merge_parts
from jaxvllm.quantization import EXPERT_STACK, EXPERTS, QuantizedWeight, in_axes, quantize_online
from jaxvllm.sharding import gather_over_processes, put


@dataclass(frozen=True)
class Place:
    """Where one HF tensor goes: the parameter (`spec`), the row of its stack or list (None:
    not a layer parameter), the part of a merged one, and the expert of an expert stack
    (None: all of them). `fused`: the tensor under transformers 5's own name and shape
    (`ParamSpec.fused_name`; an expert stack's: [E, out of every part, in])."""

    spec: ParamSpec
    row: int | None
    part: int
    expert: int | None = None
    fused: bool = False

    @property
    def member(self) -> ParamSpec:
        member = self.spec.layers[self.row] if self.row is not None else self.spec
        return member.parts[self.part] if member.parts else member

    @property
    def hf_shape(self) -> tuple[int, ...]:
        member = self.member
        return tuple(member.fused_shape if self.fused else member.hf_shape)


@dataclass
class Experts:
    """Experts of one stack given so far (expert -> [in, out]), and the stack's place."""

    place: Place
    rows: dict[int, jax.Array]


def weight_index(specs: list[ParamSpec]) -> dict[str, list[Place]]:
    """HF tensor name -> the places it fills (several for a fused expert tensor of gate and up)."""
    index: dict[str, list[Place]] = {}
    for spec in specs:
        if spec.init == "rows":
            continue
        for row, member in enumerate(spec.layers) if spec.layers else [(None, spec)]:
            for p, part in enumerate(member.parts or (member,)):
                if part.stacked:
                    for j in range(part.stacked):
                        index.setdefault(part.hf_name.format(j), []).append(Place(spec, row, p, j))
                else:
                    index.setdefault(part.hf_name, []).append(Place(spec, row, p))
                if part.fused_name:  # transformers 5's own name (and layout) of the same tensor
                    index.setdefault(part.fused_name, []).append(Place(spec, row, p, fused=True))
    return index


def named_tensors(weights: Any) -> list[tuple[str, Any]]:
    """(HF name, array) pairs from pairs, a mapping, or a pytree whose key paths are the
    names (a `flax.nnx.State`, nested dicts): path keys joined with dots."""
    if isinstance(weights, Mapping) and all(isinstance(k, str) for k in weights) and not any(
            isinstance(v, Mapping) for v in weights.values()):
        return list(weights.items())
    if isinstance(weights, Iterable) and not isinstance(weights, Mapping):
        pairs = list(weights)
        if all(isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str) for p in pairs):
            return pairs
        raise TypeError("weights must be (name, array) pairs, a mapping of names to arrays, or a pytree of them")
    leaves = jax.tree_util.tree_flatten_with_path(weights, is_leaf=_is_tensor)[0]
    return [(".".join(_key(k) for k in path), leaf) for path, leaf in leaves]


def _is_tensor(x) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype")


def _key(k) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def as_jax(array) -> jax.Array:
    """A jax array of `array` where it lies: jax as it is, numpy and torch (CPU) onto the
    default device."""
    if isinstance(array, jax.Array):
        return array
    return jax.device_put(_host(array))  # (jnp.asarray converts on the host first: several times slower)


def _host(array) -> np.ndarray:
    """A numpy array of a host value (torch's bfloat16, which numpy lacks, as float32: exact)."""
    if type(array).__module__.startswith("torch"):
        array = array.detach().cpu()
        return array.float().numpy() if str(array.dtype) == "torch.bfloat16" else array.numpy()
    return np.asarray(array)


def across_processes(pairs: list[tuple[str, Any]], place: NamedSharding) -> list[tuple[str, jax.Array]]:
    """Under jax.distributed every process calls update_weights, and the update's eager ops
    are collectives: the processes must give the same tensors, in the same order. That is
    checked first (one host collective over a digest of names, shapes, dtypes and host
    values), then each value becomes a global array over the engine's devices (`place`,
    replicated): a global array on those devices as it is (a multi-controller trainer's:
    each process holds its own shards), a host array from each process's copy. A global
    array on other devices (a data-parallel replica spans only some) is gathered through
    the host: JAX reshards across processes only within one set of devices."""
    pairs = [(name, a if isinstance(a, jax.Array) and not a.is_fully_addressable else _host(a)) for name, a in pairs]
    digest = hashlib.blake2b(digest_size=8)
    for name, a in pairs:
        digest.update(repr((name, tuple(a.shape), str(a.dtype))).encode())
        if isinstance(a, np.ndarray):
            digest.update(zlib.crc32(np.ascontiguousarray(a).view(np.uint8)).to_bytes(4, "little"))
        else:
            digest.update(repr(sorted(d.id for d in a.sharding.device_set)).encode())
    digests = gather_over_processes(int.from_bytes(digest.digest(), "little", signed=True))
    if len(set(digests)) > 1:
        raise RuntimeError(
            f"update_weights: the {len(digests)} processes gave different tensors (names, shapes, dtypes or values): "
            "under jax.distributed every process must give the same ones, in the same order (a global array's own "
            "shards, or the same host array); nothing changed")

    def placed(a):
        if isinstance(a, jax.Array) and a.sharding.device_set == place.device_set:
            return a
        if isinstance(a, jax.Array):
            a = np.asarray(multihost_utils.process_allgather(a, tiled=True))
        return put(a, place)

    return [(name, placed(a)) for name, a in pairs]


# RoPE tables some checkpoints save (older HF saves hold inv_freq): computed, not weights,
# so accepted and not used, as vLLM's `load_weights` skips them. So are an fp8 KV cache's
# scales (`loader.KV_SCALE_NAME`), which a checkpoint folder pushed back may hold: the cache
# keeps the scales it started with, as vLLM's, which sets them once after loading.
ROPE_BUFFERS = (".rotary_emb.inv_freq", ".rotary_emb.cos_cached", ".rotary_emb.sin_cached")


def _skipped(name: str, skip: frozenset) -> bool:
    return name in skip or name.endswith(ROPE_BUFFERS) or KV_SCALE_NAME.fullmatch(name) is not None


def check(pairs: list[tuple[str, Any]], index: dict[str, list[Place]], skip: frozenset) -> None:
    """Every name known (or in `skip`, or a RoPE table: accepted, not used) and every shape
    HF's; raises naming the first bad tensor, before anything changes."""
    seen = set()
    filled: dict[tuple, tuple[str, int | None]] = {}  # (param, row, part) -> the first name given for it, its expert
    for name, array in pairs:
        if _skipped(name, skip):
            continue
        if name not in index:
            raise ValueError(f"update_weights: {name!r} is not a weight of this model")
        if name in seen:
            raise ValueError(f"update_weights: {name!r} is given twice")
        seen.add(name)
        for place in index[name]:  # (an expert stack under its fused name and its per-expert ones)
            other, expert = filled.setdefault((place.spec.path, place.row, place.part), (name, place.expert))
            if other != name and (expert is None or place.expert is None or expert == place.expert):
                raise ValueError(f"update_weights: {name!r} and {other!r} are the same weight, given twice")
        if not _is_tensor(array):
            raise TypeError(f"update_weights: {name} is a {type(array).__name__}, not an array")
        want = index[name][0].hf_shape
        if tuple(array.shape) != want:
            raise ValueError(f"update_weights: {name} has shape {tuple(array.shape)}; the model's is {want}")
        if "float" not in str(array.dtype):
            raise ValueError(f"update_weights: {name} has dtype {array.dtype}; a floating-point tensor is expected")


def updated_params(params: dict, pairs: list[tuple[str, Any]], index: dict[str, list[Place]], repeats: int,
                   skip: frozenset = frozenset(), quantization: str | None = None,
                   dtype=jnp.float32) -> tuple[dict, int]:
    """New params with the given tensors in place (the old ones untouched), and how many
    tensors went in. `repeats`: how many times each checkpoint KV head is repeated.
    `quantization`: the online method (`quantization.ONLINE`) the linear weights were
    quantized with at load; the new ones are quantized alike (a part of a merged weight
    alone: each output row is scaled alone), from the engine's `dtype` (as the loader
    quantizes them: a float32 tensor rounded to it first)."""
    check(pairs, index, skip)
    # The new values of each member (a param, a stack's row, a list's element), part by part.
    members: dict[tuple, dict[int, jax.Array]] = {}
    count = 0
    for name, array in pairs:
        if _skipped(name, skip):
            continue
        count += 1
        value = _beside(as_jax(array), jax.tree.leaves(_get(params, index[name][0].spec.path))[0])
        for place in index[name]:
            parts = members.setdefault((place.spec.path, place.row), {})
            if place.expert is not None:  # one expert of a stack: the stack is made once, below
                parts.setdefault(place.part, Experts(place, {})).rows[place.expert] = value.T
            else:
                parts[place.part] = _part_value(place, value, repeats)
    # Each param's new members by row (None: the param itself), then each param made once.
    rows: dict[tuple, dict] = {}
    specs = {p.spec.path: p.spec for places in index.values() for p in places}
    for (path, row), parts in members.items():
        spec, old = specs[path], _get(params, path)
        member = spec.layers[row] if row is not None else spec
        quantized = isinstance(old[0] if isinstance(old, list) else old, QuantizedWeight)
        for p, part in parts.items():
            if not isinstance(part, Experts):
                continue
            if len(part.rows) == part.place.member.stacked:  # [E, in, out]: every expert given
                parts[p] = jnp.stack([part.rows[j] for j in range(len(part.rows))])
            elif quantized:
                raise ValueError(f"update_weights: {path[-1]} of layer {row} is quantized ({quantization}): give "
                                 f"every expert of it, not {len(part.rows)} of {part.place.member.stacked}")
            else:  # the given experts into the stack, at once
                parts[p] = _with_rows(_current_part(part.place, params), part.rows)
        if quantized:  # as the loader quantized it: the online methods scale each output row
            # alone, so each part quantizes as it does merged (and a part not given keeps its values)
            num_in = EXPERT_STACK if path[-1] in EXPERTS else in_axes(member.shape, member.hf_shape)
            parts = {p: quantize_online(v.astype(dtype), num_in, quantization) for p, v in parts.items()}
        rows.setdefault(path, {})[row] = _merged(member, parts, lambda: _member(old, row))
    new = dict(params)  # (shallow: only the replaced arrays differ, the old params stay as they were)
    new["layers"] = dict(params["layers"])
    for path, values in rows.items():
        old = _get(params, path)
        if None in values:
            value = _placed_as(old, values[None])
        elif isinstance(old, list):
            value = [_placed_as(x, values[r]) if r in values else x for r, x in enumerate(old)]
        else:  # one write of the stack: its rows, new or old, joined by static slices (a quantized
            # weight: each of its arrays so)
            leaves = jax.tree.leaves(old)
            new_rows = [jax.tree.leaves(values[r]) for r in sorted(values)]
            value = jax.tree.unflatten(jax.tree.structure(old), [
                jax.device_put(_with_rows(o, {r: v[i].astype(o.dtype) for r, v in zip(sorted(values), new_rows)}),
                               o.sharding) for i, o in enumerate(leaves)])
        _set(new, path, value)
    return new, count


def _beside(value: jax.Array, param: jax.Array) -> jax.Array:
    """`value` on the devices `param` lies on (replicated over them), moved there if it is
    elsewhere: it is merged with the param's old parts, which computes where those lie."""
    if value.sharding.device_set == param.sharding.device_set:
        return value
    sharding = param.sharding
    return jax.device_put(value, NamedSharding(sharding.mesh, P()) if isinstance(sharding, NamedSharding) else sharding)


def _placed_as(old, value):
    """`value` (an array or a `QuantizedWeight`) cast and placed as `old` is, with its meta
    (a weight of an `InputMajorWeight` moved inputs first as it is); a copy, never the
    caller's own buffer."""
    if isinstance(old, InputMajorWeight) and not isinstance(value, InputMajorWeight):
        value = InputMajorWeight.of(value, old.num_in)
    return jax.tree.unflatten(jax.tree.structure(old), [
        jax.device_put(v.astype(o.dtype), o.sharding, may_alias=False)
        for o, v in zip(jax.tree.leaves(old), jax.tree.leaves(value))])


def _part_value(place: Place, value: jax.Array, repeats: int) -> jax.Array:
    """One part of a member in our layout: the HF tensor reshaped (K/V heads repeated), or
    transformers 5's fused expert tensor [E, out of every part, in] as our [E, in, out]."""
    part = place.member
    if place.fused and part.stacked:
        out = part.shape[-1]
        return jnp.swapaxes(jax.lax.slice_in_dim(value, part.fused_row, part.fused_row + out, axis=1), 1, 2)
    repeated = repeats > 1 and repeated_kv(part)
    value = value.reshape(part.shape)
    return jnp.repeat(value, repeats, axis=0) if repeated else value


def _current_part(place: Place, params: dict) -> jax.Array:
    """The part's value now (an expert stack, before one expert of it is replaced)."""
    member = _member(_get(params, place.spec.path), place.row)
    spec_member = place.spec.layers[place.row] if place.row is not None else place.spec
    return split_parts(spec_member, member)[place.part] if spec_member.parts else member


def _merged(member: ParamSpec, parts: dict, old):
    """The member's new value: its parts joined as the loader joins them, the parts not
    given taken from its value now (`old()`). Parts may be `QuantizedWeight`s: each of
    their arrays (values, scales: output axes first) is split and joined alike."""
    if not member.parts:
        return parts[0]
    if len(parts) < len(member.parts):
        now = old()
        splits = [split_parts(member, leaf) for leaf in jax.tree.leaves(now)]
        current = [jax.tree.unflatten(jax.tree.structure(now), [s[p] for s in splits]) for p in range(len(member.parts))]
        parts = {p: parts.get(p, current[p]) for p in range(len(member.parts))}
    given = [parts[p] for p in range(len(member.parts))]
    leaves = [jax.tree.leaves(part) for part in given]
    return jax.tree.unflatten(jax.tree.structure(given[0]),
                              [merge_parts(member.merge, list(column)) for column in zip(*leaves)])


# Rows by static slices: an index given to the device would be a host-to-device transfer.
def _member(param, row: int | None):
    """A layer's member of a stack (or list), or the param itself (row None); an
    `InputMajorWeight`'s weight in HF's order."""
    if row is None or isinstance(param, list):
        member = param if row is None else param[row]
        return member.weight() if isinstance(member, InputMajorWeight) else member
    return jax.lax.index_in_dim(param, row, keepdims=False)


def _with_rows(stack: jax.Array, rows: dict[int, jax.Array]) -> jax.Array:
    """`stack` with rows replaced: one concatenate of the new rows and the old runs between."""
    pieces, start = [], 0
    for row in sorted(rows):
        if row > start:
            pieces.append(jax.lax.slice_in_dim(stack, start, row))
        pieces.append(rows[row][None])
        start = row + 1
    if start < stack.shape[0]:
        pieces.append(jax.lax.slice_in_dim(stack, start, stack.shape[0]))
    return jnp.concatenate(pieces)


def split_parts(member: ParamSpec, value: jax.Array) -> list[jax.Array]:
    """`merge_parts` undone: a merged parameter's parts (K/V as repeated)."""
    if member.merge == SIDE_BY_SIDE:
        return [jax.lax.index_in_dim(value, p, keepdims=False) for p in range(len(member.parts))]
    assert member.merge == KV_GROUPS, member.merge
    heads, group = value.shape[0], value.shape[1] - 2
    q = jax.lax.slice_in_dim(value, 0, group, axis=1).reshape(heads * group, *value.shape[2:])
    return [q, *(jax.lax.index_in_dim(value, group + j, axis=1, keepdims=False) for j in (0, 1))]


def _get(params: dict, path: tuple):
    node = params
    for key in path:
        node = node[key]
    return node


def _set(params: dict, path: tuple, value) -> None:
    node = params
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value



def same_layout(params: dict, weights: Any) -> bool:
    """Whether `weights` is a pytree of the params' own structure (`LLM.get_params()`'s,
    trained by a JAX trainer) rather than HF-named tensors."""
    return isinstance(weights, Mapping) and jax.tree.structure(weights) == jax.tree.structure(params)


def replaced_params(params: dict, weights: dict) -> tuple[dict, int]:
    """`weights` (the params' own structure) placed as the params are: every leaf's shape
    checked first; each cast to the param's dtype on its sharding (as it is, when it is)."""
    paths = jax.tree_util.tree_flatten_with_path(params)[0]
    for (path, old), new in zip(paths, jax.tree.leaves(weights)):
        if tuple(new.shape) != tuple(old.shape):
            raise ValueError(f"update_weights: params{jax.tree_util.keystr(path)} has shape {tuple(new.shape)}; "
                             f"the model's is {tuple(old.shape)}")
        if jnp.issubdtype(new.dtype, jnp.floating) != jnp.issubdtype(old.dtype, jnp.floating):
            raise ValueError(f"update_weights: params{jax.tree_util.keystr(path)} has dtype {new.dtype}; the "
                             f"model's is {old.dtype} (floating-point and integer values do not mix)")

    def place(old, new):
        new = as_jax(new)
        # (uncommitted, as jnp.array's or jax.random's, it would compile every step anew: jit
        # keys on committedness)
        if new.dtype == old.dtype and new.sharding == old.sharding and new.committed:
            return new
        return jax.device_put(new.astype(old.dtype), old.sharding)

    return jax.tree.map(place, params, weights), len(paths)

"""Tensor parallelism: the device mesh and where each parameter and cache lives on it.

One `jax.sharding.Mesh` with a single "tp" axis over `tensor_parallel_size` devices (of
every process, when `jax.distributed` joins several: see `device_group`).
The split is Megatron's, stated per parameter (`param_partition`) over the model's
head-explicit layout (see `jaxvllm/models/common.py`):

- q/k/v projections (and their biases) by heads, gate/up by columns: each device computes
  its heads and its slice of the MLP with no communication;
- o_proj by its input heads and down_proj by its input columns: their products are partial
  sums, which XLA all-reduces (two all-reduces of [T, hidden] per layer);
- mixture-of-experts layers' stacked experts likewise, each expert by its intermediate
  dimension (gate/up by columns, down by rows: partial sums); or, with expert parallelism
  (vLLM's `enable_expert_parallel`), by whole experts, E / N per device, each device
  computing its experts' rows and zeros elsewhere (a partial sum too); the router is replicated;
- embeddings and lm_head by vocabulary rows, when the vocabulary divides: each device
  keeps 1/N of the two largest matrices (2 GB of an 8B Llama 3 in bf16), at the price of
  an all-reduce after the lookup and an all-gather of the logits, which the sampler reads
  whole; norms are replicated;
- the KV cache by KV heads. With fewer KV heads than devices, each KV head is repeated
  N / num_kv_heads times (as vLLM replicates them), so that every device holds the one KV
  head its query heads read: the model then runs with N KV heads.

Attention kernels run per device under `jax.shard_map` (a Pallas call has no SPMD rule: XLA
would otherwise gather the whole cache onto every device); everything else is XLA's SPMD
partitioning of the jitted step.
"""

from __future__ import annotations

import contextlib
import dataclasses

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxvllm.model_config import ModelConfig

AXIS = "tp"


def device_group(tensor_parallel_size: int, data_parallel_rank: int = 0, data_parallel_size: int = 1) -> list:
    """The devices of one engine replica: replica r of a data-parallel group uses devices
    [r * tp, (r + 1) * tp) of the default backend. Across P processes (`jax.distributed`),
    it takes tp / P devices of each process, [r * tp / P, (r + 1) * tp / P) of each one's
    local devices, so that every process runs every step (see `docs/design.md`)."""
    devices, processes = jax.devices(), jax.process_count()
    if tensor_parallel_size * data_parallel_size > len(devices):
        if data_parallel_size == 1:
            raise ValueError(f"tensor_parallel_size={tensor_parallel_size} exceeds the {len(devices)} "
                             f"{jax.default_backend()} device(s) here")
        raise ValueError(f"tensor_parallel_size={tensor_parallel_size} x data_parallel_size={data_parallel_size} "
                         f"needs {tensor_parallel_size * data_parallel_size} devices; {len(devices)} "
                         f"{jax.default_backend()} device(s) here")
    if processes == 1:
        start = data_parallel_rank * tensor_parallel_size
        return devices[start : start + tensor_parallel_size]
    if tensor_parallel_size % processes:
        raise ValueError(f"tensor_parallel_size={tensor_parallel_size} over {processes} processes: every process "
                         "runs every step, so each must hold the same number of the engine's devices "
                         f"(use a multiple of {processes})")
    share = tensor_parallel_size // processes
    start = data_parallel_rank * share
    by_process = [[d for d in devices if d.process_index == p] for p in range(processes)]
    if any(len(local) < start + share for local in by_process):
        raise ValueError(f"tensor_parallel_size={tensor_parallel_size} x data_parallel_size={data_parallel_size} "
                         f"needs {share * data_parallel_size} devices on each of the {processes} processes; "
                         f"the fewest any has is {min(map(len, by_process))}")
    return [d for local in by_process for d in local[start : start + share]]


def local_devices(devices: list) -> list:
    """The devices of `devices` that this process drives."""
    return [d for d in devices if d.process_index == jax.process_index()]


def put(x, sharding) -> jax.Array:
    """Host data (the same in every process) placed by `sharding`. Across processes each one
    places only its own devices' copies: `jax.device_put` would first compare the data
    across processes, a host collective every step."""
    if sharding.is_fully_addressable:
        return jax.device_put(x, sharding)
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])


def step_input(x: np.ndarray, sharding):
    """Host data for a jitted step's argument, placed by `sharding`: left as numpy where this
    process drives every device of it, for jit's C++ dispatch copies it to where the
    compiled step wants it, several times faster per call than `jax.device_put`'s Python
    path (46 against 255 us for a 110k-int32 batch on CPU); across processes, `put`."""
    return x if sharding.is_fully_addressable else put(x, sharding)


class _Structure:
    """A pytree's structure as a `FlatTree`'s static part: jit hashes and compares the
    static parts of its arguments on every call, and this one answers from a stored hash
    and by identity instead of walking the tree each time."""

    __slots__ = ("treedef", "_hash")

    def __init__(self, treedef) -> None:
        self.treedef, self._hash = treedef, hash(treedef)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other) -> bool:
        return self is other or (isinstance(other, _Structure) and self.treedef == other.treedef)


@jax.tree_util.register_pytree_node_class
class FlatTree:
    """A pytree handed to a jitted step as its leaves, flattened once when it is made.
    jit's dispatch flattens every argument on each call, visiting each node of the tree
    (a CPU's model holds a dataclass per layer matrix, see `layers.InputMajorWeight`), and
    on a CPU, whose caches the step before has just swept, every visit misses. The step
    reads `tree` while it traces."""

    def __init__(self, leaves: tuple, structure: _Structure) -> None:
        self.leaves, self.structure = leaves, structure

    @classmethod
    def of(cls, tree) -> "FlatTree":
        leaves, treedef = jax.tree.flatten(tree)
        return cls(tuple(leaves), _Structure(treedef))

    @property
    def tree(self):
        return self.structure.treedef.unflatten(self.leaves)

    def tree_flatten(self):
        return self.leaves, self.structure

    @classmethod
    def tree_unflatten(cls, structure: _Structure, leaves) -> "FlatTree":
        return cls(tuple(leaves), structure)


class FlatParams:
    """A `params` attribute that also keeps its `FlatTree` in `flat_params`, made whenever
    the params are set (the load, a wake-up, a weight update): what the steps run every
    engine step take."""

    def __set_name__(self, owner, name: str) -> None:
        self.private = "_" + name

    def __get__(self, obj, objtype=None):
        return self if obj is None else getattr(obj, self.private)

    def __set__(self, obj, params) -> None:
        setattr(obj, self.private, params)
        obj.flat_params = None if params is None else FlatTree.of(params)


def as_tree(tree):
    """The tree itself, whether given as a tree or as a `FlatTree`."""
    return tree.tree if isinstance(tree, FlatTree) else tree


def structs(tree):
    """The shapes and placements of a tree's arrays: what lowering reads of them, without
    holding them (a step may donate or sleep drop them before a compile runs)."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


def to_host(tree):
    """The values of a pytree of replicated arrays, copied together (`jax.device_get`), each
    from this process's copy (across processes no process can address the whole array, yet
    each holds all of it)."""
    return jax.device_get(jax.tree.map(lambda x: x if x.is_fully_addressable else x.addressable_data(0), tree))


def gather_over_processes(value: int) -> list[int]:
    """`value` from every process, in process order (one host collective; only called
    where all processes reach the same point). The devices' work is waited for first: a
    step in flight over some of them (a replica's, or one dropped unread) runs collectives
    of its own, and the processes' collectives must come in the same order in each."""
    if jax.process_count() == 1:
        return [value]
    for array in jax.live_arrays():
        with contextlib.suppress(Exception):  # (deleted or donated meanwhile, by another thread: nothing to wait for)
            array.block_until_ready()
    with jax.transfer_guard("allow"):  # (8 bytes of control, not data a guard is watching for)
        return [int(v) for v in np.asarray(multihost_utils.process_allgather(np.int64(value)))]


def make_mesh(devices: list) -> Mesh:
    """`devices` on one "tp" axis."""
    return Mesh(devices, (AXIS,))


def check_divisible(cfg: ModelConfig, tp: int) -> None:
    """The heads and the MLP must split evenly over `tp` devices; say which number does not."""
    if cfg.num_heads % tp:
        raise ValueError(f"tensor_parallel_size={tp} does not divide num_attention_heads={cfg.num_heads}")
    if cfg.num_kv_heads % tp and tp % cfg.num_kv_heads:
        raise ValueError(
            f"tensor_parallel_size={tp} and num_key_value_heads={cfg.num_kv_heads}: one must divide the other"
        )
    dense = not all(cfg.moe_layers) or not cfg.moe_layers  # (a layer has a dense MLP, which splits)
    if dense and cfg.intermediate_size % tp:
        raise ValueError(f"tensor_parallel_size={tp} does not divide intermediate_size={cfg.intermediate_size}")
    if not any(cfg.moe_layers):
        return
    if cfg.expert_parallel and cfg.num_experts % tp:
        raise ValueError(f"tensor_parallel_size={tp} with enable_expert_parallel does not divide the "
                         f"{cfg.num_experts} experts")
    if not cfg.expert_parallel and cfg.moe_intermediate_size % tp:
        raise ValueError(f"tensor_parallel_size={tp} does not divide the experts' intermediate size "
                         f"{cfg.moe_intermediate_size}")


def sharded_config(cfg: ModelConfig, tp: int, expert_parallel: bool = False) -> ModelConfig:
    """The config the sharded model runs with: KV heads repeated up to `tp` when fewer, and
    the experts split whole (`expert_parallel`) when asked for, over several devices, of a
    mixture of experts."""
    cfg = dataclasses.replace(cfg, expert_parallel=bool(expert_parallel and tp > 1 and any(cfg.moe_layers)))
    check_divisible(cfg, tp)
    return dataclasses.replace(cfg, num_kv_heads=max(cfg.num_kv_heads, tp))


def kv_repeats(original: ModelConfig, sharded: ModelConfig) -> int:
    """How many times each checkpoint KV head is repeated."""
    return sharded.num_kv_heads // original.num_kv_heads


def param_partition(path: tuple, cfg: ModelConfig, tp: int) -> P:
    """Where parameter `path` (as in `param_specs`) is split; replicated when not named."""
    name = path[-1]
    if name in ("embed", "lm_head"):
        return P(AXIS, None) if cfg.vocab_size % tp == 0 else P()
    if name in ("q_proj", "k_proj", "v_proj", "q_bias", "k_bias", "v_bias", "gate_proj", "up_proj", "gate_bias",
                "up_bias", "qkv_proj", "qkv_bias"):
        return P(AXIS)  # [heads, ...], [intermediate, ...], or [kv_heads, group + 2, ...] (whole groups)
    if name in ("gate_up_proj", "gate_up_bias"):
        return P(None, AXIS)  # [2, intermediate, ...]
    if name in ("o_proj", "down_proj"):
        return P(None, AXIS)  # [hidden, heads, head_dim] or [hidden, intermediate]
    # Stacked experts, whole (expert parallelism): E / N experts per device. Otherwise by their
    # intermediate dimension: every device holds a slice of every expert, as of the dense MLP.
    # (The router is replicated either way, so routing needs no communication.)
    if name in ("experts_gate", "experts_up", "experts_down") and cfg.expert_parallel:
        return P(AXIS)  # [experts, ...]
    if name in ("experts_gate", "experts_up"):
        return P(None, None, AXIS)  # [experts, hidden, intermediate]
    if name == "experts_down":
        return P(None, AXIS, None)  # [experts, intermediate, hidden]: partial sums, all-reduced
    # Replicated: every norm (input_norm, post_norm, q_norm, k_norm, norm, and Gemma 3's
    # pre_ffn_norm / post_ffn_norm), the router and o_bias / down_bias.
    return P()


def param_shardings(specs, cfg: ModelConfig, mesh: Mesh) -> dict[tuple, NamedSharding]:
    """Each param's placement, by path: a stack of layers is split as one layer is, never
    on its layer axis; each member layer's as well (the loader places a list's elements)."""
    tp, out = mesh.shape[AXIS], {}
    for spec in specs:
        partition = param_partition(spec.path, cfg, tp)
        stacked = spec.layers and spec.stack
        out[spec.path] = NamedSharding(mesh, P(None, *partition) if stacked else partition)
        out.update({m.path: NamedSharding(mesh, partition) for m in spec.layers})
    return out


def kv_cache_sharding(mesh: Mesh) -> NamedSharding:
    """The KV cache [kv_heads, num_layers, num_blocks, block_size, head_dim] (and an fp8
    cache's scales [kv_heads, num_layers, 2]) split on KV heads."""
    return NamedSharding(mesh, P(AXIS))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())

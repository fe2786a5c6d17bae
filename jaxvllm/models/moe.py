"""The sparse mixture-of-experts MLP of Qwen3-MoE and Mixtral (a building block of the
Llama-family decoder, `jaxvllm/models/llama.py`, not an architecture of its own).

Routing has HF transformers' semantics: router logits in the model's dtype, softmax in
float32 over all experts, then top-k, then (Qwen3-MoE when `norm_topk_prob`, Mixtral
always) the k weights renormalized to sum to 1; Qwen3-MoE casts the weights back to the
model's dtype, Mixtral keeps them in float32 until each expert's weighted output is cast.

The experts run as grouped matmuls over the T * k (token, expert) rows sorted by expert,
with group sizes from a bincount of the chosen experts: each row meets only its own
expert's weights, never all of them. The "pallas" backend runs them with the Pallas kernel
`pallas_kernels.grouped_matmul` (compiled on GPU, interpret mode on CPU); "reference" with
`jax.lax.ragged_dot` (the same contract), which XLA's CPU and GPU backends expand into a
masked product over every expert: num_experts times the FLOPs, fine for tests only. Expert
weights are stacked per layer in ragged_dot's [num_experts, in, out] layout (`experts_gate`
/ `experts_up` [E, hidden, moe_intermediate], `experts_down` [E, moe_intermediate, hidden];
the loader stacks and transposes HF's per-expert [out, in] tensors).

Under a tensor-parallel mesh (`jaxvllm/sharding.py`) every device has all the sorted rows,
and the down projection's outputs are partial sums, all-reduced:
- by default each device holds a slice of every expert's intermediate dimension, as of the
  dense MLP. The Pallas path runs per device (`jax.shard_map`); ragged_dot is left to XLA's
  SPMD partitioner.
- with expert parallelism (`ModelConfig.expert_parallel`) each device holds E / N whole
  experts, whose rows are one contiguous range of the sorted rows. Per device (`shard_map`,
  either backend), the rows are rotated so that that range comes first, the grouped matmul
  runs over its experts' group sizes only (rows past them: zeros, by the contract), and the
  rotation is undone. A row's sum over devices is then its own expert's output.

Weight-only quantized experts (4-bit GPTQ / AWQ / compressed-tensors W4A16, 8-bit GPTQ): with
the Pallas backend on one device, or per device under expert parallelism, a GPU runs the
Pallas grouped W4A16 / W8A16 kernel (`pallas_kernels.grouped_int4_matmul`) on the stored
values, dequantized in registers; a CPU, the reference backend and tensor parallelism
without expert parallelism run the float stacks they stand for (`_float_experts`).
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from jaxvllm.layers import linear
from jaxvllm.model_config import ModelConfig
from jaxvllm.quantization import (EXPERTS, QuantizedWeight, experts_dequantized, is_weight_only,
                                  quantized_grouped_matmul, weight_only_grouped_matmul)
from jaxvllm.sharding import AXIS, param_partition
from pallas_kernels.grouped_matmul import default_block_m, grouped_matmul

# Params of a sparse layer: the router [E, hidden] and the stacked experts.
MOE_PARAMS = ("router", "experts_gate", "experts_up", "experts_down")


def moe_specs(add, cfg: ModelConfig) -> None:
    """A sparse layer's params (`decoder_specs`' `add` records each): the router and the
    stacked experts, read from HF's per-expert tensors or transformers 5's fused ones."""
    d, e, fe = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    # Mixtral's checkpoints name the block `block_sparse_moe` and the experts w1/w3/w2.
    mix = cfg.architecture == "MixtralForCausalLM"
    moe, (w_gate, w_up, w_down) = ("block_sparse_moe", ("w1", "w3", "w2")) if mix else (
        "mlp", ("gate_proj", "up_proj", "down_proj"))
    add("router", f"{moe}.gate.weight", (e, d), fused=("mlp.gate.weight", (e, d), 0) if mix else None)
    gate_up = ("mlp.experts.gate_up_proj", (e, 2 * fe, d))
    for name, w, hf_shape, fused in (("experts_gate", w_gate, (fe, d), (*gate_up, 0)),
                                     ("experts_up", w_up, (fe, d), (*gate_up, fe)),
                                     ("experts_down", w_down, (d, fe), ("mlp.experts.down_proj", (e, d, fe), 0))):
        add(name, f"{moe}.experts.{{}}.{w}.weight", hf_shape, (e, *hf_shape[::-1]), stacked=e, fused=fused)


def route(x: jax.Array, router: jax.Array, cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """(weights [T, k], experts [T, k] int32) of each token, as HF's top-k routers."""
    logits = linear(x, router)
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, cfg.num_experts_per_tok)
    if cfg.norm_topk_prob:
        weights = weights / weights.sum(axis=-1, keepdims=True)
    if cfg.architecture != "MixtralForCausalLM":
        weights = weights.astype(logits.dtype)  # Qwen3-MoE: back to the router's dtype
    return weights, experts.astype(jnp.int32)


def grouped_experts(rows: jax.Array, group_sizes: jax.Array, layer: dict, backend: str = "reference",
                    block_m: int | None = None, amax_reduce=None) -> jax.Array:
    """SwiGLU experts over `rows` [N, hidden] sorted by expert (`group_sizes` [E] rows each):
    the Pallas grouped matmul for backend "pallas" (`block_m`: its row tile, None: its
    default), else jax.lax.ragged_dot. 8-bit quantized experts (`QuantizedWeight`s) run W8A8
    (`quantized_grouped_matmul`; `amax_reduce`: the down projection's, whose inputs are split
    over devices under tensor parallelism); weight-only ones (4-bit, 8-bit GPTQ) with the
    Pallas backend through `weight_only_grouped_matmul` (a GPU's grouped W4A16 kernel, a
    CPU's float stacks), else as the float stacks they stand for (`_float_experts`)."""
    if backend != "pallas":
        layer = _float_experts(layer, rows.dtype)
    gmm = partial(grouped_matmul, block_m=block_m) if backend == "pallas" else jax.lax.ragged_dot
    eight_bit = partial(_quantized_gmm, backend=backend, block_m=block_m)
    block_scaled = partial(_block_scaled_gmm, block_m=block_m) if backend == "pallas" else None

    def matmul(x, name, reduce=None):
        w = layer[name]
        if is_weight_only(w):
            return weight_only_grouped_matmul(x, w, group_sizes, gmm, block_m)
        if isinstance(w, QuantizedWeight):
            return quantized_grouped_matmul(x, w, group_sizes, eight_bit, reduce, block_scaled).astype(rows.dtype)
        return gmm(x, w, group_sizes)

    gate, up = matmul(rows, "experts_gate"), matmul(rows, "experts_up")
    return matmul(jax.nn.silu(gate) * up, "experts_down", amax_reduce)


def _float_experts(layer: dict, dtype) -> dict:
    """`layer` with its weight-only expert stacks (W4A16, W8A16) dequantized to `dtype` (x's):
    they multiply as the float experts do, through the same grouped matmul. The cost, a float
    copy of the stacks each step, is `experts_dequantized`'s: the reference backend's, and
    tensor parallelism's where a group straddles two devices (each device's slice of the
    stacks dequantized by XLA's partitioner, before `shard_map`)."""
    if not any(is_weight_only(layer[name]) for name in EXPERTS):
        return layer
    return {**layer, **{name: experts_dequantized(layer[name], dtype) for name in EXPERTS
                        if is_weight_only(layer[name])}}


def _quantized_gmm(x: jax.Array, w: jax.Array, group_sizes: jax.Array, *, backend: str,
                   block_m: int | None) -> jax.Array:
    """8-bit rows times an 8-bit expert stack, float32: the Pallas kernel (it reads 8-bit tiles
    and converts them in registers), or ragged_dot accumulating in float32 (int8: int32)."""
    if backend == "pallas":
        return grouped_matmul(x, w, group_sizes, block_m=block_m, out_dtype=jnp.float32)
    return jax.lax.ragged_dot(x, w, group_sizes, preferred_element_type=jnp.int32 if x.dtype == jnp.int8 else
                              jnp.float32)


def _block_scaled_gmm(x: jax.Array, w: jax.Array, group_sizes: jax.Array, x_scale: jax.Array, w_scale: jax.Array,
                      size: int, *, block_m: int | None) -> jax.Array:
    """8-bit rows times a block-scaled 8-bit expert stack (a block-fp8 checkpoint's), float32:
    one Pallas kernel call that scales each block's product in registers."""
    return grouped_matmul(x, w, group_sizes, block_m=block_m, out_dtype=jnp.float32, lhs_scale=x_scale,
                          rhs_scale=w_scale, scale_size=size)


def _local_experts(rows: jax.Array, group_sizes: jax.Array, experts: dict, backend: str) -> jax.Array:
    """Inside shard_map under expert parallelism: this device's E / N experts over their rows
    of `rows` (sorted by expert), zeros in every other row."""
    num_local, num_experts = experts["experts_gate"].shape[0], group_sizes.shape[0]
    first = jax.lax.axis_index(AXIS) * num_local  # this device's first expert
    local_sizes = jax.lax.dynamic_slice_in_dim(group_sizes, first, num_local)
    start = jnp.sum(jnp.where(jnp.arange(num_experts) < first, group_sizes, 0))  # its first row
    # The kernel's row tile from the mean rows of all experts: its default would divide all
    # the rows among this device's experts only, a tile N times too tall.
    block_m = default_block_m(rows.shape[0], num_experts)
    out = grouped_experts(jnp.roll(rows, -start, axis=0), local_sizes, experts, backend, block_m)
    return jnp.roll(out, start, axis=0)


def _sharded_experts(rows: jax.Array, group_sizes: jax.Array, layer: dict, cfg: ModelConfig, backend: str,
                     mesh: Mesh | None) -> jax.Array:
    """`grouped_experts`; with a mesh, per device (`shard_map`) on its whole experts (expert
    parallelism) or, with the Pallas kernel (opaque to XLA's SPMD partitioner), on its
    intermediate slice of every expert; either way the partial sums all-reduced. Weight-only
    expert stacks stay quantized on one device, under expert parallelism, and under tensor
    parallelism where each device's slice of the down projection's inputs holds whole
    groups (`_whole_groups_per_device`): `grouped_experts` takes each device's part. Where a
    group straddles two devices they are dequantized first, in the global view (XLA's SPMD
    partitioner splits that as the stacks are split), so that the devices see float stacks."""
    if mesh is not None and not cfg.expert_parallel and not _whole_groups_per_device(layer, mesh.shape[AXIS]):
        layer = _float_experts(layer, rows.dtype)
    if mesh is None or (backend != "pallas" and not cfg.expert_parallel):
        return grouped_experts(rows, group_sizes, layer, backend)
    experts = {name: layer[name] for name in EXPERTS}
    specs = {name: _expert_spec(layer[name], param_partition((name,), cfg, mesh.shape[AXIS])) for name in EXPERTS}
    # (each device's down projection holds a slice of its inputs: per-token scales over all of them)
    compute = _local_experts if cfg.expert_parallel else partial(grouped_experts,
                                                                 amax_reduce=partial(jax.lax.pmax, axis_name=AXIS))

    def local(rows, group_sizes, experts):
        return jax.lax.psum(compute(rows, group_sizes, experts, backend), AXIS)

    return jax.shard_map(local, mesh=mesh, in_specs=(P(), P(), specs), out_specs=P(),
                         check_vma=False)(rows, group_sizes, experts)  # Pallas calls carry no vma


def _whole_groups_per_device(layer: dict, tp: int) -> bool:
    """Whether each of `tp` devices' slices of the weight-only down projection's inputs (split
    under tensor parallelism) holds whole groups: one group over all inputs (each device's
    slice shares its scales), or whole groups that `tp` divides. The gate and up projections'
    inputs are never split."""
    down = layer["experts_down"]
    if not is_weight_only(down):
        return True
    groups, n_in = down.scale.shape[1], down.value.shape[1]
    return groups == 1 or (groups % tp == 0 and groups * (down.group_size or n_in) == n_in)


def _expert_spec(weight, partition: P):
    """How an expert stack is split in `shard_map`: as `partition`, and a quantized one's
    scales (and zero points) [E, groups, out] alike (groups whole when one per column)."""
    if not isinstance(weight, QuantizedWeight):
        return partition
    e, inputs, out = tuple(partition) + (None,) * (3 - len(partition))
    scale = P(e, inputs if weight.scale.shape[1] > 1 else None, out)
    return dataclasses.replace(weight, value=partition, scale=scale, zero=None if weight.zero is None else scale,
                               perm=None, input_scale=None if weight.input_scale is None else P())


def sparse_moe(layer: dict, x: jax.Array, cfg: ModelConfig, backend: str = "reference",
               mesh: Mesh | None = None) -> jax.Array:
    """The MoE MLP of x [T, hidden]: each token's k experts, weighted and summed. `backend`:
    the attention backend's name ("pallas": the Pallas grouped matmul), `mesh`: tensor
    parallelism."""
    t, d = x.shape
    k = cfg.num_experts_per_tok
    weights, experts = route(x, layer["router"], cfg)
    flat = experts.reshape(-1)  # [T * k]: token i's choices at rows i*k .. i*k+k-1
    order = jnp.argsort(flat, stable=True)  # the rows sorted by expert
    group_sizes = jnp.bincount(flat, length=cfg.num_experts).astype(jnp.int32)
    out = _sharded_experts(x[order // k], group_sizes, layer, cfg, backend, mesh)  # [T * k, hidden], sorted
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(t * k, dtype=order.dtype))
    out = out[inverse].reshape(t, k, d)  # back to (token, choice) order
    # As HF: each expert's output times its weight, cast to the model's dtype, then summed.
    return (out * weights[..., None]).astype(x.dtype).sum(axis=1)

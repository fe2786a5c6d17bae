"""Quantized linear weights: how the params hold them, the checkpoint formats read,
quantizing at load (vLLM's online `quantization="fp8"`, and 4-bit "gptq-dummy"), and the
matmuls that read them (`layers.linear` hands them here).

Checkpoint formats read (`CheckpointFormat`): HF's block fp8, compressed-tensors 8-bit and
4-bit, GPTQ (4- and 8-bit) and AWQ (how their tensors are stored: `jaxvllm.stored_tensors`).
A quantized weight is a `QuantizedWeight` in the place of the weight: `value` in the
weight's own layout ([*out, *in], heads explicit, as `layers.linear` reads any weight;
stacked [layers, ...] where the weights are) and `scale`, float32 [*out, groups]: one per output row
(channel) and group of `group_size` inputs (one group: the whole row), so a split of the
output axes under tensor parallelism splits the scales alike. A checkpoint's block scales
([out / 128, in / 128] for HF's fp8) are repeated over their block's rows when read, so
that every format is this one layout.

Online fp8 is W8A8 as vLLM's: weights in float8_e4m3fn, activations quantized per token
on the fly, the product an fp8 x fp8 matmul accumulated in float32, scaled per token and
per channel afterwards. Weights are scaled per channel rather than per tensor (vLLM's
online default): the scale then costs nothing more in the matmul (it multiplies output
columns), and one outlier row no longer coarsens every other row's grid. Embeddings,
norms, biases, the lm_head and the router stay as they were, as in vLLM.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxvllm.config import CHECKPOINT_QUANTIZATIONS
from pallas_kernels.grouped_int4_matmul import grouped_int4_matmul
from pallas_kernels.int4_matmul import int4_matmul, pack_int4

FP8 = jnp.float8_e4m3fn
FP8_MAX = float(jnp.finfo(FP8).max)  # 448
INT8_HALF_RANGE = 127.5  # (127 - -128) / 2
_TINY = float(jnp.finfo(jnp.float32).tiny)  # (a row of zeros keeps a positive scale)
# The linear weights quantized (any of them a model has; merged or not).
QUANTIZED = ("qkv_proj", "q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj", "gate_proj", "up_proj", "down_proj")
# A mixture of experts' expert stacks [E, in, out] (the grouped matmul's layout): a quantized
# one holds scales [E, groups, out], groups along its input axis.
EXPERTS = ("experts_gate", "experts_up", "experts_down")
EXPERT_STACK = 0  # `num_in` of an expert stack, for the online quantizers


@partial(jax.tree_util.register_dataclass, data_fields=["value", "scale", "zero", "perm", "input_scale"],
         meta_fields=["group_size", "kernel", "weight_only"])
@dataclass(frozen=True)
class QuantizedWeight:
    """A linear weight as quantized values [*out, *in] (fp8, int8, or int4) and float32
    scales [*out, groups] (see the module docstring); `(value - zero) * scale` (each scale
    and zero point over its group) is the weight it stands for. `group_size` 0: one scale
    per row; G: a scale per G inputs (the last group may be partial). 8-bit values are
    W8A8 (activations quantized per token, or per token and group), unless `weight_only`
    (int8 from 8-bit GPTQ: W8A16); int4 values are W4A16. Weight-only values (int4, or int8
    `weight_only`) leave activations as they are, with float32 zero points [*out, groups]
    where the format is asymmetric (None: 0), and `perm` int32 [in] where GPTQ quantized
    the inputs out of order (act-order): the values' input j is the weight's input
    perm[j], so that groups are whole runs of inputs (the matmul takes x's inputs in that
    order). `input_scale`, float32 [] (one per layer), for a checkpoint's static activation scale: x quantized per tensor
    with it rather than per token. An expert stack (`EXPERTS`) is laid out as the grouped
    matmul reads it: values [E, in, out], scales (and zero points) [E, groups, out]; 8-bit
    ones run W8A8 (`quantized_grouped_matmul`), weight-only ones (W4A16, W8A16; no act-order)
    through `weight_only_grouped_matmul` (on a GPU the grouped kernel reads their 4- or 8-bit
    values; else the float stack they stand for, `experts_dequantized`). `kernel`: an int4 weight
    on one device, which a GPU multiplies with the Pallas W4A16 kernel
    (`pallas_kernels.int4_matmul`; XLA's SPMD partitioner cannot split a kernel call, so a
    split weight keeps XLA's matmul)."""

    value: jax.Array
    scale: jax.Array
    group_size: int = 0
    zero: jax.Array | None = None
    perm: jax.Array | None = None
    input_scale: jax.Array | None = None
    kernel: bool = False
    weight_only: bool = False

    @property
    def shape(self) -> tuple[int, ...]:
        return self.value.shape

    @property
    def ndim(self) -> int:
        return self.value.ndim

    def dequantized(self, dtype=jnp.float32) -> jax.Array:
        """The weight it stands for, [*out, *in] (the weight-only matmul's operand on a CPU;
        tests and oracles for W8A8 weights, whose matmul never builds it)."""
        out = self.scale.shape[:-1]
        value = self.value.reshape(*out, -1).astype(jnp.float32)
        n, groups = value.shape[-1], self.scale.shape[-1]
        size = self.group_size or n
        if groups * size == n:  # whole groups: a broadcast over each
            value = value.reshape(*out, groups, size)
            if self.zero is not None:
                value = value - self.zero[..., None]
            weight = value * self.scale[..., None]
        else:  # a partial last group
            def per_input(a):
                return jnp.repeat(a, size, axis=-1)[..., :n]
            weight = (value if self.zero is None else value - per_input(self.zero)) * per_input(self.scale)
        weight = weight.reshape(*out, n)
        if self.perm is not None:  # back in the weight's input order (a stack's: each layer's own)
            inverse = jnp.argsort(self.perm, axis=-1)
            inverse = inverse.reshape(*inverse.shape[:-1], *(1,) * (weight.ndim - inverse.ndim), n)
            weight = jnp.take_along_axis(weight, jnp.broadcast_to(inverse, weight.shape), axis=-1)
        return weight.reshape(self.value.shape).astype(dtype)


@dataclass(frozen=True)
class CheckpointFormat:
    """How a quantized checkpoint stores its linear weights (config.json's
    `quantization_config`): each weight's values `{module}.{value_name}` as `value_dtype`,
    with float32 scales (`{module}.{scale_name}`), one per `block` = (rows, inputs) of the
    weight (inputs 0: the whole row; rows 0: all of them, one scale a tensor), and for
    asymmetric 4- and 8-bit weight-only formats zero points (`{module}.{zero_name}`) beside
    them; `packing` names how 4- or 8-bit values lie in int32 words
    (`jaxvllm.stored_tensors.packed_view`); `weight_only`: int8 values that leave
    activations as they are (8-bit GPTQ: `QuantizedWeight.weight_only`). The linear layers
    `ignore` names ("re:" entries are regexes of module names) stay full precision; tensors ending in one of
    `unused` are the format's bookkeeping, not read.
    - HF fp8 (`quant_method: "fp8"`, transformers' FineGrainedFP8): float8_e4m3fn,
      `weight_scale_inv` per `weight_block_size` block; activations per token and group.
      Without weight_block_size (vLLM's and AutoFP8's per-tensor fp8): `weight_scale` per
      tensor, activations per token, or with `input_scale` (activation_scheme "static").
    - compressed-tensors `float-quantized` / `int-quantized` (llm-compressor's FP8_DYNAMIC and
      W8A8 int8): float8_e4m3fn or int8, `weight_scale` per channel (block (1, 0)),
      activations per token, or (W8A8 int8 static) with a static `input_scale`;
      llm-compressor's FP8 (static): `weight_scale` per tensor (block (0, 0)) and a static
      `input_scale`; its FP8_BLOCK: `weight_scale` per `block_structure` block, activations
      per token and group, as HF fp8's; `pack-quantized` (W4A16, W8A16): int4 or int8
      `weight_packed` per group.
    - GPTQ (AutoGPTQ / GPTQModel, 4- or 8-bit) and AWQ (AutoAWQ's GEMM, 4-bit): `qweight`
      (int4, or int8 weight-only), `scales` and `qzeros` per group of inputs; GPTQ's
      act-order (desc_act) groups inputs by `g_idx`, read as a permutation that makes each
      group a run (`QuantizedWeight.perm`)."""

    method: str
    block: tuple[int, int]
    value_dtype: str = "float8_e4m3fn"
    scale_name: str = "weight_scale_inv"
    ignore: tuple[str, ...] = ()
    value_name: str = "weight"
    zero_name: str | None = None
    packing: str = ""  # "", "gptq", "gptq_v2", "awq" or "compressed-tensors"
    unused: tuple[str, ...] = ()
    act_order: bool = False  # GPTQ's desc_act: `g_idx` [in] gives each input's group
    input_scale_name: str | None = None  # static activations: `{module}.input_scale`, one a tensor
    weight_only: bool = False  # int8 values, activations as they are (W8A16)
    # GPTQ and AWQ: the modules the checkpoint stores as a plain `weight`, which decide instead
    # of `ignore` (`loader.load_model` finds them)
    unquantized: frozenset[str] = frozenset()
    # compressed-tensors' mixed precision: (targets, format) of each config group (`of`)
    groups: tuple[tuple[tuple[str, ...], "CheckpointFormat"], ...] = ()

    def formats(self) -> tuple["CheckpointFormat", ...]:
        """Every scheme the checkpoint's modules are stored in."""
        return tuple(f for _, f in self.groups) or (self,)

    def of(self, module: str, strict: bool = True) -> "CheckpointFormat":
        """The format module `module` (not ignored) is stored in: its config group's, found as
        vLLM finds it, first by the module's name (a target equal to it or a "re:" regex
        matching from its start) in the groups' order, then by its class ("Linear"). A
        module no group targets is an error, or (not `strict`: a tensor that is not a
        quantized layer's, say the embeddings') stored as this format, which packs nothing."""
        if not self.groups:
            return self
        for targets, fmt in self.groups:
            if any(_names(t, module) for t in targets):
                return fmt
        for targets, fmt in self.groups:
            if any(t.lower() == "linear" for t in targets):
                return fmt
        if not strict:
            return self
        raise ValueError(f"Unable to find matching target for {module} in the compressed-tensors config.")

    def ignores(self, hf_name: str) -> bool:
        """Whether the weight `hf_name` stays full precision. GPTQ and AWQ: its module is
        stored so. Otherwise the ignore list names it by the writer's and vLLM's rule: "re:"
        entries are regexes from the name's start, compressed-tensors' others name a module,
        transformers' fp8 ones a module, one above it or the name's last parts."""
        module = hf_name.removesuffix(".weight")
        if self.value_name == "qweight":
            return module in self.unquantized
        for m in self.ignore:
            hit = _names(m, module)
            if not hit and self.method != "compressed-tensors" and not m.startswith("re:"):
                hit = module.startswith(m + ".") or module.endswith("." + m)
            if hit:
                return True
        return False


def _names(entry: str, module: str) -> bool:
    """Whether a quantization config's entry (a target or an ignored module) names `module`:
    equal to it, or a "re:" regex matching from its start."""
    return re.match(entry[3:], module) is not None if entry.startswith("re:") else entry == module


def _is_block(block: Any) -> bool:
    """A block of weights as configs give it: [rows, inputs], two positive ints."""
    return isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)


SUPPORTED_CHECKPOINTS = ("fp8 (quant_method 'fp8': blocks (weight_block_size) with dynamic activations, or "
                         "per tensor with dynamic or static activations), "
                         "compressed-tensors float-quantized / int-quantized (8-bit, weights per channel or "
                         "tensor, activations dynamic per token or static per tensor; fp8 weights per block, "
                         "activations dynamic per token and group) and pack-quantized "
                         "(4- or 8-bit weights per group or channel, activations unquantized), GPTQ (4- or 8-bit weights, "
                         "activations unquantized; v1 or v2 checkpoint format, act-order) and AWQ (4-bit GEMM)")


def checkpoint_format(quant_config: dict, model: str) -> CheckpointFormat:
    """The format of a checkpoint's `quantization_config`, or an error naming what is not read."""
    method = quant_config.get("quant_method")
    if method == "compressed-tensors":
        return _compressed_tensors_format(quant_config, model)
    if method in ("gptq", "awq"):
        return _gptq_awq_format(quant_config, model)
    if method != "fp8":
        raise ValueError(f"{model}: quant_method {method!r} in config.json is not supported; jaxvllm reads "
                         f"{SUPPORTED_CHECKPOINTS}")
    block = quant_config.get("weight_block_size")
    scheme = _required(quant_config, ("activation_scheme",), model)
    ignore = tuple(quant_config.get("modules_to_not_convert") or quant_config.get("ignored_layers") or ())
    if block is None:  # per tensor (vLLM's and AutoFP8's fp8): `weight_scale`, and `input_scale` when static
        if scheme not in ("dynamic", "static"):
            raise ValueError(f"{model}: activation_scheme {scheme!r} is not supported ('dynamic' or 'static')")
        static = scheme == "static"
        return CheckpointFormat("fp8", (0, 0), scale_name="weight_scale", ignore=ignore,
                                unused=(".input_scale",) if static else (),
                                input_scale_name="input_scale" if static else None)
    if not _is_block(block):
        raise ValueError(f"{model}: an fp8 checkpoint's weight_block_size must be two positive ints [rows, inputs] "
                         f"(or absent: per-tensor scales), got {block!r}")
    if scheme != "dynamic":
        raise ValueError(f"{model}: activation_scheme {scheme!r} with weight_block_size is not supported (only "
                         f"'dynamic')")
    return CheckpointFormat("fp8", (block[0], block[1]), ignore=ignore)


def _required(quant_config: dict, keys: tuple[str, ...], model: str) -> Any:
    """The value of the first of `keys` in `quant_config`, which vLLM's reader requires too (its words)."""
    for key in keys:
        if key in quant_config:
            return quant_config[key]
    raise ValueError(f"{model}: Cannot find any of {list(keys)} in the model's quantization config.")


def _gptq_awq_format(quant_config: dict, model: str) -> CheckpointFormat:
    """GPTQ (4- or 8-bit) and AWQ (4-bit): packed `qweight` with `scales` and `qzeros` per
    group of inputs; weight-only (8 bits: int8 values marked `weight_only`)."""
    method = quant_config["quant_method"]
    bits = _required(quant_config, ("bits",) if method == "gptq" else ("w_bit", "bits"), model)
    if bits not in ((4, 8) if method == "gptq" else (4,)):
        raise ValueError(f"{model}: {bits}-bit {method.upper()} is not supported; jaxvllm reads 4- and 8-bit GPTQ "
                         f"and 4-bit AWQ")
    group = _required(quant_config, ("group_size",) if method == "gptq" else ("q_group_size", "group_size"), model)
    if not isinstance(group, int) or not (group > 0 or group == -1):
        raise ValueError(f"{model}: {method.upper()} group_size {group!r} must be a positive int or -1 (whole rows)")
    if method == "gptq":
        act_order = bool(_required(quant_config, ("desc_act",), model))
        if act_order and group == -1:
            act_order = False  # (one group: the order changes nothing)
        packing = quant_config.get("checkpoint_format", "gptq")
        if packing not in ("gptq", "gptq_v2"):
            raise ValueError(f"{model}: GPTQ checkpoint_format {packing!r} is not supported; jaxvllm reads 'gptq' "
                             f"and 'gptq_v2'")
        # Without `sym` the zero points are read: right either way, as vLLM's GPTQ kernel reads them.
        symmetric = quant_config.get("sym") is True
        # GPTQModel's per-module rules: "-:" ones skip modules (stored in full precision, which the files
        # show), the others change bits / group_size / sym / desc_act, refused where they do.
        changing = [rule for rule, values in (quant_config.get("dynamic") or {}).items() if not rule.startswith("-:")
                    and any(quant_config.get(key) != value for key, value in (values or {}).items())]
        if changing:
            raise ValueError(f"{model}: GPTQ 'dynamic' per-module overrides ({', '.join(changing)}) are not supported; "
                             f"jaxvllm reads one bits, group_size, sym and desc_act for every module (rules that skip "
                             f"modules, '-:...', are read)")
        # The lm_head is quantized only with `lm_head: true` (refused). The files say which modules are
        # quantized (`CheckpointFormat.unquantized`), not modules_in_block_to_quantize / modules_to_not_convert.
        if quant_config.get("lm_head"):
            raise ValueError(f"{model}: a GPTQ-quantized lm_head is not supported; jaxvllm reads quantized decoder "
                             f"layers only")
    else:
        version = str(quant_config.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"{model}: AWQ version {version!r} is not supported; jaxvllm reads AutoAWQ's 'gemm'")
        packing, symmetric, act_order = "awq", not _required(quant_config, ("zero_point",), model), False
        if symmetric:
            raise ValueError(f"{model}: AWQ without zero points is not supported; jaxvllm reads zero_point true")
    unused = ((".qzeros",) if symmetric else ()) + (".g_idx",)  # (act-order's: `loader.module_tensors` reads them)
    return CheckpointFormat(method, (1, max(group, 0)), "int4" if bits == 4 else "int8", "scales", (), "qweight",
                            None if symmetric else "qzeros", packing, unused, act_order, weight_only=bits == 8)


def _compressed_tensors_format(quant_config: dict, model: str) -> CheckpointFormat:
    """compressed-tensors: each config group's scheme, in the group's own format or the
    config's. Groups of one scheme are one format, whatever their targets (the ignore list
    names what stays full precision); groups of several (llm-compressor's mixed precision)
    give each module the scheme of its group (`CheckpointFormat.of`)."""
    groups = list((quant_config.get("config_groups") or {}).values())
    if not groups:
        raise ValueError(f"{model}: compressed-tensors without config_groups (no quantization scheme) is not "
                         f"supported; jaxvllm reads {SUPPORTED_CHECKPOINTS}")
    kv = quant_config.get("kv_cache_scheme")  # (its scales are read by name with the cache's: `load_kv_scales`)
    if kv and (kv.get("type", "float") != "float" or kv.get("num_bits", 8) != 8 or kv.get("symmetric", True) is not True):
        raise ValueError(f"{model}: compressed-tensors kv_cache_scheme {kv} is not supported; jaxvllm reads symmetric "
                         f"8-bit float (fp8) KV cache scales")
    if ((quant_config.get("transform_config") or {}).get("config_groups") or {}):  # (the weights hold their inverse)
        raise ValueError(f"{model}: compressed-tensors transform_config (QuIP / Hadamard transforms applied online "
                         f"to the layers' inputs) is not supported by jaxvllm")
    ignore = tuple(quant_config.get("ignore") or ())
    formats = [_compressed_tensors_group(group, group.get("format") or quant_config.get("format"), ignore, model)
               for group in groups]
    if len(set(formats)) == 1:
        return formats[0]
    return CheckpointFormat("compressed-tensors", (1, 0), ignore=ignore,
                            unused=tuple(sorted({suffix for f in formats for suffix in f.unused})),
                            groups=tuple((tuple(group.get("targets") or ()), f) for group, f in zip(groups, formats)))


def _compressed_tensors_group(group: dict, fmt: str | None, ignore: tuple, model: str) -> CheckpointFormat:
    """The format of one compressed-tensors config group's scheme, stored in format `fmt`."""
    if fmt == "mixed-precision":
        raise ValueError(f"{model}: a compressed-tensors config group without its own format in a mixed-precision "
                         f"checkpoint (targets {group.get('targets')})")
    if fmt not in ("float-quantized", "int-quantized", "pack-quantized"):
        raise ValueError(f"{model}: compressed-tensors format {fmt!r} is not supported; jaxvllm reads "
                         f"{SUPPORTED_CHECKPOINTS}")
    weights, inputs = group.get("weights") or {}, group.get("input_activations")
    if fmt == "pack-quantized":
        return _pack_quantized_format(weights, inputs, ignore, model)
    kind = "float" if fmt == "float-quantized" else "int"
    strategies = ("channel", "tensor", "block") if kind == "float" else ("channel", "tensor")
    want = {"num_bits": 8, "type": kind, "strategy": " or ".join(strategies), "symmetric": True}
    got = {key: weights.get(key) for key in want}
    if got != dict(want, strategy=got["strategy"]) or got["strategy"] not in strategies:
        raise ValueError(f"{model}: compressed-tensors weights {got} are not supported; jaxvllm reads {want}")
    inputs = inputs or {}
    if got["strategy"] == "block":  # llm-compressor's FP8_BLOCK
        return _fp8_block_format(weights.get("block_structure"), inputs, ignore, model)
    dynamic = inputs.get("strategy") == "token" and inputs.get("dynamic") is True
    static = inputs.get("strategy") == "tensor" and inputs.get("dynamic") is False
    if (inputs.get("num_bits") != 8 or not (dynamic or static) or inputs.get("symmetric", True) is not True
            or inputs.get("type", kind) != kind):
        raise ValueError(f"{model}: compressed-tensors input_activations {inputs or None} are not supported; jaxvllm "
                         f"reads symmetric 8-bit activations of the weights' type ({kind!r}) quantized dynamically "
                         f"per token (strategy 'token', dynamic true) or statically per tensor (strategy 'tensor', "
                         f"dynamic false: `input_scale`)")
    return CheckpointFormat("compressed-tensors", (1 if got["strategy"] == "channel" else 0, 0),
                            "float8_e4m3fn" if kind == "float" else "int8", "weight_scale", ignore,
                            unused=(".input_scale",) if static else (),
                            input_scale_name="input_scale" if static else None)


def _fp8_block_format(block: Any, inputs: dict, ignore: tuple, model: str) -> CheckpointFormat:
    """compressed-tensors fp8 weights per block of (rows, inputs) (`weight_scale` per block),
    activations quantized dynamically per token and group of the block's inputs, as vLLM
    computes them (its block GEMM's only form)."""
    if not _is_block(block):
        raise ValueError(f"{model}: compressed-tensors block_structure {block!r} of 'block' weights must be two "
                         f"positive ints [rows, inputs]")
    want = {"num_bits": 8, "type": "float", "strategy": "group", "group_size": block[1], "dynamic": True,
            "symmetric": True}
    if {key: inputs.get(key, True if key == "symmetric" else None) for key in want} != want:
        raise ValueError(f"{model}: compressed-tensors input_activations {inputs or None} beside block weights are "
                         f"not supported; jaxvllm reads {want} (dynamic per token and group of the block's inputs)")
    return CheckpointFormat("compressed-tensors", (block[0], block[1]), scale_name="weight_scale", ignore=ignore)


def _pack_quantized_format(weights: dict, inputs: dict | None, ignore: tuple, model: str) -> CheckpointFormat:
    """compressed-tensors W4A16 and W8A16 (llm-compressor's W4A16, W4A16_ASYM and W8A16 schemes)."""
    got = {key: weights.get(key) for key in ("num_bits", "type", "strategy")}
    if got["num_bits"] not in (4, 8) or got["type"] != "int" or got["strategy"] not in ("group", "channel"):
        raise ValueError(f"{model}: compressed-tensors pack-quantized weights {got} are not supported; jaxvllm "
                         f"reads 4- or 8-bit int weights per group or channel")
    if inputs:
        raise ValueError(f"{model}: compressed-tensors pack-quantized with input_activations {inputs} is not "
                         f"supported; jaxvllm reads weight-only (W4A16, W8A16) schemes")
    group = weights.get("group_size") if got["strategy"] == "group" else 0
    if got["strategy"] == "group" and not (isinstance(group, int) and group > 0):
        raise ValueError(f"{model}: compressed-tensors group_size {group!r} must be a positive int")
    # "weight" (and its alias "static", llm-compressor's GPTQ default): the order quantized in; no g_idx
    if weights.get("actorder") not in (None, False, "weight", "static"):
        raise ValueError(f"{model}: compressed-tensors actorder {weights['actorder']!r} (weight_g_idx) is not "
                         f"supported; jaxvllm reads actorder null, 'weight' or 'static'")
    symmetric, bits = weights.get("symmetric", True), got["num_bits"]
    return CheckpointFormat("compressed-tensors", (1, group), f"int{bits}", "weight_scale", ignore, "weight_packed",
                            None if symmetric else "weight_zero_point", "compressed-tensors", (".weight_shape",),
                            weight_only=bits == 8)


def online_method(quantization: str | None, cfg) -> str | None:
    """The method to quantize the weights with as they load (`ONLINE`), or None. As vLLM's,
    `quantization` may also name a quantized checkpoint's own method (then it is read as it
    is); another method for a quantized checkpoint, or a checkpoint's method for a
    full-precision one, is refused before any weight loads."""
    method = cfg.quant_method
    if method is None:
        if quantization is not None and quantization not in ONLINE:
            raise ValueError(f"quantization={quantization!r} names a quantized checkpoint's method, but config.json "
                             f"has no quantization_config; leave it unset, or quantize at load with "
                             + " or ".join(map(repr, ONLINE)))
        return quantization
    if quantization is not None and quantization not in CHECKPOINT_QUANTIZATIONS.get(method, (method,)):
        raise ValueError(f"quantization={quantization!r} does not match the checkpoint's quant_method {method!r} in "
                         f"config.json; leave quantization unset to run the checkpoint as it is")
    return None


def check_expert_format(cfg, fmt: CheckpointFormat) -> None:
    """Refuse expert stacks in a format the experts do not read: static activation scales
    (the grouped matmul quantizes rows per token), and GPTQ's act-order (a permutation of
    each expert's inputs; Qwen's GPTQ mixtures of experts have none); in a mixed-precision
    checkpoint, in any of its schemes."""
    bad = next((f for f in fmt.formats() if f.input_scale_name or f.act_order), None)
    if any(cfg.moe_layers) and bad is not None:
        what = "statically scaled" if bad.input_scale_name else "GPTQ act-order (desc_act)"
        raise ValueError(f"{cfg.architecture}: {what} expert stacks are not supported yet; jaxvllm reads a mixture "
                         f"of experts' experts in 8-bit checkpoints with dynamic activations, and 4-bit or 8-bit "
                         f"GPTQ without act-order (desc_act false), or quantizes them at load")


def in_axes(shape: tuple[int, ...], hf_shape: tuple[int, ...]) -> int:
    """How many trailing axes of a weight of `shape` make HF's input axis (`hf_shape`
    [out, in]): 1, or 2 where heads are explicit on the input side (o_proj [hidden,
    heads, head_dim])."""
    for n in range(1, len(shape) + 1):
        if math.prod(shape[-n:]) == hf_shape[-1]:
            return n
    raise ValueError(f"a weight of shape {shape} does not end in HF's input axis of {hf_shape}")


def quantize_fp8(weight: jax.Array, num_in: int) -> QuantizedWeight:
    """Per-channel fp8: each output row scaled so that its largest magnitude is fp8's 448."""
    out = weight.shape[: weight.ndim - num_in]
    value, scale = quantize_rows(weight.reshape(*out, -1))
    return QuantizedWeight(value.reshape(weight.shape), scale)


INT4_GROUP = 128  # `quantization="gptq-dummy"`: inputs per scale, GPTQ's usual group


def quantize_int4(weight: jax.Array, num_in: int, group: int = INT4_GROUP) -> QuantizedWeight:
    """4-bit per group of `group` inputs (or of their greatest common divisor with the
    inputs, so that the groups are whole: SmolLM2's 576 in 64s), symmetric and rounded to
    the nearest point of GPTQ's symmetric grid (scale 2 * amax / 15, zero point 8): the
    layout and arithmetic of a symmetric GPTQ checkpoint, from any weights."""
    out = weight.shape[: weight.ndim - num_in]
    w = weight.reshape(*out, -1).astype(jnp.float32)
    n = w.shape[-1]
    group = group if n % group == 0 else math.gcd(n, group)  # (whole groups: see `_weight_only_matmul`)
    groups = -(-n // group)
    padded = jnp.pad(w, [(0, 0)] * len(out) + [(0, groups * group - n)]).reshape(*out, groups, group)
    scale = jnp.maximum(jnp.max(jnp.abs(padded), axis=-1), _TINY) * (2 / 15)
    value = jnp.clip(jnp.round(padded / scale[..., None]), -8, 7).astype(jnp.int4)
    return QuantizedWeight(value.reshape(*out, -1)[..., :n].reshape(weight.shape), scale, group)


def _scale_sharding(sharding, ndim: int, num_in: int):
    """A weight's scales split as its output axes are (whole along the input's); an expert
    stack's [E, 1, out] as its experts and outputs are."""
    if not isinstance(sharding, NamedSharding):
        return sharding
    spec = tuple(sharding.spec) + (None,) * (ndim - len(sharding.spec))
    if num_in == EXPERT_STACK:
        return NamedSharding(sharding.mesh, P(spec[0], None, spec[2]))
    return NamedSharding(sharding.mesh, P(*spec[: ndim - num_in], None))


def quantize_experts_fp8(weight: jax.Array) -> QuantizedWeight:
    """An expert stack [E, in, out] in fp8, each expert's output column scaled so that its
    largest magnitude is 448: value [E, in, out], scale [E, 1, out]."""
    value, scale = quantize_rows(jnp.swapaxes(weight, 1, 2))
    return QuantizedWeight(jnp.swapaxes(value, 1, 2), jnp.swapaxes(scale, 1, 2))


def quantize_experts_int4(weight: jax.Array) -> QuantizedWeight:
    """An expert stack [E, in, out] as `quantize_int4` rounds each expert's [out, in] weight:
    value int4 [E, in, out], scale [E, groups, out]."""
    q = quantize_int4(jnp.swapaxes(weight, 1, 2), 1)
    return QuantizedWeight(jnp.swapaxes(q.value, 1, 2), jnp.swapaxes(q.scale, 1, 2), q.group_size)


# `quantization=` at load: how each weight is quantized, and each expert stack
ONLINE = {"fp8": quantize_fp8, "gptq-dummy": quantize_int4}
ONLINE_EXPERTS = {"fp8": quantize_experts_fp8, "gptq-dummy": quantize_experts_int4}


def quantize_online(weight: jax.Array, num_in: int, method: str) -> QuantizedWeight:
    """`ONLINE[method]` of a weight with `num_in` input axes, or `ONLINE_EXPERTS[method]` of
    an expert stack (num_in EXPERT_STACK)."""
    return ONLINE_EXPERTS[method](weight) if num_in == EXPERT_STACK else ONLINE[method](weight, num_in)


def quantize_in_place(weight: jax.Array, num_in: int, method: str = "fp8") -> QuantizedWeight:
    """`quantize_online` on the weight's devices, split as it is; the weight is freed."""
    quantized = _jit_quantize(weight, num_in, method)
    placed = jax.tree.map(lambda _: _scale_sharding(weight.sharding, weight.ndim, num_in), quantized)
    placed = dataclasses.replace(placed, value=weight.sharding)
    quantized = jax.device_put(quantized, placed)
    weight.delete()
    return quantized


_jit_quantize = jax.jit(quantize_online, static_argnums=(1, 2))


def quantize_params(params: dict, specs: list, quantize: Callable = quantize_in_place) -> dict:
    """Online quantization (`quantization="fp8"` or "gptq-dummy"): every linear weight of the
    layers (`QUANTIZED`) as a `QuantizedWeight`, by `quantize(weight, num_in)` (a
    `functools.partial` of `quantize_in_place` with the method; of `quantize_online` for
    abstract params, as the sm_90a check traces them)."""
    layers = params.get("layers", {})
    for spec in specs:
        name = spec.path[-1]
        if spec.path[0] != "layers" or name not in QUANTIZED + EXPERTS:
            continue
        num_in = EXPERT_STACK if name in EXPERTS else in_axes(spec.shape, spec.hf_shape)
        stack = layers[name]
        layers[name] = [quantize(w, num_in) for w in stack] if isinstance(stack, list) else quantize(stack, num_in)
    return params


def quantize_rows(x: jax.Array, dtype=FP8, amax_reduce: Callable | None = None) -> tuple[jax.Array, jax.Array]:
    """Dynamic quantization of x [..., n] to `dtype` (fp8, or int8 symmetric and rounded): each
    row scaled so that its largest magnitude is half the type's range (448; 127.5 for int8,
    as compressed-tensors defines it, where vLLM's kernels take 127); the rows and their
    float32 scales [..., 1]. The arithmetic is each oracle's, to the last bit, since a last
    bit can move a value across a rounding jump: fp8 multiplies by 448 / amax (XLA may turn
    x / s into x * (1 / s)), int8 divides as compressed-tensors does. `amax_reduce` completes
    each row's largest magnitude over devices holding the rest of it."""
    x = x.astype(jnp.float32)
    amax = jnp.maximum(jnp.max(jnp.abs(x), axis=-1, keepdims=True), _TINY)
    if amax_reduce is not None:  # (the rows' other inputs are on other devices)
        amax = amax_reduce(amax)
    if jnp.dtype(dtype) == jnp.int8:
        # True divisions, as compressed-tensors computes them: a row's most negative extreme
        # lands on the tie -127.5, which the last bit decides, and XLA turns a division by a
        # constant or a broadcast into a multiplication by its reciprocal unless the divisor
        # is hidden from it.
        scale = amax / jax.lax.optimization_barrier(jnp.full_like(amax, INT8_HALF_RANGE))
        divisor = jax.lax.optimization_barrier(jnp.broadcast_to(scale, x.shape))
        return jnp.clip(jnp.round(x / divisor), -128, 127).astype(jnp.int8), scale
    return jnp.clip(x * (FP8_MAX / amax), -FP8_MAX, FP8_MAX).astype(FP8), amax / FP8_MAX


def quantize_groups(x2: jax.Array, groups: int, size: int, dtype) -> tuple[jax.Array, jax.Array]:
    """x2 [T, n] quantized per token and per group of `size` inputs (`quantize_rows`), as
    [T, groups, size] and scales [T, groups, 1]; a partial last group is padded with zeros,
    which change no group's largest magnitude."""
    padded = jnp.pad(x2, ((0, 0), (0, groups * size - x2.shape[1])))
    return quantize_rows(padded.reshape(x2.shape[0], groups, size), dtype)


def quantize_static(x: jax.Array, scale: jax.Array, dtype=FP8) -> jax.Array:
    """x / scale clipped to the range of `dtype` (fp8, or int8 rounded half to even) and
    cast, as compressed-tensors computes a static activation: a true division (hidden from
    XLA, which would multiply by the reciprocal, whose last bit can move a value across a
    rounding jump)."""
    divisor = jax.lax.optimization_barrier(jnp.broadcast_to(scale.astype(jnp.float32), x.shape))
    scaled = x.astype(jnp.float32) / divisor
    if jnp.dtype(dtype) == jnp.int8:
        return jnp.clip(jnp.round(scaled), -128, 127).astype(jnp.int8)
    return jnp.clip(scaled, -FP8_MAX, FP8_MAX).astype(FP8)


def quantized_matmul(x2: jax.Array, weight: QuantizedWeight, out_rows: int) -> jax.Array:
    """x2 [T, in] (any float) times a quantized weight, as [T, out_rows] float32. int4, or
    int8 `weight_only`: W4A16 / W8A16 (`_weight_only_matmul`). Other 8-bit values: x
    quantized per token (and per group of `group_size` inputs), or with the weight's static
    `input_scale`, an 8-bit x 8-bit matmul accumulated in float32 (int8: int32) per group,
    each product scaled by its token's and its row's scales, the groups summed."""
    if weight.value.dtype == jnp.int4 or weight.weight_only:
        return _weight_only_matmul(x2, weight, out_rows)
    wq = weight.value.reshape(out_rows, -1)
    # fp8 products accumulate in float32; int8 ones exactly, in int32
    accumulate = jnp.int32 if wq.dtype == jnp.int8 else jnp.float32
    if weight.input_scale is not None or not weight.group_size:
        if weight.input_scale is not None:  # static: one scale for every token, as calibrated
            xq, x_scale = quantize_static(x2, weight.input_scale, wq.dtype), weight.input_scale
        else:
            xq, x_scale = quantize_rows(x2, wq.dtype)
        out = jax.lax.dot_general(xq, wq, (((1,), (1,)), ((), ())), preferred_element_type=accumulate)
        return out.astype(jnp.float32) * x_scale * weight.scale.reshape(1, out_rows)
    size, groups = weight.group_size, weight.scale.shape[-1]
    xq, x_scale = quantize_groups(x2, groups, size, wq.dtype)
    wq = jnp.pad(wq, ((0, 0), (0, groups * size - wq.shape[-1]))).reshape(out_rows, groups, size)  # zeros add nothing
    out = jax.lax.dot_general(xq, wq, (((2,), (2,)), ((1,), (1,))), preferred_element_type=accumulate)  # [G, T, O]
    out = out.astype(jnp.float32)
    w_scale = weight.scale.reshape(out_rows, groups).T[:, None, :]
    return jnp.sum(out * jnp.moveaxis(x_scale, 1, 0) * w_scale, axis=0)


def _weight_only_matmul(x2: jax.Array, weight: QuantizedWeight, out_rows: int) -> jax.Array:
    """W4A16 or W8A16, float32. On a GPU, the Pallas kernel for an int4 weight on one device
    (`kernel`; int8 has none), else batched over the groups (`_weight_only_grouped`), so that
    the only op between the stored values and the matmul is the exact convert a GEMM reads
    in its prologue; on a CPU (and for a partial last group), the weight dequantized to x's
    type as the matmul's operand, which XLA:CPU runs faster (docs/design.md). Act-order:
    x's inputs taken in the values' order first."""
    if weight.perm is not None:
        x2 = jnp.take(x2, weight.perm, axis=1)
        weight = dataclasses.replace(weight, perm=None)
    dense = partial(_weight_only_dequantized, out_rows=out_rows)
    size = weight.group_size or x2.shape[-1]
    if weight.scale.shape[-1] * size != x2.shape[-1]:
        return dense(x2, weight)
    # (the kernel's steps take 32 inputs at least, inside one group)
    gpu = _int4_pallas if weight.kernel and size % 32 == 0 else _weight_only_grouped
    return jax.lax.platform_dependent(x2, weight, cpu=dense, default=partial(gpu, out_rows=out_rows))


def _int4_pallas(x2: jax.Array, weight: QuantizedWeight, out_rows: int, interpret: bool | None = None) -> jax.Array:
    """The Pallas W4A16 kernel: the int4 values bitcast to its two-a-byte layout (free on a GPU)."""
    groups = weight.scale.shape[-1]
    zero = None if weight.zero is None else weight.zero.reshape(out_rows, groups)
    return int4_matmul(x2, pack_int4(weight.value.reshape(out_rows, -1)), weight.scale.reshape(out_rows, groups), zero,
                       group_size=weight.group_size, interpret=interpret)


def single_device_kernels(params: dict) -> dict:
    """Every int4 weight of the layers marked for the Pallas W4A16 kernel (`QuantizedWeight.kernel`):
    for params on one device (int8 weight-only ones keep XLA's grouped matmul: the kernel
    reads int4 only; expert stacks choose their kernel in `jaxvllm.models.moe`, by how they are
    split)."""
    layers = params.get("layers", {})
    mark = lambda w: dataclasses.replace(w, kernel=True) if w.value.dtype == jnp.int4 else w  # noqa: E731
    for name, stack in layers.items():
        if name in EXPERTS:
            continue
        if isinstance(stack, QuantizedWeight):
            layers[name] = mark(stack)
        elif isinstance(stack, list) and stack and isinstance(stack[0], QuantizedWeight):
            layers[name] = [mark(w) for w in stack]
    return params


def _weight_only_dequantized(x2: jax.Array, weight: QuantizedWeight, out_rows: int) -> jax.Array:
    w = weight.dequantized(x2.dtype).reshape(out_rows, -1)
    return jax.lax.dot_general(x2, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def _weight_only_grouped(x2: jax.Array, weight: QuantizedWeight, out_rows: int) -> jax.Array:
    """x [T, G, size] times the values converted to x's type [O, G, size], batched over the
    groups; each group's product scaled by its row's scale, less the zero point times the
    group's sum of x, then summed."""
    groups = weight.scale.shape[-1]
    x3 = x2.reshape(x2.shape[0], groups, -1)
    # (int4 and int8 values are exact in any float: bf16 holds integers to 256)
    w3 = weight.value.reshape(out_rows, groups, -1).astype(x2.dtype)
    out = jax.lax.dot_general(x3, w3, (((2,), (2,)), ((1,), (1,))), preferred_element_type=jnp.float32)  # [G, T, O]
    scale = weight.scale.reshape(out_rows, groups).T[:, None, :]
    if weight.zero is not None:
        x_sums = jnp.sum(x3.astype(jnp.float32), axis=2).T[:, :, None]  # [G, T, 1]
        out = out - x_sums * weight.zero.reshape(out_rows, groups).T[:, None, :]
    return jnp.sum(out * scale, axis=0)


def is_weight_only(weight) -> bool:
    """Whether `weight` is a weight-only `QuantizedWeight` (int4, or int8 `weight_only`)."""
    return isinstance(weight, QuantizedWeight) and (weight.value.dtype == jnp.int4 or weight.weight_only)


def experts_dequantized(weight: QuantizedWeight, dtype) -> jax.Array:
    """A weight-only expert stack (values [E, in, out], scales and zero points [E, groups,
    out]) as the float stack [E, in, out] in `dtype` that it stands for, for the grouped
    matmul of float experts (W4A16 / W8A16 experts: x as it is): the CPU's path, and a
    GPU's where the grouped kernel does not serve (`weight_only_grouped_matmul`). Its cost
    there: each step writes this float copy of the stack (docs/design.md)."""
    if weight.perm is not None:  # (`check_expert_format` refuses act-order expert stacks)
        raise ValueError("act-order (perm) expert stacks are not supported")
    # Each expert as a weight [out, in] (groups along its last axis): `dequantized` of that.
    swap = lambda a: None if a is None else jnp.swapaxes(a, 1, 2)  # noqa: E731
    experts = dataclasses.replace(weight, value=swap(weight.value), scale=swap(weight.scale), zero=swap(weight.zero))
    return swap(experts.dequantized(dtype))


def quantized_grouped_matmul(rows: jax.Array, weight: QuantizedWeight, group_sizes: jax.Array, gmm: Callable,
                             amax_reduce: Callable | None = None, block_gmm: Callable | None = None) -> jax.Array:
    """rows [N, in] sorted by expert (`group_sizes` [E] each) times an 8-bit expert stack
    (`EXPERTS`), W8A8 as `quantized_matmul`: per group of inputs, rows quantized per token,
    `gmm(rows, values, group_sizes)` (a grouped matmul of 8-bit operands into float32:
    jax.lax.ragged_dot, or the Pallas kernel), each
    product scaled by its token's scale and its row's expert's column scales, the groups
    summed; float32 [N, out]. `amax_reduce`: how a token's largest magnitude is completed
    where the rows hold a slice of the inputs (one device's, under tensor parallelism).
    With several groups (block scales) and `block_gmm(rows, values, group_sizes, row_scales,
    scales, group_size)` (the Pallas kernel's block-scaled form), the rows are quantized per
    group at once and one call scales and sums every group's product."""
    value, scale = weight.value, weight.scale  # [E, in, out], [E, groups, out]
    n_in, groups = value.shape[1], scale.shape[1]
    size = weight.group_size or n_in
    if groups > 1 and block_gmm is not None:
        xq, x_scale = quantize_groups(rows, groups, size, value.dtype)
        return block_gmm(xq.reshape(rows.shape[0], -1)[:, :n_in], value, group_sizes, x_scale[..., 0], scale, size)
    expert_of_row = jnp.repeat(jnp.arange(value.shape[0]), group_sizes, total_repeat_length=rows.shape[0])
    out = jnp.zeros((rows.shape[0], value.shape[2]), jnp.float32)
    for g in range(groups):
        lo, hi = g * size, min((g + 1) * size, n_in)
        # (a block's inputs are never split over devices: only one scale over all inputs is completed)
        xq, x_scale = quantize_rows(rows[:, lo:hi], value.dtype, None if weight.group_size else amax_reduce)
        part = gmm(xq, value if groups == 1 else value[:, lo:hi], group_sizes)
        out = out + part.astype(jnp.float32) * x_scale * scale[expert_of_row, g]
    return out


def weight_only_grouped_matmul(rows: jax.Array, weight: QuantizedWeight, group_sizes: jax.Array, gmm: Callable,
                               block_m: int | None = None) -> jax.Array:
    """rows [N, in] sorted by expert (`group_sizes` [E] each) times a weight-only expert stack
    (int4, or int8 `weight_only`), in rows' dtype. On a GPU the Pallas grouped kernel
    (`pallas_kernels.grouped_int4_matmul`: the stored values read as they are, int4 bitcast
    two a byte along out, free; dequantized in registers; `block_m` its row tile); on a CPU,
    and for a stack the kernel does not take (`_grouped_kernel_takes`), `gmm(rows, float
    stack, group_sizes)` over `experts_dequantized` (x's dtype), as for float experts.
    For one device or per device (`shard_map`): the kernel call is opaque to XLA's SPMD
    partitioner."""
    def dense(rows, weight, group_sizes):
        return gmm(rows, experts_dequantized(weight, rows.dtype), group_sizes)

    if not _grouped_kernel_takes(weight, rows.shape[1]):
        return dense(rows, weight, group_sizes)
    kernel = partial(_grouped_weight_only_pallas, block_m=block_m)
    return jax.lax.platform_dependent(rows, weight, group_sizes, cpu=dense, default=kernel)


def _grouped_kernel_takes(weight: QuantizedWeight, n_in: int) -> bool:
    """Whether the grouped kernel takes a weight-only stack: whole groups of a multiple of 16
    inputs (its steps, at least 16 a dot, lie inside one group), no act-order, and (int4)
    an even number of outputs (two a byte)."""
    size = _stack_group(weight, n_in)
    return (weight.perm is None and weight.scale.shape[1] * size == n_in and size % 16 == 0
            and (weight.value.dtype != jnp.int4 or weight.value.shape[2] % 2 == 0))


def _grouped_weight_only_pallas(rows: jax.Array, weight: QuantizedWeight, group_sizes: jax.Array,
                                block_m: int | None = None, interpret: bool | None = None) -> jax.Array:
    """The Pallas grouped W4A16 / W8A16 kernel: int4 values bitcast two a byte (free on a GPU), int8 as they are."""
    values = pack_int4(weight.value) if weight.value.dtype == jnp.int4 else weight.value
    return grouped_int4_matmul(rows, values, group_sizes, weight.scale, weight.zero,
                               group_size=_stack_group(weight, rows.shape[1]), block_m=block_m, interpret=interpret,
                               out_dtype=rows.dtype)


def _stack_group(weight: QuantizedWeight, n_in: int) -> int:
    """An expert stack's inputs a group: all `n_in` when it has one group (whatever `group_size` says)."""
    return n_in if weight.scale.shape[1] == 1 else weight.group_size or n_in

"""Building blocks of the decoder: linear layers, norm, rotary embedding and paged attention.

Attention is where backends plug in: `attention_backend` picks the implementation of
the same contract (see `pallas_kernels/ragged_paged_attention.py`): "reference" (plain
jnp, any device) or "pallas" (the Pallas kernels: split-K decode kernel for 1-token
sequences, ragged kernel for the rest, both in every step unless the batch is decode-only,
`ModelInputs.decode_only`; compiled on GPU, interpret mode on CPU). The K/V write is
XLA's scatter on the donated cache for both. `DENSE_ATTENTION` is no engine backend: the
trainer-side forward's cache-free causal attention (`dense_causal_attention`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

from jaxvllm.batch import ModelInputs
from jaxvllm.config import ATTENTION_BACKENDS
from jaxvllm.lora.weights import LoRAWeight, lora_delta
from jaxvllm.model_config import RopeConfig
from jaxvllm.quantization import QuantizedWeight, quantized_matmul
from jaxvllm.sharding import AXIS
from pallas_kernels import mixed_paged_attention, ragged_paged_attention_reference, write_kv_reference
from pallas_kernels.common import as_bits, from_bits


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class InputMajorWeight:
    """A layer matrix stored inputs first: `value` [*in, *out], HF's [*out, *in] with its
    input axes moved to the front. The CPU layout (`loader.load_model`): XLA:CPU's YNNPACK
    dots read a weight stored [in, out] faster than one stored [out, in] at a few rows, and
    alike at one row. `shape` is the weight's own ([*out, *in]), as the other formats'."""

    value: jax.Array
    num_in: int = field(metadata=dict(static=True))

    @staticmethod
    def axes(ndim: int, num_in: int) -> tuple[int, ...]:
        """Where the value's axes come from in the weight ([*out, *in])."""
        return (*range(ndim - num_in, ndim), *range(ndim - num_in))

    @staticmethod
    def weight_axes(ndim: int, num_in: int) -> tuple[int, ...]:
        """Where the weight's axes are in the value (the inverse of `axes`)."""
        return (*range(num_in, ndim), *range(num_in))

    @classmethod
    def of(cls, weight: jax.Array, num_in: int) -> "InputMajorWeight":
        return cls(jnp.transpose(weight, cls.axes(weight.ndim, num_in)), num_in)

    def weight(self) -> jax.Array:
        """The weight in HF's [*out, *in] order (a transposed copy)."""
        return jnp.transpose(self.value, self.weight_axes(self.value.ndim, self.num_in))

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.value.shape[a] for a in self.weight_axes(self.value.ndim, self.num_in))

    @property
    def ndim(self) -> int:
        return self.value.ndim

    @property
    def dtype(self):
        return self.value.dtype


def linear(x: jax.Array, weight: jax.Array, bias: jax.Array | None = None, *,
           preferred_element_type=None) -> jax.Array:
    """x @ W for a weight in HF's [out, in] layout with its head axes explicit: x [T, *in]
    times weight [*out, *in] -> [T, *out] (q_proj [heads, head_dim, hidden] gives [T, heads,
    head_dim]; o_proj [hidden, heads, head_dim] takes them back). Every model matmul goes
    through here, so that a weight format (quantized: `jaxvllm.quantization`; stored inputs
    first: `InputMajorWeight`) or an adapter plugs in once: a `LoRAWeight` adds each
    token's adapter to the base product."""
    if isinstance(weight, LoRAWeight):
        out = linear(x, weight.base, bias, preferred_element_type=preferred_element_type)
        return out + lora_delta(x, weight).astype(out.dtype)
    out_axes = weight.shape[: weight.ndim - (x.ndim - 1)]  # x's axes after the first meet the weight's last
    contract = 1  # the weight's axis that meets x's inputs, as one [out, in] matrix
    if isinstance(weight, InputMajorWeight):
        weight, contract = weight.value, 0
    if isinstance(weight, QuantizedWeight):
        out = quantized_matmul(x.reshape(x.shape[0], -1), weight, math.prod(out_axes))
        out = out.reshape(x.shape[0], *out_axes).astype(preferred_element_type or x.dtype)
        return out if bias is None else out + bias
    # As one [T, in] x [out, in] (or [in, out]) matmul (free reshapes): XLA:CPU otherwise
    # copies a weight with several out or in axes into [in, out] order on every step.
    dtype = jnp.result_type(x, weight)
    w2 = weight.reshape(math.prod(out_axes), -1) if contract else weight.reshape(-1, math.prod(out_axes))
    x2, w2 = x.reshape(x.shape[0], -1).astype(dtype), w2.astype(dtype)
    # 16-bit operands accumulate in float32 and round once, as the platforms do anyway; asked
    # for, XLA:CPU multiplies bf16 weights as they are instead of converting every weight
    # to float32 on every step.
    accumulate = preferred_element_type or (jnp.float32 if jnp.dtype(dtype).itemsize < 4 else None)
    dot = partial(jax.lax.dot_general, dimension_numbers=(((1,), (contract,)), ((), ())),
                  preferred_element_type=accumulate)
    if x2.shape[0] == 1 and jnp.dtype(dtype).itemsize < 4:
        # XLA:CPU converts the whole weight for a one-row product of 16-bit operands (a
        # bf16 model's 1-token step): two rows, one of them zeros, take the path that
        # reads the weight as it is.
        out = jax.lax.platform_dependent(
            x2, w2, cpu=lambda a, b: dot(jnp.pad(a, ((0, 1), (0, 0))), b)[:1], default=dot)
    else:
        out = dot(x2, w2)
    out = out.reshape(x.shape[0], *out_axes).astype(preferred_element_type or dtype)
    return out if bias is None else out + bias


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm over the last axis, computed in float32 and cast back, as transformers does."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * x32.astype(x.dtype)


def rope_attention_scaling(rope: RopeConfig) -> float:
    """What cos and sin are multiplied by (1 but for YaRN: 0.1 * ln(factor) + 1 by default)."""
    if rope.rope_type != "yarn":
        return 1.0
    if rope.attention_factor is not None:
        return float(rope.attention_factor)

    def get_mscale(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    if rope.mscale and rope.mscale_all_dim:
        return float(get_mscale(rope.factor, rope.mscale) / get_mscale(rope.factor, rope.mscale_all_dim))
    return get_mscale(rope.factor)


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> np.ndarray:
    """Inverse frequencies [head_dim // 2] in float32, as transformers computes them."""
    exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / head_dim
    inv_freq = (1.0 / (rope.theta**exponents)).astype(np.float32)
    if rope.rope_type == "yarn":
        return _yarn_inv_freq(rope, head_dim, exponents)
    if rope.rope_type == "linear":
        return inv_freq / np.float32(rope.factor)
    if rope.rope_type == "llama3":
        low_wavelen = rope.original_max_position_embeddings / rope.low_freq_factor
        high_wavelen = rope.original_max_position_embeddings / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (rope.original_max_position_embeddings / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return np.where(medium, smoothed, scaled).astype(np.float32)
    return inv_freq


def _yarn_inv_freq(rope: RopeConfig, head_dim: int, exponents: np.ndarray) -> np.ndarray:
    """HF's YaRN blend: dimensions rotating more than `beta_fast` times over the original
    context keep their frequency, those below `beta_slow` are divided by `factor`, a
    linear ramp in between (float32 throughout, as torch computes it)."""
    pos_freqs = (np.float32(rope.theta) ** exponents).astype(np.float32)
    extrapolation = (np.float32(1.0) / pos_freqs).astype(np.float32)
    interpolation = (np.float32(1.0) / (np.float32(rope.factor) * pos_freqs)).astype(np.float32)

    def correction_dim(rotations: float) -> float:
        return (head_dim * math.log(rope.original_max_position_embeddings / (rotations * 2 * math.pi))) / (
            2 * math.log(rope.theta)
        )

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # as HF: no zero-width ramp
    ramp = np.clip((np.arange(head_dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    extrapolation_factor = (np.float32(1.0) - ramp).astype(np.float32)
    return (interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor).astype(np.float32)


def apply_rope(x: jax.Array, positions: jax.Array, rope: RopeConfig) -> jax.Array:
    """Rotate x [T, heads, head_dim] by its positions (HF's rotate-half convention)."""
    head_dim = x.shape[-1]
    inv_freq = jnp.asarray(rope_inv_freq(rope, head_dim))
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [T, D/2]
    angles = jnp.concatenate([angles, angles], axis=-1)[:, None, :]  # [T, 1, D]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    scaling = rope_attention_scaling(rope)  # YaRN's attention factor, applied to cos/sin in float32 as HF does
    if scaling != 1.0:
        cos, sin = cos * scaling, sin * scaling
    cos, sin = cos.astype(x.dtype), sin.astype(x.dtype)
    # rotate_half(x) = [-x2, x1], as a reversal of the two halves times [-1, 1]: exact, and
    # elementwise-fusible (a concatenate makes XLA start a fusion of its own).
    halves = x.reshape(*x.shape[:-1], 2, head_dim // 2)
    sign = jnp.asarray([[-1], [1]], x.dtype)
    rotated = (jnp.flip(halves, axis=-2) * sign).reshape(x.shape)
    return x * cos + rotated * sin


# Not an engine backend (`ATTENTION_BACKENDS` are those, which the engine's steps run on):
# `jaxvllm.models.sequence_logprobs`' attention, whole sequences over their own k/v, no cache.
DENSE_ATTENTION = "dense"


def paged_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    kv_cache: tuple[jax.Array, ...],
    layer: jax.Array,
    inputs: ModelInputs,
    *,
    sm_scale: float,
    sliding_window: int | None,
    backend: str,
    mesh: Mesh | None = None,
    logits_soft_cap: float | None = None,
    cache_bits: str | None = None,
) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """Write this step's k/v into layer `layer`'s pages of the cache, then attend; returns
    (out, new cache).

    The cache holds every layer (see `jaxvllm.kv_cache.allocate_kv_caches`): (k_cache,
    v_cache) [kv_heads, num_layers, num_blocks, block_size, head_dim] in the model's dtype,
    or for an fp8 KV cache (k_cache, v_cache, scales): float8 arrays and each layer's and KV
    head's float32 (k_scale, v_scale) [kv_heads, num_layers, 2]: the write quantizes,
    attention dequantizes; under a mesh the scales are split on KV heads with the cache.
    Scales with a third column are still to calculate from the first batch written
    (`calculate_kv_scales`). `layer` is an int32 scalar, traced or not: the kernels take
    the whole cache and block tables shifted to the layer's first block, so no layer is
    sliced out.
    With a mesh, each device does this for its own heads (`jax.shard_map`): q/k/v and the
    cache are split on heads, the batch's index arrays replicated. `logits_soft_cap` c
    (Gemma's `attn_logit_softcapping`) caps the scaled scores at c * tanh(s / c): the
    reference backend only, the Pallas kernels have no soft-capping. `cache_bits`: the
    cache's element type when k_cache and v_cache hold its bits as unsigned ints (see
    `jaxvllm.kv_cache.with_cache_storage`); viewed as that type inside, they cancel out.

    Backend `DENSE_ATTENTION` writes and reads no cache (`kv_cache` comes back as given, an
    empty tuple will do): `dense_causal_attention` of the step's own k/v, a batch of
    `inputs.seq_lens.shape[0]` rows of equal length, one sequence each."""
    if backend not in (*ATTENTION_BACKENDS, DENSE_ATTENTION):
        raise ValueError(f"unknown attention backend {backend!r}; choose from {ATTENTION_BACKENDS}")
    if logits_soft_cap is not None and backend == "pallas":
        raise ValueError(
            f"attention logit soft-capping (attn_logit_softcapping={logits_soft_cap}) is not supported by the "
            f"{backend!r} attention backend (its kernels have no soft-capping); use attention_backend='reference'"
        )
    if backend == DENSE_ATTENTION:
        local = partial(_dense_attention, sm_scale=sm_scale, sliding_window=sliding_window,
                        logits_soft_cap=logits_soft_cap)
    else:
        local = partial(_paged_attention, sm_scale=sm_scale, sliding_window=sliding_window, backend=backend,
                        logits_soft_cap=logits_soft_cap, cache_bits=cache_bits)
    layer = jnp.asarray(layer, jnp.int32)
    if mesh is None:
        return local(q, k, v, kv_cache, layer, inputs)
    heads = P(None, AXIS)
    cache = (P(AXIS),) * len(kv_cache)  # k, v [and an fp8 cache's scales]: split on KV heads
    return jax.shard_map(
        local, mesh=mesh, in_specs=(heads, heads, heads, cache, P(), P()), out_specs=(heads, cache),
        check_vma=False,  # Pallas calls carry no varying-axis annotations
    )(q, k, v, kv_cache, layer, inputs)


def _dense_attention(q, k, v, kv_cache, layer, inputs: ModelInputs, *, sm_scale, sliding_window, logits_soft_cap):
    out = dense_causal_attention(q, k, v, inputs.positions, inputs.seq_lens, sm_scale=sm_scale,
                                 sliding_window=sliding_window, logits_soft_cap=logits_soft_cap)
    return out, kv_cache


def dense_causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array, seq_lens: jax.Array, *,
                           sm_scale: float, sliding_window: int | None = None,
                           logits_soft_cap: float | None = None) -> jax.Array:
    """Attention of B = seq_lens.shape[0] sequences of T tokens each, laid out row after row
    (q [B * T, heads, head_dim], k/v [B * T, kv_heads, head_dim], positions [B * T]), each
    over its own k/v: no cache, no gather. Masks and numerics are the reference kernel's
    (`ragged_paged_attention_reference`): position p sees position j when j <= p, j < its
    seq_len and, with a window, j > p - sliding_window; float32 scores, soft-capped, softmax;
    out [B * T, heads, head_dim] in q's dtype, zeros for a query that sees nothing.

    Whole scores [B, heads, T, T] (float32) at once, as a trainer's eager attention: for
    the trainer-side forward (`jaxvllm.models.sequence_logprobs`), where the paged kernels
    would gather each query block's pages over a cache that holds nothing else."""
    b = seq_lens.shape[0]
    tokens, heads, head_dim = q.shape
    t, kv_heads = tokens // b, k.shape[1]
    group = heads // kv_heads
    # Head-major, each KV head's query heads' rows together (GQA): both products are plain
    # matmuls batched over (sequence, KV head); XLA:CPU is 4x slower on the token-major layout.
    q = q.reshape(b, t, kv_heads, group, head_dim).transpose(0, 2, 3, 1, 4).reshape(b, kv_heads, group * t, head_dim)
    k_h, v_h = (x.reshape(b, t, kv_heads, head_dim).transpose(0, 2, 1, 3) for x in (k, v))
    scores = jnp.einsum("bhqd,bhkd->bhqk", q, k_h, preferred_element_type=jnp.float32) * sm_scale
    scores = scores.reshape(b, kv_heads, group, t, t)
    if logits_soft_cap is not None:
        scores = logits_soft_cap * jnp.tanh(scores / logits_soft_cap)
    pos = positions.reshape(b, t)
    query_pos, key_pos = pos[:, None, None, :, None], pos[:, None, None, None, :]
    mask = (key_pos <= query_pos) & (key_pos < seq_lens[:, None, None, None, None])
    if sliding_window is not None:
        mask &= key_pos > query_pos - sliding_window
    scores = jnp.where(mask, scores, -jnp.inf)
    # As the reference: unnormalized probabilities in V's dtype, divided by their float32 sum
    # after the product (a row that sees no key: sum 0, output 0). The max, which the
    # softmax does not depend on, is a constant to the gradient.
    row_max = jax.lax.stop_gradient(scores.max(-1, keepdims=True))
    probs = jnp.exp(scores - jnp.where(row_max == -jnp.inf, 0.0, row_max))
    row_sum = probs.sum(-1, keepdims=True)
    out = jnp.einsum("bhqk,bhkd->bhqd", probs.reshape(b, kv_heads, group * t, t).astype(v.dtype), v_h,
                     preferred_element_type=jnp.float32).reshape(b, kv_heads, group, t, head_dim)
    out = out / jnp.where(row_sum > 0, row_sum, 1.0)
    return out.transpose(0, 3, 1, 2, 4).reshape(tokens, heads, head_dim).astype(q.dtype)


# The CPU reference attention's query blocks in buckets that take prefills: a block of up
# to 8 tokens of one sequence gathers that sequence's pages once, not once a token.
CPU_QUERY_BLOCK = 8


def reference_query_block(num_tokens: int, inputs: ModelInputs) -> int:
    """Query tokens per block of the reference attention in a step of `num_tokens` (the
    bucket). Blocks only with CPU loops, whose KV steps skip the unused blocks, and only in
    a step that verifies drafts or a bucket at least twice its sequence rows (max_num_seqs):
    every step of decodes alone fits the bucket below, and a decode token alone in a block
    of 8 would compute 8 rows."""
    if inputs.dynamic_loops and (inputs.verifies_drafts or num_tokens >= 2 * inputs.block_tables.shape[0]):
        return CPU_QUERY_BLOCK
    return 1


def _paged_attention(q, k, v, kv_cache, layer, inputs: ModelInputs, *, sm_scale, sliding_window, backend,
                     logits_soft_cap, cache_bits):
    k_cache, v_cache, *scales = kv_cache  # [scales] of an fp8 cache: [kv_heads, num_layers, 2 or 3]
    if cache_bits is not None:
        k_cache, v_cache = from_bits(k_cache, cache_bits), from_bits(v_cache, cache_bits)
    heads, num_layers, num_blocks, block_size, head_dim = k_cache.shape
    if scales:
        layer_scales = jax.lax.dynamic_index_in_dim(scales[0], layer, axis=1, keepdims=False)
        if layer_scales.shape[1] == 3:
            layer_scales = calculate_kv_scales(layer_scales, k, v, inputs.slot_mapping)
            scales = [jax.lax.dynamic_update_index_in_dim(scales[0], layer_scales, layer, axis=1)]
    k_scale, v_scale = (layer_scales[:, 0], layer_scales[:, 1]) if scales else (None, None)
    # Every layer's pages as one block axis (a free reshape), this layer's from its first
    # block on: its block ids and slots shifted there (padding slots, < 0, stay dropped).
    # XLA fuses the shifts into the tables' producer (sm_90a: no launch more a step).
    k_cache = k_cache.reshape(heads, num_layers * num_blocks, block_size, head_dim)
    v_cache = v_cache.reshape(k_cache.shape)
    first_block = layer * num_blocks
    slots = jnp.where(inputs.slot_mapping < 0, inputs.slot_mapping, inputs.slot_mapping + first_block * block_size)
    k_cache, v_cache = write_kv_reference(k_cache, v_cache, k, v, slots, k_scale, v_scale)
    attend = (partial(mixed_paged_attention, decode_only=inputs.decode_only) if backend == "pallas"
              else partial(ragged_paged_attention_reference, dynamic_kv_steps=inputs.dynamic_loops,
                           query_block=reference_query_block(q.shape[0], inputs)))
    if logits_soft_cap is not None:  # the reference (paged_attention refuses it for the kernels)
        attend = partial(attend, logits_soft_cap=logits_soft_cap)
    out = attend(
        q,
        k_cache,
        v_cache,
        inputs.positions,
        inputs.query_start_loc,
        inputs.seq_lens,
        inputs.block_tables + first_block,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        k_scale=k_scale,
        v_scale=v_scale,
    )
    stacked = (heads, num_layers, num_blocks, block_size, head_dim)
    k_cache, v_cache = k_cache.reshape(stacked), v_cache.reshape(stacked)
    if cache_bits is not None:
        k_cache, v_cache = as_bits(k_cache), as_bits(v_cache)
    return out, (k_cache, v_cache, *scales)


# vLLM's K_SCALE_CONSTANT and V_SCALE_CONSTANT: calculated scales store the first batch's
# largest |K| as 200 and |V| as 100, well inside e4m3's 448, for later values beyond them.
K_SCALE_RANGE, V_SCALE_RANGE = 200.0, 100.0


def calculate_kv_scales(scales: jax.Array, k: jax.Array, v: jax.Array, slot_mapping: jax.Array) -> jax.Array:
    """vLLM's `calculate_kv_scales`, per KV head: `scales` is float32 [kv_heads, 3], each
    head's (k_scale, v_scale, to_calculate). While to_calculate is 1, a step that writes
    tokens (slot >= 0) sets each head's k_scale = max|K| / K_SCALE_RANGE and v_scale = max|V|
    / V_SCALE_RANGE over them (1.0 for an all-zero head) and clears it: the scales come from
    the first batch and then stay, as vLLM's. (vLLM takes one maximum over all heads; per
    head, a head of small values keeps its precision, and under a mesh each device
    calculates its own heads' scales, with no collective.) Without a branch: the maxima are
    computed every step and kept only then."""
    written = slot_mapping >= 0
    amax = lambda x: jnp.max(jnp.where(written[:, None, None], jnp.abs(x.astype(jnp.float32)), 0.0),  # noqa: E731
                             axis=(0, 2))  # [T, kv_heads, D] -> [kv_heads]
    k_max, v_max = amax(k), amax(v)
    calculated = jnp.stack([jnp.where(k_max > 0, k_max / K_SCALE_RANGE, 1.0),
                            jnp.where(v_max > 0, v_max / V_SCALE_RANGE, 1.0), jnp.zeros_like(k_max)], axis=1)
    return jnp.where((scales[:, 2:] > 0) & jnp.any(written), calculated, scales)

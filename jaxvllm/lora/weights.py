"""LoRA on the device: every adapter slot's A and B of one target weight, and the delta a
batch's tokens add to its product, each token through its own slot's adapter.

A target's slots are stacked as A [slots, R, *in] and B [slots, *out, R] (the weight's own
[*out, *in] axes, heads explicit, so that a tensor-parallel split of the weight splits B's
out axes or A's in axes alike), with the adapter's scale folded into B and smaller ranks
zero-padded to R. A weight merged from P parts (q/k/v, gate/up: `merge`) holds the parts'
A one after the other on the rank axis ([slots, P R, *in], one product for all) and one B
per part ([slots, *part out, R]); the parts' deltas join as the merged weight's outputs do.

The delta is a masked pair of matmuls over every slot at once: x A^T [T, slots * R], each
token's columns of other slots zeroed, times B. Both are plain dense products of a few
columns (slots x R), with no gather and no branch; a token of slot -1 (no adapter) adds 0.
With `kernel` (the Pallas backend on one device), it is Punica's SGMV instead: the tokens
sorted by slot, and two grouped matmuls (`pallas_kernels.grouped_matmul`, the MoE
experts' kernel), each token through its own slot's A and B only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import jax
import jax.numpy as jnp

from jaxvllm.model_config import KV_GROUPS, SIDE_BY_SIDE
from pallas_kernels.grouped_matmul import grouped_matmul


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class LoRAWeight:
    """A linear weight with the adapter slots over it, as `layers.linear` receives it: `base`
    (an array or a `QuantizedWeight`), `a` [slots, P R, *in], `b` one [slots, *part out, R]
    per part, `slots` int32 [T], the slot of each token of the step (-1: none), how the
    parts' outputs join (`merge`: "" for one part), and for the delta as grouped matmuls
    the step's tokens grouped by slot (`groups`, `lora_groups`'; None: the dense form)."""

    base: object
    a: jax.Array
    b: tuple[jax.Array, ...]
    slots: jax.Array
    merge: str = field(default="", metadata=dict(static=True))
    groups: tuple[jax.Array, jax.Array, jax.Array] | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        return self.base.shape

    @property
    def ndim(self) -> int:
        return self.base.ndim


def lora_delta(x: jax.Array, weight: LoRAWeight) -> jax.Array:
    """Each token's scale * (x A_slot^T) B_slot^T, [T, *out], in the adapters' dtype."""
    a = weight.a
    num_slots, ranks = a.shape[:2]
    x2 = x.reshape(x.shape[0], -1).astype(a.dtype)
    if weight.groups is not None:
        return _grouped_delta(x2, weight)
    shrunk = jax.lax.dot_general(x2, a.reshape(num_slots * ranks, -1), (((1,), (1,)), ((), ())),
                                 preferred_element_type=jnp.float32)  # [T, slots * P R]
    own = weight.slots[:, None] == jnp.arange(num_slots, dtype=weight.slots.dtype)[None, :]  # [T, slots]
    shrunk = jnp.where(own[:, :, None], shrunk.reshape(-1, num_slots, ranks), 0).astype(a.dtype)
    rank = ranks // len(weight.b)
    deltas = [jax.lax.dot_general(shrunk[:, :, p * rank : (p + 1) * rank], b, (((1, 2), (0, b.ndim - 1)), ((), ())),
                                  preferred_element_type=jnp.float32).astype(a.dtype)  # [T, *part out]
              for p, b in enumerate(weight.b)]
    return _join(deltas, weight.merge)


def lora_groups(slots: jax.Array, num_slots: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """A step's tokens grouped by slot, once for all its LoRA weights: the order that sorts
    them (no adapter last), each slot's token count, and the order that puts them back."""
    slot = jnp.where(slots < 0, num_slots, slots)
    order = jnp.argsort(slot, stable=True)
    return order, jnp.zeros(num_slots, jnp.int32).at[slot].add(1, mode="drop"), jnp.argsort(order)


def _grouped_delta(x2: jax.Array, weight: LoRAWeight) -> jax.Array:
    """SGMV: the tokens sorted by slot (no adapter last: past the groups, so zeros), x A^T
    and then each part's B as grouped matmuls, the rows put back in the batch's order."""
    a = weight.a
    num_slots, ranks = a.shape[:2]
    order, sizes, back = weight.groups
    a_t = jnp.swapaxes(a.reshape(num_slots, ranks, -1), 1, 2)  # [slots, in, P R]
    shrunk = grouped_matmul(x2[order], a_t, sizes, out_dtype=jnp.float32).astype(a.dtype)  # [T, P R]
    rank = ranks // len(weight.b)
    deltas = []
    for p, b in enumerate(weight.b):
        b_t = jnp.swapaxes(b.reshape(num_slots, -1, rank), 1, 2)  # [slots, R, out]
        delta = grouped_matmul(shrunk[:, p * rank : (p + 1) * rank], b_t, sizes, out_dtype=jnp.float32)[back]
        deltas.append(delta.reshape(-1, *b.shape[1:-1]).astype(a.dtype))
    return _join(deltas, weight.merge)


def _join(parts: list[jax.Array], merge: str) -> jax.Array:
    """The parts' [T, ...] outputs as the merged weight's: q, k, v [T, heads, head_dim] into
    [T, kv_heads, group + 2, head_dim] (KV_GROUPS), gate, up into [T, 2, ...] (SIDE_BY_SIDE)."""
    if not merge:
        return parts[0]
    if merge == SIDE_BY_SIDE:
        return jnp.stack(parts, axis=1)
    assert merge == KV_GROUPS, merge
    q, k, v = parts
    heads = k.shape[1]
    return jnp.concatenate([q.reshape(q.shape[0], heads, -1, *q.shape[2:]), k[:, :, None], v[:, :, None]], axis=2)


def write_slot(stacks: dict, slot: jax.Array, arrays: dict) -> dict:
    """`stacks` (name -> (A [rows, slots, ...], (B [rows, slots, ...] per part))) with slot
    `slot` of each replaced by `arrays` (the same, less the slot axis); jit it with the
    stacks donated and the slot traced, so that a slot load never recompiles."""
    return jax.tree.map(lambda s, v: s.at[:, slot].set(v.astype(s.dtype)), stacks, arrays)

"""On-device sampling for the whole batch inside the jitted step.

Randomness is per request: the key of a row is fold_in(key(seed), output_index), so a
request's tokens depend only on its own seed and position, never on which other
requests share the batch, their order, or a preemption in between.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclass
class SamplingTensors:
    """Per-row sampling parameters, [S] each (padding rows: temperature 0)."""

    temperature: jax.Array  # float32; 0 = greedy
    seeds: jax.Array  # uint32
    output_index: jax.Array  # int32: how many tokens the request has generated so far


def sample(logits: jax.Array, t: SamplingTensors) -> jax.Array:
    """Token ids [S] from float32 logits [S, vocab]."""
    greedy = jnp.argmax(logits, axis=-1)  # ties -> lowest id, as torch.argmax

    def row_gumbel(seed, index):
        key = jax.random.fold_in(jax.random.key(seed), index)
        return jax.random.gumbel(key, (logits.shape[-1],), jnp.float32)

    gumbel = jax.vmap(row_gumbel)(t.seeds, t.output_index)
    temperature = jnp.where(t.temperature > 0, t.temperature, 1.0)[:, None]
    # Gumbel-max: argmax(logits / T + G) is a sample of softmax(logits / T).
    sampled = jnp.argmax(logits / temperature + gumbel, axis=-1)
    return jnp.where(t.temperature > 0, sampled, greedy).astype(jnp.int32)

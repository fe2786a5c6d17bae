"""Verifying draft tokens against the target model, as vLLM V1's `RejectionSampler` does,
so that speculative decoding changes no output's distribution.

A row verifies its d drafts (d <= K) with the target's logits at 1 + d positions, rows
logits_start .. logits_start + d of the step's logits: position j is the target's
distribution for the token after draft j - 1 (position 0: after the row's own last token). Drafts are accepted from the first while they pass:

- greedy rows: the draft is the target's argmax;
- random rows: a uniform draw u < p(draft) / q(draft), where p is the target's distribution
  after temperature, min-p, top-k and top-p, and q the proposer's. The n-gram proposer's q
  is one-hot, so u < p(draft).

Then one more token is sampled at the first position not accepted: from p with the
rejected draft masked (the normalized (p - q)+ of a one-hot q), or, when every draft
passed, from p itself (the bonus token). Each row thus emits between 1 and d + 1 tokens.
Every draw is keyed by (the row's seed, the output index it decides), so seeded requests
repeat exactly. Static shapes, no branches: the trip counts are K and the vocabulary.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxvllm.sampler import (Logprobs, SamplerFeatures, SamplerState, SamplingTensors, apply_top_k_top_p_min_p,
                             compute_logprobs, sample)

# Folded into an acceptance draw's key, so that it is independent of the sampler's draw
# for the same (seed, output index).
ACCEPT_STREAM = 1


def _draft_rows(draft_ids: jax.Array, num_drafts: jax.Array, logits_start: jax.Array, num_logits: int):
    """(which drafts are real [S, K], the logits row scoring each [S, K] (padding: past the
    end), the draft each logits row scores [L] (none: 0))."""
    valid = jnp.arange(draft_ids.shape[1]) < num_drafts[:, None]
    at = jnp.where(valid, logits_start[:, None] + jnp.arange(draft_ids.shape[1]), num_logits)
    return valid, at, jnp.zeros(num_logits, jnp.int32).at[at].set(draft_ids, mode="drop")


def num_accepted(logits: jax.Array, t: SamplingTensors, draft_ids: jax.Array, num_drafts: jax.Array,
                 logits_start: jax.Array, features: SamplerFeatures) -> jax.Array:
    """How many leading drafts each row accepts: int32 [S], from float32 `logits` [L, vocab]
    (row i's at logits_start[i] + j scores its draft j), `draft_ids` [S, K] and `num_drafts`
    [S] (the rest of a row's drafts: padding)."""
    rows, k = draft_ids.shape
    num_logits = logits.shape[0]
    valid, at, scored = _draft_rows(draft_ids, num_drafts, logits_start, num_logits)
    accepted = jnp.argmax(logits, axis=-1)[jnp.minimum(at, num_logits - 1)] == draft_ids
    if features.random:
        # Each logits row's sequence row (rows scoring no draft: row 0's, unused).
        owner = jnp.zeros(num_logits, jnp.int32).at[at].set(jnp.arange(rows)[:, None], mode="drop")
        temperature = jnp.where(t.temperature > 0, t.temperature, 1.0)[owner, None]
        x = apply_top_k_top_p_min_p(logits / temperature, t.top_k[owner], t.top_p[owner], t.min_p[owner], features)
        p = jnp.take_along_axis(jax.nn.softmax(x, axis=-1), scored[:, None], axis=-1)[:, 0]

        def draw(seed, index):
            key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), index), ACCEPT_STREAM)
            return jax.random.uniform(key, (), jnp.float32)

        positions = t.output_index[:, None] + jnp.arange(k)
        u = jax.vmap(jax.vmap(draw, in_axes=(None, 0)))(t.seeds, positions)
        is_random = ((t.temperature > 0) & (t.top_k != 1))[:, None]
        accepted = jnp.where(is_random, u < p[jnp.minimum(at, num_logits - 1)], accepted)
    accepted &= valid
    return jnp.sum(jnp.cumprod(accepted, axis=-1), axis=-1).astype(jnp.int32)


def sample_with_drafts(
    logits: jax.Array, t: SamplingTensors, state: SamplerState | None, features: SamplerFeatures,
    draft_ids: jax.Array, num_drafts: jax.Array, logits_start: jax.Array, logprobs_mode: str = "raw_logprobs",
    bitmask: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, Logprobs | None, SamplerState | None]:
    """(the token each row samples after its accepted drafts [S], how many it accepted [S],
    logprobs, state) from float32 `logits` [L, vocab], row i's 1 + num_drafts[i] of them from
    logits_start[i]. Rows with no drafts sample at their one logits row as `sample` would;
    the others use no state and no grammar (the engine drafts only for rows that do not).
    Logprobs, when asked, come per logits row [L]: row logits_start[i] + j is that of row
    i's j-th emitted token, its accepted drafts' of the raw logits (the engine drafts for
    rows with logprobs only in the raw modes), the last one's as `sample` gives it."""
    rows, k = draft_ids.shape
    num_logits = logits.shape[0]
    accepted = num_accepted(logits, t, draft_ids, num_drafts, logits_start, features)
    at = logits[jnp.minimum(logits_start + accepted, num_logits - 1)]
    rejected = jnp.take_along_axis(draft_ids, jnp.minimum(accepted, k - 1)[:, None], axis=1)[:, 0]
    banned = jnp.where(accepted < num_drafts, rejected, -1)
    t = dataclasses.replace(t, output_index=t.output_index + accepted)
    sampled, logprobs, state = sample(at, t, state, features, logprobs_mode, bitmask, banned)
    if features.logprobs:
        scored = _draft_rows(draft_ids, num_drafts, logits_start, num_logits)[2]
        drafts = compute_logprobs(logits, scored, features.logprobs, normalize=logprobs_mode.endswith("logprobs"))
        emitted = jnp.where(t.counts_sample, logits_start + accepted, num_logits)  # (others: dropped)
        logprobs = jax.tree.map(lambda d, last: d.at[emitted].set(last, mode="drop"), drafts, logprobs)
    return sampled, accepted, logprobs, state

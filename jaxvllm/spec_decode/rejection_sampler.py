"""Verifying draft tokens against the target model, as vLLM V1's `RejectionSampler` does,
so that speculative decoding changes no output's distribution.

A row verifies its d drafts (d <= K) with the target's logits at 1 + d positions, rows
logits_start .. logits_start + d of the step's logits: position j is the target's
distribution for the token after draft j - 1 (position 0: after the row's own last token).
Each position's logits go through every transform the row's sampling has, as if the drafts
before it had been sampled: the grammar's bitmask of that position, then the sampler state
with the earlier drafts counted (penalties, bad words) and min_tokens at that output index.
Drafts are accepted from the first while they pass:

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

from jaxvllm.sampler import (Logprobs, SamplerFeatures, SamplerState, SamplingTensors, apply_state,
                             apply_token_bitmask, compute_logprobs, draw, is_random, random_logits, record_outputs)

# Folded into an acceptance draw's key, so that it is independent of the sampler's draw
# for the same (seed, output index).
ACCEPT_STREAM = 1


def _logits_rows(t: SamplingTensors, num_drafts: jax.Array, logits_start: jax.Array, num_logits: int, k: int):
    """Each logits row's sampling tensors [L] (its sequence row's, at the output index it
    decides) and its position among that row's verified tokens [L]. Logits rows past the
    step's are row 0's first, unused. (A padding sequence row's logits_start is past the end.)"""
    verified = jnp.arange(k + 1)
    at = jnp.where(verified <= num_drafts[:, None], logits_start[:, None] + verified, num_logits)
    owner = jnp.zeros(num_logits, jnp.int32).at[at].set(jnp.arange(len(num_drafts))[:, None], mode="drop")
    position = jnp.zeros(num_logits, jnp.int32).at[at].set(verified, mode="drop")
    rows = jax.tree.map(lambda x: x[owner], t)
    return dataclasses.replace(rows, output_index=rows.output_index + position), owner, position, at


def _with_drafts(state: SamplerState, t: SamplingTensors, draft_ids: jax.Array, owner: jax.Array,
                 position: jax.Array, at: jax.Array, features: SamplerFeatures):
    """Each logits row's output counts [L, vocab] and last outputs [L, MAX_BAD_WORD_TOKENS - 1]
    (None without bad words), the drafts before its position included."""
    k = draft_ids.shape[1]
    before = jnp.arange(k) < jnp.arange(k + 1)[:, None]  # [K + 1, K]: draft m precedes position j
    counts = state.output_counts[t.slot[owner]]
    counts = counts.at[at[:, :, None], draft_ids[:, None, :]].add(before.astype(jnp.int32), mode="drop")
    recent = None
    if features.bad_words:
        history = jnp.concatenate([state.recent[t.slot], draft_ids], axis=1)[owner]
        width = state.recent.shape[1]
        recent = jnp.take_along_axis(history, position[:, None] + jnp.arange(width), axis=1)
    return counts, recent


def sample_with_drafts(
    logits: jax.Array, t: SamplingTensors, state: SamplerState | None, features: SamplerFeatures,
    draft_ids: jax.Array, num_drafts: jax.Array, logits_start: jax.Array, logprobs_mode: str = "raw_logprobs",
    bitmask: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, Logprobs | None, SamplerState | None]:
    """(the token each row samples after its accepted drafts [S], how many it accepted [S],
    logprobs, state) from float32 `logits` [L, vocab], row i's 1 + num_drafts[i] of them from
    logits_start[i], with `draft_ids` [S, K] (a row's drafts past num_drafts: padding) and,
    with `features.grammar`, a bitmask per logits row [L, words]. Rows with no drafts sample
    at their one logits row as `sample` would. The state counts every emitted token.
    Logprobs, when asked, come per logits row [L]: row logits_start[i] + j is that of row
    i's j-th emitted token."""
    k = draft_ids.shape[1]
    num_logits = logits.shape[0]
    rows_t, owner, position, at = _logits_rows(t, num_drafts, logits_start, num_logits, k)
    if features.grammar:
        logits = apply_token_bitmask(logits, bitmask)
    raw = logits
    if features.state:
        counts, recent = _with_drafts(state, t, draft_ids, owner, position, at, features)
        logits = apply_state(logits, rows_t, state, features, counts, recent)

    # Which drafts pass: row i's draft j is scored at logits row logits_start[i] + j.
    valid = jnp.arange(k) < num_drafts[:, None]
    scoring = jnp.minimum(jnp.where(valid, logits_start[:, None] + jnp.arange(k), num_logits), num_logits - 1)
    passed = jnp.argmax(logits, axis=-1)[scoring] == draft_ids
    if features.random:
        x = random_logits(logits, rows_t, features)
        p = jnp.take_along_axis(jax.nn.softmax(x[scoring], axis=-1), draft_ids[..., None], axis=-1)[..., 0]

        def uniform(seed, index):
            key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), index), ACCEPT_STREAM)
            return jax.random.uniform(key, (), jnp.float32)

        u = jax.vmap(jax.vmap(uniform, in_axes=(None, 0)))(t.seeds, t.output_index[:, None] + jnp.arange(k))
        passed = jnp.where(is_random(t)[:, None], u < p, passed)
    accepted = jnp.sum(jnp.cumprod(passed & valid, axis=-1), axis=-1).astype(jnp.int32)

    # The token after the accepted drafts: the rejected draft banned, or the bonus token.
    final = jnp.minimum(logits_start + accepted, num_logits - 1)
    rejected = jnp.take_along_axis(draft_ids, jnp.minimum(accepted, k - 1)[:, None], axis=1)[:, 0]
    banned = jnp.where(accepted < num_drafts, rejected, -1)
    final_t = dataclasses.replace(t, output_index=t.output_index + accepted)
    sampled, processed = draw(logits[final], final_t, features, banned)
    if features.state:
        emitted = jnp.concatenate([draft_ids, sampled[:, None]], axis=1)
        emitted = jnp.where(jnp.arange(k + 1) == accepted[:, None], sampled[:, None], emitted)
        state = record_outputs(state, t, emitted, accepted + 1, features)

    logprobs = None
    if features.logprobs:
        normalize = logprobs_mode.endswith("logprobs")
        if logprobs_mode.startswith("raw"):
            source, last_source = raw, raw[final]
        else:
            source = jnp.where(is_random(rows_t)[:, None], x, logits) if features.random else logits
            last_source = processed
        scored = draft_ids[owner, jnp.minimum(position, k - 1)]  # the draft each logits row scores
        drafts = compute_logprobs(source, scored, features.logprobs, normalize=normalize)
        last = compute_logprobs(last_source, sampled, features.logprobs, normalize=normalize)
        emitted_at = jnp.where(t.counts_sample, logits_start + accepted, num_logits)  # (others: dropped)
        logprobs = jax.tree.map(lambda d, e: d.at[emitted_at].set(e, mode="drop"), drafts, last)
    return sampled, accepted, logprobs, state

"""Verifying draft tokens against the target model, as vLLM V1's `RejectionSampler` does,
so that speculative decoding changes no output's distribution.

A row verifies its d drafts (d <= K) with the target's logits at 1 + d positions, rows
logits_start .. logits_start + d of the step's logits: position j is the target's
distribution for the token after draft j - 1 (position 0: after the row's own last token).
Each position's logits go through every transform the row's sampling has, as if the drafts
before it had been sampled: the grammar's bitmask of that position, then the sampler state
with the earlier drafts counted (penalties, bad words) and min_tokens at that output index.
Every proposer's drafts are argmaxes, so the proposal q is one-hot, and vLLM's rule
(accept a draft with probability min(1, p / q), p the target's distribution after
temperature, min-p, top-k and top-p; at the first rejection sample from the normalized
(p - q)+; after the last draft, a bonus token from p) comes down to: accept it with
probability p(draft); if rejected, sample from p without it. Drawing x from p at each
position and accepting while the draft is x does exactly that, so each position draws its
token as `sample` would at that output index, with the same key (the row's seed and the
output index), and the row emits its drafts up to the first that is not its draw, then
that draw (the draw after the last draft, when all pass): between 1 and d + 1 tokens.

The draws being those of sampling without drafts, a seeded request's output is the same
with or without speculative decoding, whatever drafts were offered: with any method and
K, with async scheduling or not, and however max_tokens or free blocks cap the drafts.
Greedy rows are the temperature-0 case (the draw is the argmax). Static shapes, no
branches: the trip counts are K and the vocabulary.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxvllm.sampler import (Logprobs, SamplerFeatures, SamplerState, SamplingTensors, apply_state,
                             apply_token_bitmask, compute_logprobs, draw, record_outputs)


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

    # Every verified position draws the token `sample` would draw there, keyed by (seed,
    # output index); a draft passes when it is that token. Row i's draft j is scored at
    # logits row logits_start[i] + j, and the row emits the draws up to its first miss.
    drawn, processed = draw(logits, rows_t, features)
    draws = drawn[jnp.minimum(logits_start[:, None] + jnp.arange(k + 1), num_logits - 1)]  # [S, K + 1]
    passed = (draws[:, :k] == draft_ids) & (jnp.arange(k) < num_drafts[:, None])
    accepted = jnp.sum(jnp.cumprod(passed, axis=-1), axis=-1).astype(jnp.int32)
    sampled = jnp.take_along_axis(draws, accepted[:, None], axis=1)[:, 0]
    if features.state:  # the first accepted + 1 draws are what the row emits
        state = record_outputs(state, t, draws, accepted + 1, features)

    logprobs = None
    if features.logprobs:  # per logits row, of its draw: the token it emits, up to the row's first miss
        source = raw if logprobs_mode.startswith("raw") else processed
        logprobs = compute_logprobs(source, drawn, features.logprobs, normalize=logprobs_mode.endswith("logprobs"))
    return sampled, accepted, logprobs, state

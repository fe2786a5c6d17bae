"""Build the flat `ModelInputs` batch by hand, as the engine's model runner will.

Tests use this to drive the model (any architecture: `jaxvllm.models.forward`) through
the paged cache with block tables of their choosing (shuffled, non-contiguous), chunked
prefill and padding; the parity runs that every architecture's tests share are here too.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import torch

from jaxvllm import ModelInputs
from jaxvllm.models import forward


@dataclass
class Chunk:
    """Tokens `token_ids` of one sequence, starting at position `start`, cached in `blocks`."""

    token_ids: list[int]
    start: int
    blocks: list[int]


def build_inputs(
    chunks: list[Chunk],
    block_size: int,
    *,
    all_logits: bool = False,
    pad_tokens_to: int | None = None,
    pad_seqs_to: int | None = None,
    max_blocks: int = 16,
) -> ModelInputs:
    ids, positions, slots, starts, seq_lens, tables, last = [], [], [], [0], [], [], []
    for c in chunks:
        pos = np.arange(c.start, c.start + len(c.token_ids))
        blocks = np.asarray(c.blocks)
        ids += list(c.token_ids)
        positions += list(pos)
        slots += list(blocks[pos // block_size] * block_size + pos % block_size)
        starts.append(starts[-1] + len(c.token_ids))
        seq_lens.append(c.start + len(c.token_ids))
        tables.append(np.pad(blocks, (0, max_blocks - len(blocks))))
        last.append(starts[-1] - 1)
    num_tokens = len(ids)
    logits_indices = list(range(num_tokens)) if all_logits else last
    pad_t = (pad_tokens_to or num_tokens) - num_tokens
    pad_s = (pad_seqs_to or len(chunks)) - len(chunks)
    i32 = lambda x: jnp.asarray(np.asarray(x, dtype=np.int32))  # noqa: E731
    return ModelInputs(
        input_ids=i32(ids + [0] * pad_t),
        positions=i32(positions + [0] * pad_t),
        slot_mapping=i32(slots + [-1] * pad_t),
        query_start_loc=i32(starts + [starts[-1]] * pad_s),
        seq_lens=i32(seq_lens + [0] * pad_s),
        block_tables=i32(tables + [np.zeros(max_blocks)] * pad_s),
        logits_indices=i32(logits_indices + [0] * (pad_s if not all_logits else 0)),
    )


jit_forward = jax.jit(forward, static_argnums=(3, 4), donate_argnums=(1,))


def random_tokens(rng: np.random.Generator, n: int) -> list[int]:
    """n ids of the tiny test vocabulary, past its special tokens."""
    return [int(t) for t in rng.integers(3, 384, size=n)]


def greedy_decode(params, cfg, caches, prompt: list[int], steps: int, blocks: list[int], block_size: int):
    """The prompt in one step, then `steps` greedy tokens one step each, in `blocks`:
    (all tokens, the logits of every step's token)."""
    logits, caches = jit_forward(params, caches, build_inputs([Chunk(prompt, 0, blocks)], block_size), cfg, "reference")
    tokens, got = list(prompt), [np.asarray(logits[0])]
    for _ in range(steps):
        tokens.append(int(np.argmax(got[-1])))
        inputs = build_inputs([Chunk(tokens[-1:], len(tokens) - 1, blocks)], block_size)
        logits, caches = jit_forward(params, caches, inputs, cfg, "reference")
        got.append(np.asarray(logits[0]))
    return tokens, got


MIXED_BLOCKS = ([4, 1, 22], [7, 2, 19, 11, 26, 14])  # of sequences a and b in `mixed_steps`


def mixed_steps(params, cfg, caches, rng: np.random.Generator, block_size: int, backend: str = "reference"):
    """Two padded steps: all of a (10 tokens) and the first 9 tokens of b (21; the chunk ends
    mid-block); then a decodes its greedy token while b's prefill finishes. Returns
    (a, b, a's token, step 1's logits, step 2's logits, caches)."""
    a, b = random_tokens(rng, 10), random_tokens(rng, 21)
    blocks_a, blocks_b = MIXED_BLOCKS
    step1 = build_inputs([Chunk(a, 0, blocks_a), Chunk(b[:9], 0, blocks_b)], block_size, pad_tokens_to=32)
    logits1, caches = jit_forward(params, caches, step1, cfg, backend)
    next_a = int(np.argmax(logits1[0]))
    step2 = build_inputs([Chunk([next_a], 10, blocks_a), Chunk(b[9:], 9, blocks_b)], block_size, pad_tokens_to=32)
    logits2, caches = jit_forward(params, caches, step2, cfg, backend)
    return a, b, next_a, logits1, logits2, caches


def mixed_errors(hf, a, b, next_a, logits1, logits2) -> list[float]:
    """`rel_err` of `mixed_steps`' four sequence logits against HF's."""
    return [rel_err(logits1[0], hf_logits(hf, a)[-1]), rel_err(logits1[1], hf_logits(hf, b[:9])[-1]),
            rel_err(logits2[0], hf_logits(hf, a + [next_a])[-1]), rel_err(logits2[1], hf_logits(hf, b)[-1])]


def hf_logits(model, token_ids: list[int]) -> np.ndarray:
    """Logits [len, vocab] of HF transformers for one sequence (float32, CPU)."""
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0].numpy()


def hf_greedy(model, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """HF transformers' greedy completion of each prompt, generated alone."""
    want = []
    with torch.no_grad():
        for p in prompts:
            out = model.generate(torch.tensor([p]), max_new_tokens=max_tokens, do_sample=False,
                                 attention_mask=torch.ones(1, len(p), dtype=torch.long))
            want.append(out[0, len(p):].tolist())
    return want


def rel_err(got, want) -> float:
    """Max abs error divided by the reference's max |logit| (the logit scale)."""
    want = np.asarray(want)
    return float(np.abs(np.asarray(got) - want).max() / np.abs(want).max())

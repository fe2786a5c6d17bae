"""Build the flat `ModelInputs` batch by hand, as the engine's model runner will.

Tests use this to drive the model through the paged cache with block tables of their
choosing (shuffled, non-contiguous), chunked prefill and padding.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import torch

from jaxvllm import ModelInputs
from jaxvllm.models.llama import forward


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


def hf_logits(model, token_ids: list[int]) -> np.ndarray:
    """Logits [len, vocab] of HF transformers for one sequence (float32, CPU)."""
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0].numpy()


def rel_err(got, want) -> float:
    """Max abs error divided by the reference's max |logit| (the logit scale)."""
    want = np.asarray(want)
    return float(np.abs(np.asarray(got) - want).max() / np.abs(want).max())

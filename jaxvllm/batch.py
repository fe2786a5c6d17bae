"""The flat batch one engine step feeds to the model (unpacked on the device from the
step's packed buffer, see `jaxvllm.input_batch`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import jax


@jax.tree_util.register_dataclass
@dataclass
class ModelInputs:
    """T = padded token count (a bucket), S = sequence rows (min(max_num_seqs, T), fixed per bucket).

    input_ids [T], positions [T]: the tokens computed this step and their positions.
    slot_mapping [T]: cache slot (block_id * block_size + offset) each token's K/V goes
        to; -1 for padding tokens.
    query_start_loc [S+1]: sequence s owns tokens query_start_loc[s]:query_start_loc[s+1]
        (padding sequences repeat the last value: zero tokens).
    seq_lens [S]: context length of each sequence after this step (cached + new).
    block_tables [S, max_blocks]: physical block ids of each sequence, in logical order.
    logits_indices [R]: the token rows that get logits (the runner asks for each
        sequence's last token, R = S; a test may ask for every row).
    decode_only (static): the host's promise that sequence s owns token s alone (or
        nothing): every row brings one token. The pallas backend then runs the decode
        kernel only, on the tokens as they are (no ragged kernel, gather or scatter).
    lora_slots [T]: each token's LoRA adapter slot (-1: none); None in a step without
        adapters, which then computes what an engine without LoRA does.
    lora_kernel (static): the adapters' delta as grouped matmuls (SGMV, the pallas backend
        on one device) rather than dense masked ones (`jaxvllm.lora.weights`).
    dynamic_loops (static): loops may run a number of times that depends on the batch (the
        reference attention's KV loop stops at the last column used). Only on a CPU, whose
        runtime runs loops without the host; on a GPU every loop keeps a known trip count.
    verifies_drafts (static): rows may bring drafts to verify (1 + K tokens of one sequence),
        which the CPU reference attention then runs in query blocks.
    """

    input_ids: jax.Array
    positions: jax.Array
    slot_mapping: jax.Array
    query_start_loc: jax.Array
    seq_lens: jax.Array
    block_tables: jax.Array
    logits_indices: jax.Array
    lora_slots: jax.Array | None = None
    decode_only: bool = field(default=False, metadata=dict(static=True))
    dynamic_loops: bool = field(default=False, metadata=dict(static=True))
    lora_kernel: bool = field(default=False, metadata=dict(static=True))
    verifies_drafts: bool = field(default=False, metadata=dict(static=True))

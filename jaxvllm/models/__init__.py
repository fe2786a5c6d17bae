"""Model implementations, picked by the `architectures` entry of config.json.

Each architecture is a module of plain functions that satisfies `common.Model`:
`param_specs(cfg)`, `hidden_states(params, kv_caches, inputs, cfg, attention_backend,
mesh, aux_layers)` and `compute_logits(params, hidden, cfg)`. `forward` below runs any of them on a batch;
`sequence_logprobs` scores whole sequences, differentiably (a trainer's forward).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jaxvllm.batch import ModelInputs
from jaxvllm.model_config import SUPPORTED_ARCHITECTURES, ModelConfig
from jaxvllm.models import gemma3, llama
from jaxvllm.models.common import Model

# Every supported architecture but Gemma 3 is the Llama-family decoder; what differs between
# them are flags of `ModelConfig` (bias, qk-norm, sliding windows, rope, tied embeddings, MoE).
MODELS: dict[str, Model] = dict.fromkeys(SUPPORTED_ARCHITECTURES, llama)
# Gemma 3 has its own decoder layer (four norms, (1 + w) RMSNorm, scaled embeddings, two RoPEs).
MODELS["Gemma3ForCausalLM"] = gemma3


def forward(params: dict, kv_caches: tuple, inputs: ModelInputs, cfg: ModelConfig, attention_backend: str = "reference",
            mesh: Mesh | None = None) -> tuple[jax.Array, tuple]:
    """Run the flat batch through `cfg`'s architecture; returns (float32 logits [S, vocab]
    for `logits_indices`, new caches). A pure function of (params, kv_caches, inputs): jit
    it with `cfg` and the backend static and the caches donated."""
    model = MODELS[cfg.architecture]
    hidden, kv_caches, _ = model.hidden_states(params, kv_caches, inputs, cfg, attention_backend, mesh)
    return model.compute_logits(params, hidden[inputs.logits_indices], cfg), kv_caches


def sequence_logprobs(params: dict, cfg: ModelConfig, token_ids: jax.Array, lengths: jax.Array | None = None,
                      temperature: float = 1.0, block_size: int = 16) -> jax.Array:
    """log p(token_ids[b, t + 1] | token_ids[b, :t + 1]), float32 [B, T - 1], of a batch of
    sequences [B, T] (rows shorter than T: `lengths`, the rest 0): the trainer's side of RL,
    differentiable in `params` (the engine's own pytree, `LLM.get_params()`, with `cfg` its
    `llm.llm_engine.model_config`), with logits divided by `temperature` first, as the
    engine's "processed_logprobs" of a sampled token are (with no other processing).

    The layers are the engine's: each sequence is one prefill over a fresh paged cache of
    its own (a cache the step writes, then reads, for plain causal attention), on the
    reference attention, so these are the logprobs the engine computes for the same tokens.
    """
    token_ids = jnp.asarray(token_ids, jnp.int32)
    b, t = token_ids.shape
    lengths = jnp.full((b,), t, jnp.int32) if lengths is None else jnp.asarray(lengths, jnp.int32)
    cfg = dataclasses.replace(cfg, kv_cache_bits=None)  # (the cache in the model's dtype, as a plain array)
    blocks = -(-t // block_size)
    dtype = jax.tree.leaves(params["layers"])[0].dtype
    cache = jnp.zeros((cfg.num_kv_heads, cfg.num_layers, b * blocks, block_size, cfg.head_dim), dtype)
    pos = jnp.arange(t, dtype=jnp.int32)
    real = pos[None, :] < lengths[:, None]
    rows = jnp.arange(b, dtype=jnp.int32)
    inputs = ModelInputs(
        input_ids=token_ids.reshape(-1), positions=jnp.tile(pos, b),
        slot_mapping=jnp.where(real, rows[:, None] * blocks * block_size + pos[None, :], -1).reshape(-1),
        query_start_loc=jnp.arange(b + 1, dtype=jnp.int32) * t, seq_lens=jnp.full((b,), t, jnp.int32),
        block_tables=rows[:, None] * blocks + jnp.arange(blocks, dtype=jnp.int32)[None, :],
        logits_indices=jnp.arange(b * t, dtype=jnp.int32))
    model = MODELS[cfg.architecture]
    hidden, _, _ = model.hidden_states(params, (cache, cache), inputs, cfg, "reference")
    logits = model.compute_logits(params, hidden, cfg).reshape(b, t, -1)[:, :-1] / temperature
    chosen = jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), token_ids[:, 1:, None], axis=-1)[..., 0]
    return jnp.where(real[:, 1:], chosen, 0.0)

"""Model implementations, picked by the `architectures` entry of config.json.

Each architecture is a module of plain functions that satisfies `common.Model`:
`param_specs(cfg)`, `hidden_states(params, kv_caches, inputs, cfg, attention_backend,
mesh, aux_layers)` and `compute_logits(params, hidden, cfg)`. `forward` below runs any of them on a batch;
`sequence_logprobs` scores whole sequences, differentiably (a trainer's forward).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jaxvllm.batch import ModelInputs
from jaxvllm.layers import DENSE_ATTENTION
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
                      temperature: float = 1.0) -> jax.Array:
    """log p(token_ids[b, t + 1] | token_ids[b, :t + 1]), float32 [B, T - 1], of a batch of
    sequences [B, T] (rows shorter than T: `lengths`, the rest 0): the trainer's side of RL,
    differentiable in `params` (the engine's own pytree, `LLM.get_params()`, with `cfg` its
    `llm.llm_engine.model_config`), with logits divided by `temperature` first, as the
    engine's "processed_logprobs" of a sampled token are (with no other processing).

    The layers are the engine's, so these are the logprobs the engine computes for the same
    tokens. Attention differs in form only: plain causal attention over each row's own k/v
    (`layers.DENSE_ATTENTION`, with the reference kernel's masks and numerics), no paged
    cache: one would hold nothing but these rows, and the reference attention gathers its
    pages for every query block, and under `jax.grad` keeps each KV step's gathered pages
    for the backward pass (figures in docs/design.md).
    """
    token_ids = jnp.asarray(token_ids, jnp.int32)
    b, t = token_ids.shape
    lengths = jnp.full((b,), t, jnp.int32) if lengths is None else jnp.asarray(lengths, jnp.int32)
    pos = jnp.arange(t, dtype=jnp.int32)
    real = pos[None, :] < lengths[:, None]
    no_slots = jnp.zeros((0,), jnp.int32)  # (what only a paged cache reads)
    inputs = ModelInputs(
        input_ids=token_ids.reshape(-1), positions=jnp.tile(pos, b), slot_mapping=no_slots,
        query_start_loc=jnp.arange(b + 1, dtype=jnp.int32) * t, seq_lens=lengths,
        block_tables=jnp.zeros((b, 0), jnp.int32), logits_indices=jnp.arange(b * t, dtype=jnp.int32))
    model = MODELS[cfg.architecture]
    hidden, _, _ = model.hidden_states(params, (), inputs, cfg, DENSE_ATTENTION)
    logits = model.compute_logits(params, hidden, cfg).reshape(b, t, -1)[:, :-1] / temperature
    chosen = jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), token_ids[:, 1:, None], axis=-1)[..., 0]
    return jnp.where(real[:, 1:], chosen, 0.0)

"""Model implementations, picked by the `architectures` entry of config.json.

Each architecture is a module of plain functions that satisfies `common.Model`:
`param_specs(cfg)`, `hidden_states(params, kv_caches, inputs, cfg, attention_backend,
mesh, aux_layers)` and `compute_logits(params, hidden, cfg)`. `forward` below runs any of them on a batch.
"""

from __future__ import annotations

import jax
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

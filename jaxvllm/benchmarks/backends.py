"""Build the backend a bench command asked for, both from the same flags."""

from __future__ import annotations

import argparse
from typing import Any

import jax

from jaxvllm.config import EngineConfig
from jaxvllm.dummy import ModelSource


def make_backend(name: str, source: ModelSource, args: argparse.Namespace, engine_kwargs: dict[str, Any],
                 hf_batch_size: int | None = None):
    """"jaxvllm" -> JaxvllmBackend(LLM(...)); "hf" -> HFBackend with the same dtype and step budget.

    hf_batch_size: padded generate's batch (default --hf-batch-size).
    """
    if name == "hf":
        from jaxvllm.benchmarks.hf_backend import HFBackend

        # jaxvllm's effective values
        config = EngineConfig(model=source.path, **engine_kwargs).for_platform(jax.default_backend())
        return HFBackend(
            source, dtype=config.dtype, mode=args.hf_mode, batch_size=hf_batch_size or args.hf_batch_size,
            max_num_batched_tokens=config.max_num_batched_tokens, max_num_seqs=config.max_num_seqs, seed=args.seed,
        )
    from jaxvllm.benchmarks.jaxvllm_backend import JaxvllmBackend

    return JaxvllmBackend(source.path, **engine_kwargs)

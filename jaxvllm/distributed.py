"""vLLM's `vllm.distributed.cleanup_dist_env_and_memory`, which its examples call between engines."""

from __future__ import annotations

import gc


def cleanup_dist_env_and_memory(shutdown_ray: bool = False) -> None:
    """Free the device memory of engines nobody refers to any more. vLLM also tears down its
    process groups here; jaxvllm runs in one process and has none (`shutdown_ray` is accepted
    and ignored). `LLM.shutdown()` frees an engine's memory even while references remain."""
    gc.collect()

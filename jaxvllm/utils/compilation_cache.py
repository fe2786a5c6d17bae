"""The persistent JAX compilation cache the engine turns on (`EngineConfig.compilation_cache_dir`)."""

from __future__ import annotations

import jax


def use_compilation_cache(folder: str | None) -> None:
    """Cache compiled steps in `folder` (None: leave JAX's settings alone), so that a second
    start skips compiling. JAX's cache is process-wide, so this sets it for the process;
    a `jax_compilation_cache_dir` the user set first wins."""
    if folder is None or jax.config.jax_compilation_cache_dir is not None:
        return
    jax.config.update("jax_compilation_cache_dir", folder)
    # Small models compile in under JAX's default 1 s threshold; cache them too.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)

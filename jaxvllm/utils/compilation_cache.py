"""The persistent JAX compilation cache the engine turns on (`EngineConfig.compilation_cache_dir`),
and a count of what compiling cost (for start-up figures and the cache's hits)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

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


@dataclass
class CompileCounts:
    """What compiled over a span (`count_compilations`): XLA compilations (each
    persistent-cache hit included), and the persistent cache's hits and misses."""

    compilations: int = 0
    cache_hits: int = 0
    cache_misses: int = 0


_EVENTS = {"/jax/compilation_cache/cache_hits": "cache_hits", "/jax/compilation_cache/cache_misses": "cache_misses"}
_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


@contextmanager
def count_compilations() -> Iterator[CompileCounts]:
    """Count the compilations of this process while the block runs (JAX reports them
    process-wide, so another thread's compiles in that time count too)."""
    counts, lock = CompileCounts(), threading.Lock()

    def on_event(event: str, **kwargs) -> None:
        if event in _EVENTS:
            with lock:
                setattr(counts, _EVENTS[event], getattr(counts, _EVENTS[event]) + 1)

    def on_duration(event: str, seconds: float, **kwargs) -> None:
        if event == _COMPILE_EVENT:
            with lock:
                counts.compilations += 1

    jax.monitoring.register_event_listener(on_event)
    jax.monitoring.register_event_duration_secs_listener(on_duration)
    try:
        yield counts
    finally:
        jax.monitoring.unregister_event_listener(on_event)
        jax.monitoring.unregister_event_duration_listener(on_duration)

"""What every benchmark script shares, whatever it measures: timing, fault-tolerant
measurements, a one-line summary, and the environment and JSON that go with the figures.

Here rather than in `bench` so that a script timing something else (`aot_check`,
jaxvllm's `engine_step` and `bench throughput|latency`) need not import the kernel
benchmarks; like the whole package, it imports nothing from jaxvllm.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp


def time_fn(fn: Callable, *args, iters: int, warmup: int = 1) -> float:
    """Median wall seconds of `fn(*args)` (compiled before timing)."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def time_donated(fn: Callable, state: Any, *, iters: int) -> tuple[float, Any]:
    """Median wall seconds of `state = fn(state)` where `fn` donates its argument (an update
    in place, as the engine's caches): each call takes the last one's output. Returns the
    time and the final state. The first call is not timed."""
    state = jax.block_until_ready(fn(state))
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        state = jax.block_until_ready(fn(state))
        times.append(time.perf_counter() - start)
    return statistics.median(times), state


def tuning_name(tuning: dict) -> str:
    """A tuning's keyword arguments as the JSON key of its figures ("default" when none)."""
    return ",".join(f"{k}={v}" for k, v in tuning.items()) or "default"


def attempt(results: dict, name: str, fn: Callable[[], dict]) -> None:
    """Run one measurement; a failure is recorded (and printed), not fatal."""
    try:
        results[name] = fn()
    except Exception as e:  # a peer missing on this JAX version, an unsupported backend, OOM
        results[name] = {"error": f"{type(e).__name__}: {e}"[:500]}
        traceback.print_exc(limit=3)


def max_abs_err(a, b) -> float:
    """In float32, so that low-precision outputs compare on equal terms."""
    return float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))


def summary(d: dict) -> str:
    """One line of headline figures, one per measurement in `d`."""
    parts = []
    for name, v in d.items():
        if not isinstance(v, dict):
            continue
        if "error" in v:
            parts.append(f"{name}=ERROR")
            continue
        for k in ("best_tb_s", "tb_s", "read_plus_write_tb_s", "best_tflop_s", "tflop_s", "step_ms"):
            if k in v:
                parts.append(f"{name} {k}={v[k]:.3g}")
                break
    return ", ".join(parts)


def environment() -> dict[str, Any]:
    """Versions, host and devices, for the JSON. Touches JAX's devices: call it once JAX may
    take them (after another framework's runs have given theirs back)."""
    import jaxlib

    devices = jax.devices()
    return {
        "python": platform.python_version(),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "backend": jax.default_backend(),
        "devices": [str(d) for d in devices],
        "device_kind": devices[0].device_kind,
        "num_devices": len(devices),
        "hostname": platform.node(),
    }


def json_path(given: str | None, name: str) -> str | None:
    """`--json`'s value, else $OUT/`name` when $OUT is set (the GPU scripts collect $OUT)."""
    return given or (os.path.join(os.environ["OUT"], name) if os.environ.get("OUT") else None)


def write_json(path: str | os.PathLike | None, results: dict) -> None:
    """Nothing when `path` is None. Values JSON has no type for (dtypes, shapes' objects) are
    written as their str rather than failing a run at its end."""
    if path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(results, indent=2, default=str) + "\n")

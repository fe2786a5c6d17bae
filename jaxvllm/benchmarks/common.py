"""What `bench throughput` and `bench latency` share: flags, backends, timings, environment, JSON."""

from __future__ import annotations

import argparse
import json
import platform
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

BACKENDS = ("jaxvllm", "hf", "both")


@dataclass
class RunTimings:
    """One run of a request list: wall time and per-request milestones (seconds from the run start)."""

    elapsed: float
    output_token_ids: list[list[int]]
    ttft: list[float] = field(default_factory=list)  # time to first token
    e2e: list[float] = field(default_factory=list)  # time to the last token
    setup_seconds: float = 0.0  # before the clock started (HF continuous batching: its cache and warm-up)
    output_texts: list[str] = field(default_factory=list)  # jaxvllm's (structured outputs are checked on them)

    @property
    def num_output_tokens(self) -> int:
        return sum(len(ids) for ids in self.output_token_ids)

    def tpot(self) -> list[float]:
        """Time per output token after the first, per request with at least 2 tokens."""
        return [
            (e - t) / (len(ids) - 1) for t, e, ids in zip(self.ttft, self.e2e, self.output_token_ids) if len(ids) > 1
        ]


def add_bench_args(parser: argparse.ArgumentParser) -> None:
    """Flags of both bench commands (the engine flags come from `jaxvllm.engine_args`)."""
    parser.add_argument("--model", required=True,
                        help="checkpoint folder, or dummy:tiny | dummy:qwen3-0.6b | dummy:llama3-8b (random weights)")
    parser.add_argument("--backend", choices=BACKENDS, default="jaxvllm",
                        help="jaxvllm, HF transformers (hf), or both on the same requests with their ratio")
    parser.add_argument("--hf-mode", choices=("auto", "cb", "padded"), default="auto",
                        help="HF: continuous batching (cb, transformers' generate_batch) or padded generate; "
                             "auto = cb where available")
    parser.add_argument("--hf-batch-size", type=int, default=64, help="HF padded generate: requests per batch")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (both backends)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompts and of dummy weights")
    parser.add_argument("--output-json", type=Path, help="write the figures, config and environment here")
    parser.add_argument("--disable-tqdm", action="store_true", help="no progress bar during generation")


def backend_names(backend: str) -> list[str]:
    """The backends to run, in order. HF goes first: it hands its device memory back
    before JAX takes its own pool, which JAX would otherwise keep for the process."""
    return ["hf", "jaxvllm"] if backend == "both" else [backend]


def stats(values: list[float]) -> dict[str, float]:
    """mean and p50 / p90 / p99 of a list of seconds (zeros when empty)."""
    if not values:
        return {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0}
    a = np.asarray(values, dtype=np.float64)
    return {"mean": float(a.mean()), **{f"p{q}": float(np.percentile(a, q)) for q in (50, 90, 99)}}


def environment(hf_device: str | None = None) -> dict[str, Any]:
    """Versions and devices, for the JSON. Touches JAX's devices: call it after the runs."""
    import jax
    import transformers

    import jaxvllm

    devices = jax.devices()
    env = {
        "jaxvllm_version": jaxvllm.__version__,
        "jax_version": jax.__version__,
        "transformers_version": transformers.__version__,
        "python_version": platform.python_version(),
        "platform": jax.default_backend(),
        "device": devices[0].device_kind,
        "num_devices": len(devices),
        "hostname": platform.node(),
    }
    torch = sys.modules.get("torch")
    if torch is not None:
        env["torch_version"] = torch.__version__
    if hf_device is not None:
        env["hf_device"] = hf_device
    return env


def write_json(path: Path | None, result: dict) -> None:
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {path}")

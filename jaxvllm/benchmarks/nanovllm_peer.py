"""Peer measurement: nano-vllm's host time per decode step, for comparison with host_step.

A peer measurement, never a dependency: nano-vllm (github.com/GeeeekExplorer/nano-vllm)
is imported from a checkout given on the command line, and none of its code lives here:

    python -m jaxvllm.benchmarks.nanovllm_peer --nanovllm /tmp/nano-vllm \
        [--num-requests 256 1024] [--prompt-len 512] [--steps 50] [--json PATH]

Its own Scheduler, BlockManager and Sequence run, and ModelRunner.prepare_decode +
prepare_sample build the batch on an object made with `ModelRunner.__new__` (no model,
no GPU). Run-time shims, all outside nano-vllm's files:
- `nanovllm.models.qwen3` is a stub module while nano-vllm is imported (the model
  imports triton and flash-attn, which the batch building never uses);
- Config reads a two-line config.json in a temp dir instead of a model;
- while the steps run, `torch.tensor` drops `pin_memory=True` and `Tensor.cuda` is the
  identity, so the tensors stay on the CPU (the pinned copies and the H2D transfer a GPU
  would add are therefore not counted).
nano-vllm refuses temperature 0, so the requests sample at temperature 1.0; temperature is
only copied into a tensor, so the host cost is the same as greedy.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path
from unittest import mock

import numpy as np

from jaxvllm.benchmarks.common import print_host_step, summarize

PARTS = ("schedule", "prepare", "update", "total")
VOCAB = 32000


def _import_nanovllm(path: str) -> types.SimpleNamespace:
    if path not in sys.path:
        sys.path.insert(0, path)
    stub = types.ModuleType("nanovllm.models.qwen3")  # the model: triton, flash-attn
    stub.Qwen3ForCausalLM = None
    inserted = "nanovllm.models.qwen3" not in sys.modules
    if inserted:
        sys.modules["nanovllm.models.qwen3"] = stub
    try:
        from nanovllm.config import Config
        from nanovllm.engine.model_runner import ModelRunner
        from nanovllm.engine.scheduler import Scheduler
        from nanovllm.engine.sequence import Sequence
        from nanovllm.sampling_params import SamplingParams
    finally:
        if inserted:
            sys.modules.pop("nanovllm.models.qwen3", None)
    return types.SimpleNamespace(Config=Config, ModelRunner=ModelRunner, Scheduler=Scheduler,
                                 Sequence=Sequence, SamplingParams=SamplingParams)


@contextlib.contextmanager
def _cpu_tensors():
    """nano-vllm's prepare code, unchanged, but its tensors stay on the CPU."""
    import torch

    tensor = torch.tensor

    def cpu_tensor(*args, pin_memory=False, **kwargs):
        return tensor(*args, **kwargs)

    with mock.patch.object(torch, "tensor", cpu_tensor), \
            mock.patch.object(torch.Tensor, "cuda", lambda self, *a, **k: self):
        yield


def _commit(path: str) -> str | None:
    try:
        out = subprocess.run(["git", "-C", path, "rev-parse", "HEAD"], capture_output=True, text=True, check=True)
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def time_nanovllm(path: str, num_requests: int, prompt_len: int, steps: int, seed: int = 0) -> dict:
    nv = _import_nanovllm(path)
    rng = np.random.default_rng(seed)
    with tempfile.TemporaryDirectory() as model_dir:  # what Config reads with AutoConfig
        Path(model_dir, "config.json").write_text(json.dumps({"model_type": "qwen3", "max_position_embeddings": 40960}))
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        block_size = nv.Config.__dataclass_fields__["kvcache_block_size"].default  # nano-vllm's default, 256
        assert block_size == nv.Sequence.block_size
        blocks_per_seq = -(-(prompt_len + steps + 1) // block_size)
        config = nv.Config(model_dir, max_num_seqs=num_requests, max_num_batched_tokens=max(16384, num_requests),
                           num_kvcache_blocks=num_requests * blocks_per_seq)  # room for all: no preemption
    scheduler = nv.Scheduler(config)
    params = nv.SamplingParams(temperature=1.0, max_tokens=1 << 30, ignore_eos=True)
    for _ in range(num_requests):
        scheduler.add(nv.Sequence(rng.integers(0, VOCAB, prompt_len).tolist(), params))

    runner = nv.ModelRunner.__new__(nv.ModelRunner)  # only what prepare_decode / prepare_sample read
    runner.block_size = block_size

    prefill_steps = 0
    while scheduler.waiting:  # untimed: prefill (chunked) until every request is decoding
        seqs, is_prefill = scheduler.schedule()
        assert is_prefill
        scheduler.postprocess(seqs, rng.integers(0, VOCAB, len(seqs)).tolist(), is_prefill)
        prefill_steps += 1

    sampled = rng.integers(0, VOCAB, (steps, num_requests)).tolist()  # the stubbed device step
    times = {p: [] for p in PARTS}
    clock = time.perf_counter
    with _cpu_tensors():
        for k in range(steps):
            t0 = clock()
            seqs, is_prefill = scheduler.schedule()
            t1 = clock()
            runner.prepare_decode(seqs)
            runner.prepare_sample(seqs)
            t2 = clock()
            scheduler.postprocess(seqs, sampled[k], is_prefill)
            t3 = clock()
            assert not is_prefill and len(seqs) == num_requests, "every request should decode every step"
            for part, dt in zip(PARTS, (t1 - t0, t2 - t1, t3 - t2, t3 - t0)):
                times[part].append(dt)

    return {"parts": summarize(times, num_requests), "num_requests": num_requests, "steps": steps, "prompt_len": prompt_len,
            "prefill_steps": prefill_steps, "block_size": block_size, "source": path, "commit": _commit(path)}


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nanovllm", required=True, metavar="PATH", help="a nano-vllm checkout (the folder holding nanovllm/)")
    ap.add_argument("--num-requests", type=int, nargs="+", default=[256, 1024])
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--steps", type=int, default=50, help="timed decode steps")
    ap.add_argument("--json", type=Path, help="write the figures here")
    args = ap.parse_args(argv)
    if args.steps < 1 or args.prompt_len < 1 or min(args.num_requests) < 1:
        ap.error("--steps, --prompt-len and --num-requests must be >= 1")
    if not Path(args.nanovllm, "nanovllm").is_dir():
        ap.error(f"{args.nanovllm} holds no nanovllm/ package")
    path = str(Path(args.nanovllm).resolve())
    results = []
    for n in args.num_requests:
        r = time_nanovllm(path, n, args.prompt_len, args.steps)
        results.append(r)
        commit = r["commit"][:12] if r["commit"] else "unknown commit"
        print_host_step(r, f"block {r['block_size']}", f"nano-vllm {commit}: ")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()

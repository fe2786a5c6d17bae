"""One decode step of a dummy model on each attention backend, timed on the same inputs.

    python -m jaxvllm.benchmarks.engine_step            # Qwen3-0.6B-shaped, 256 x 1024 (needs a GPU)
    python -m jaxvllm.benchmarks.engine_step --small    # the tiny model, kernels interpreted: CPU
    python -m jaxvllm.benchmarks.engine_step --json out.json

At 256 x 1024 (`step`) and at 8 sequences x 128 tokens (`floor_step`: a step's fixed
cost; the pallas backend only). The model forward plus a greedy argmax, KV caches
donated, for the `reference` and `pallas` backends, and `pallas` over an fp8 KV cache
(`pallas_fp8`): step time, KV bytes
read per second, the host's time to dispatch a step (the call's return, before the
device is done: what the engine's host pays per step for it), the same steps back to
back as the engine runs them (`pipelined_step_ms`, and `busy_dispatch_ms`: a call's
return while the step before still runs; near the step time, dispatch waits for the
device and the host's work cannot overlap it; `device_put_*`: the same with the inputs
handed to `jax.device_put` before each call, to tell a GPU's own dispatch from its copy of
numpy inputs), copies of the cache in the compiled HLO
(should be 0), and whether the backends' greedy tokens agree. It
complements `python -m pallas_kernels.bench` (the kernels alone), whose harness
(`pallas_kernels.harness`) it uses; it lives here because the kernel package imports
nothing from jaxvllm.
Figures go to stdout and to JSON (`--json PATH`, default $OUT/engine_step.json when
$OUT is set).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxvllm.batch import ModelInputs
from jaxvllm.model_config import ModelConfig
from jaxvllm.dummy import get_dummy
from jaxvllm.kv_cache import CACHE_STEP_COMPILER_OPTIONS, allocate_kv_caches
from jaxvllm.loader import dummy_params
from jaxvllm.models import forward
from pallas_kernels.bench import DTYPE
from pallas_kernels.common import cdiv
from pallas_kernels.harness import attempt, environment, json_path, summary, write_json
from pallas_kernels.hlo import count_cache_copies

# `floor`: a step with few short sequences, whose time is the step's fixed cost (weights, the
# launches of every kernel): what each of the many steps of a batch's tail costs at least.
FULL = dict(model="qwen3-0.6b", num_seqs=256, context=1024, block_size=16, iters=20, floor=(8, 128))
SMALL = dict(model="tiny", num_seqs=4, context=48, block_size=8, iters=2, floor=(2, 16))


# name -> (attention backend, KV cache dtype; None: the model's)
BACKENDS = {"reference": ("reference", None), "pallas": ("pallas", None), "pallas_fp8": ("pallas", jnp.float8_e4m3fn)}


def bench_step(cfg: dict, iters: int, backends=tuple(BACKENDS)) -> dict:
    mcfg = ModelConfig.from_hf(get_dummy(cfg["model"]).make_config())
    params = dummy_params(mcfg, DTYPE, seed=0)
    s, ctx, bs = cfg["num_seqs"], cfg["context"], cfg["block_size"]
    max_blocks = cdiv(ctx, bs)
    num_blocks = s * max_blocks + 1
    perm = np.random.default_rng(0).permutation(num_blocks)[: s * max_blocks].reshape(s, max_blocks)
    pos = np.full(s, ctx - 1, np.int32)
    i32 = lambda x: jnp.asarray(np.asarray(x, np.int32))  # noqa: E731
    inputs = ModelInputs(
        input_ids=i32(np.random.default_rng(1).integers(3, min(mcfg.vocab_size, 30000), s)),
        positions=i32(pos),
        slot_mapping=i32(perm[:, (ctx - 1) // bs] * bs + (ctx - 1) % bs),
        query_start_loc=i32(np.arange(s + 1)),
        seq_lens=i32(np.full(s, ctx)),
        block_tables=i32(perm),
        logits_indices=i32(np.arange(s)),
    )
    kv_elements_per_step = 2 * mcfg.num_layers * s * ctx * mcfg.num_kv_heads * mcfg.head_dim
    kv_bytes_per_step = kv_elements_per_step * jnp.dtype(DTYPE).itemsize
    result: dict[str, Any] = {"model": cfg["model"], "num_seqs": s, "context": ctx, "kv_bytes_per_step": kv_bytes_per_step}

    def step_of(backend):
        def step(params, caches, inputs):
            logits, caches = forward(params, caches, inputs, mcfg, backend)
            return jnp.argmax(logits, axis=-1), caches

        return jax.jit(step, donate_argnums=(1,), compiler_options=CACHE_STEP_COMPILER_OPTIONS)  # (the runner's)

    for name in backends:
        backend, cache_dtype = BACKENDS[name]
        cache_dtype = cache_dtype or DTYPE

        def run(backend=backend, cache_dtype=cache_dtype):
            scales = None if cache_dtype == DTYPE else np.ones((mcfg.num_layers, mcfg.num_kv_heads, 2), np.float32)
            caches = allocate_kv_caches(mcfg, num_blocks, bs, cache_dtype, scales=scales)
            fn = step_of(backend)
            compiled = fn.lower(params, caches, inputs).compile()
            copies = count_cache_copies(compiled.as_text(), caches[0].shape)
            # Not harness.time_fn: the donated caches must be handed from one call to the next.
            times, dispatch = [], []
            for i in range(iters + 1):
                start = time.perf_counter()
                tokens, caches = fn(params, caches, inputs)
                returned = time.perf_counter()
                jax.block_until_ready(tokens)
                if i:  # the first call may still load the executable
                    times.append(time.perf_counter() - start)
                    dispatch.append(returned - start)
            t = statistics.median(times)
            pipelined, busy_dispatch, caches = back_to_back(fn, params, caches, inputs, iters)
            put_pipelined, put_dispatch, caches = back_to_back(fn, params, caches, inputs, iters, jax.device_put)
            kv_bytes = kv_elements_per_step * jnp.dtype(cache_dtype).itemsize
            return {"step_ms": t * 1e3, "dispatch_ms": statistics.median(dispatch) * 1e3,
                    "pipelined_step_ms": pipelined * 1e3, "busy_dispatch_ms": busy_dispatch * 1e3,
                    "device_put_pipelined_step_ms": put_pipelined * 1e3,
                    "device_put_busy_dispatch_ms": put_dispatch * 1e3,
                    "kv_tb_s": kv_bytes / t / 1e12, "cache_copies_in_hlo": copies,
                    "tokens_head": np.asarray(tokens[:8]).tolist()}

        attempt(result, name, run)
    ref, pal, fp8 = (result.get(name, {}) for name in ("reference", "pallas", "pallas_fp8"))
    if "tokens_head" in ref and "tokens_head" in pal:
        result["greedy_tokens_equal_head"] = ref["tokens_head"] == pal["tokens_head"]
    if "step_ms" in pal and "step_ms" in fp8:
        result["fp8_speedup_vs_pallas"] = pal["step_ms"] / fp8["step_ms"]
    print(f"step {cfg['model']} {s}x{ctx}: {summary(result)}", flush=True)
    for name in backends:
        r = result.get(name, {})
        if "pipelined_step_ms" in r:
            print(f"  {name}: step {r['step_ms']:.3f} ms, dispatch {r['dispatch_ms']:.3f} ms; back to back "
                  f"{r['pipelined_step_ms']:.3f} ms per step, dispatch {r['busy_dispatch_ms']:.3f} ms "
                  f"(inputs put first: {r['device_put_pipelined_step_ms']:.3f} ms per step, dispatch "
                  f"{r['device_put_busy_dispatch_ms']:.3f} ms with the put)", flush=True)
    return result


def back_to_back(fn, params, caches, inputs, iters: int, transfer=None) -> tuple[float, float, Any]:
    """Steps as the engine runs them: each dispatched while the one before still runs, its
    inputs given as numpy (which the call copies in, as the runner's packed batch is), or
    handed to `transfer` first (`jax.device_put`: whether a GPU's call returns sooner when
    its inputs are already on their way). Returns (seconds per step, the median seconds a
    call took to return, the transfer's included, the caches). A call that returns only
    once the step before is done (busy dispatch near the step time) would leave the host
    no time to overlap its work with the device's."""
    host_inputs = jax.tree.map(np.asarray, inputs)
    transfer = transfer or (lambda x: x)
    tokens, caches = fn(params, caches, transfer(host_inputs))  # (numpy arguments: a cache entry of their own)
    jax.block_until_ready(tokens)
    returned = []
    start = time.perf_counter()
    for _ in range(iters):
        call = time.perf_counter()
        tokens, caches = fn(params, caches, transfer(host_inputs))
        returned.append(time.perf_counter() - call)
    jax.block_until_ready(tokens)
    return (time.perf_counter() - start) / iters, statistics.median(returned), caches


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="the tiny model, kernels interpreted (runs on CPU)")
    parser.add_argument("--iters", type=int, default=None, help="timed repetitions (median)")
    parser.add_argument("--json", default=None, help="write results here (default $OUT/engine_step.json if $OUT is set)")
    args = parser.parse_args(argv)

    cfg = SMALL if args.small else FULL
    if not args.small and jax.default_backend() == "cpu":
        parser.error("the full shapes need a GPU; use --small on CPU")
    iters = args.iters or cfg["iters"]
    num_seqs, context = cfg["floor"]
    results = {"small": args.small, "iters": iters, "env": environment(), "config": cfg, "step": bench_step(cfg, iters),
               "floor_step": bench_step(dict(cfg, num_seqs=num_seqs, context=context), iters,
                                        backends=("pallas", "pallas_fp8"))}
    path = json_path(args.json, "engine_step.json")
    if path:
        write_json(path, results)
        print(f"wrote {path}")
    return results


if __name__ == "__main__":
    main(sys.argv[1:])

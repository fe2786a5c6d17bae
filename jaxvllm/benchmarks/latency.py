"""`jaxvllm bench latency`: how long one batch takes, end to end and per token (vLLM's flag names).

Each iteration generates `--batch-size` requests of `--input-len` prompt tokens and
exactly `--output-len` output tokens. Every iteration has fresh random prompts, so
that a prefix cache cannot turn later iterations into cache hits. The first
`--num-iters-warmup` iterations are not counted; the engine's own start-up
(weights, compiling the buckets) is reported apart.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from tqdm.auto import tqdm

from jaxvllm.benchmarks import datasets as ds
from jaxvllm.benchmarks.backends import make_backend
from jaxvllm.benchmarks.common import add_bench_args, backend_names, stats, write_report
from jaxvllm.benchmarks.throughput import prompt_vocab_size
from jaxvllm.dummy import resolve_model
from jaxvllm.engine_args import add_engine_args, engine_kwargs

_METRICS = (("e2e_latency", "end-to-end"), ("ttft", "TTFT"), ("tpot", "TPOT"))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_bench_args(parser)
    group = parser.add_argument_group("workload")
    group.add_argument("--batch-size", type=int, default=8, help="requests per iteration")
    group.add_argument("--input-len", type=int, default=32, help="prompt tokens per request")
    group.add_argument("--output-len", type=int, default=128, help="generated tokens per request (EOS ignored)")
    group.add_argument("--num-iters-warmup", type=int, default=10, help="iterations run before timing")
    group.add_argument("--num-iters", type=int, default=30, help="timed iterations")
    add_engine_args(parser)


def check_args(args: argparse.Namespace) -> None:
    if min(args.batch_size, args.input_len, args.output_len, args.num_iters) < 1 or args.num_iters_warmup < 0:
        raise ValueError("--batch-size, --input-len, --output-len and --num-iters must be >= 1, "
                         "--num-iters-warmup >= 0")


def iterations(args: argparse.Namespace, vocab_size: int) -> list[list[ds.BenchRequest]]:
    """Warm-up then timed iterations, each with its own seed (the same lists for every backend)."""
    count = args.num_iters_warmup + args.num_iters
    return [
        ds.random_requests(args.batch_size, args.input_len, args.output_len, vocab_size, seed=args.seed + k)
        for k in range(count)
    ]


def measure(backend, batches: list[list[ds.BenchRequest]], num_warmup: int, temperature: float,
            use_tqdm: bool = True) -> dict[str, Any]:
    start = time.perf_counter()
    backend.warmup(batches[0])
    warmup_bar = tqdm(batches[:num_warmup], desc=f"{backend.name} warm-up iterations", disable=not use_tqdm)
    for batch in warmup_bar:
        backend.run(batch, temperature=temperature, use_tqdm=False)
    warmup_iters = time.perf_counter() - start
    latencies, ttft, tpot = [], [], []
    for batch in tqdm(batches[num_warmup:], desc=f"{backend.name} timed iterations", disable=not use_tqdm):
        run = backend.run(batch, temperature=temperature, use_tqdm=False)
        latencies.append(run.elapsed)
        ttft += run.ttft
        tpot += run.tpot()
    return {
        "e2e_latency": stats(latencies), "ttft": stats(ttft), "tpot": stats(tpot), "latencies": latencies,
        "load_seconds": backend.load_seconds, "warmup_seconds": backend.warmup_seconds,
        "warmup_iters_seconds": warmup_iters,
    }


def print_result(label: str, r: dict[str, Any]) -> None:
    print(f"{label}: load {r['load_seconds']:.2f} s, warm-up {r['warmup_seconds']:.2f} s + "
          f"{r['warmup_iters_seconds']:.2f} s of warm-up iterations (not counted)")
    for key, name in _METRICS:
        s = r[key]
        print(f"  {name:<11} mean {1e3 * s['mean']:9.2f} ms   p50 {1e3 * s['p50']:9.2f} ms   "
              f"p90 {1e3 * s['p90']:9.2f} ms   p99 {1e3 * s['p99']:9.2f} ms")


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark the flags describe; print and return its figures (and write --output-json)."""
    results: dict[str, dict[str, Any]] = {}
    hf_device = None
    with resolve_model(args.model) as source:
        batches = iterations(args, prompt_vocab_size(source, args.tokenizer))
        kwargs = engine_kwargs(args, source, seed=args.seed, max_model_len=args.input_len + args.output_len)
        print(f"{args.num_iters} iterations of {args.batch_size} requests, {args.input_len} prompt + "
              f"{args.output_len} output tokens each")
        for name in backend_names(args.backend):
            backend = make_backend(name, source, args, kwargs, hf_batch_size=args.batch_size)  # one generate
            try:
                result = measure(backend, batches, args.num_iters_warmup, args.temperature, not args.disable_tqdm)
                if name == "hf":
                    hf_device, result["mode"] = backend.device_name, backend.mode_description
            finally:
                backend.close()
            results[name] = result
            print_result("jaxvllm" if name == "jaxvllm" else f"hf ({result['mode']})", result)

    report: dict[str, Any] = {
        "benchmark": "latency",
        "config": {"model": args.model, "backend": args.backend, "batch_size": args.batch_size,
                   "input_len": args.input_len, "output_len": args.output_len,
                   "num_iters_warmup": args.num_iters_warmup, "num_iters": args.num_iters, "seed": args.seed,
                   "temperature": args.temperature, "hf_mode": args.hf_mode,
                   "engine_args": kwargs},
        "results": results,
    }
    if len(results) == 2:  # < 1: jaxvllm takes less time
        ratio = {key: results["jaxvllm"][key]["mean"] / results["hf"][key]["mean"] for key, _ in _METRICS
                 if results["hf"][key]["mean"] > 0}
        report["ratio"] = ratio
        print("jaxvllm / hf (mean, lower is faster): "
              + ", ".join(f"{name} {ratio[key]:.2f}x" for key, name in _METRICS if key in ratio))
    write_report(args.output_json, report, hf_device)
    return report

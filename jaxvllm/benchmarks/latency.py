"""`jaxvllm bench latency`: how long one batch takes, end to end and per token (vLLM's flag names).

Each iteration generates `--batch-size` requests of `--input-len` prompt tokens and
exactly `--output-len` output tokens (with `--stop-at-eos`, at most that many: each
completion ends at its EOS, as a chat user's does). Every iteration has fresh random prompts, so
that a prefix cache cannot turn later iterations into cache hits. The first
`--num-iters-warmup` iterations are not counted; the engine's own start-up
(weights, compiling the buckets) is reported apart. `--dataset repeat` takes the
prompts from the repeat dataset instead (chat prompts asking to copy or reformat a
passage: the workload of n-gram speculative decoding), shuffled per iteration.

With `--speculative-config`, the acceptance of the timed iterations is reported;
`--compare-speculative` also runs them without it and reports the ratio of output
tokens/s and, greedy, how many completions the two runs share.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from typing import Any

from tqdm.auto import tqdm

from jaxvllm.benchmarks import datasets as ds
from jaxvllm.benchmarks.backends import make_backend
from jaxvllm.benchmarks.common import (NO_SPEC_KEY, UNQUANTIZED_KEY, add_bench_args, backend_names, bench_main,
                                       check_compare_args, quantization_report, spec_decode_figures,
                                       speculative_report, stats, write_report)
from jaxvllm.benchmarks.throughput import load_tokenizer, prompt_vocab_size
from jaxvllm.dummy import ModelSource, resolve_model
from jaxvllm.engine_args import add_engine_args, engine_kwargs

_METRICS = (("e2e_latency", "end-to-end"), ("ttft", "TTFT"), ("tpot", "TPOT"))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_bench_args(parser)
    group = parser.add_argument_group("workload")
    group.add_argument("--dataset", choices=("random", "repeat"), default="random",
                       help="random: --input-len random token ids per prompt; repeat: chat prompts asking to "
                            "repeat, reformat or continue a passage (for speculative decoding)")
    group.add_argument("--batch-size", type=int, default=8, help="requests per iteration")
    group.add_argument("--input-len", type=int, default=32, help="random: prompt tokens per request")
    group.add_argument("--output-len", type=int, default=128,
                       help="generated tokens per request (EOS ignored unless --stop-at-eos)")
    group.add_argument("--stop-at-eos", action="store_true",
                       help="end each completion at its EOS (at most --output-len tokens); the default, as vLLM's "
                            "bench latency, generates exactly --output-len")
    group.add_argument("--num-iters-warmup", type=int, default=10, help="iterations run before timing")
    group.add_argument("--num-iters", type=int, default=30, help="timed iterations")
    add_engine_args(parser)


def check_args(args: argparse.Namespace) -> None:
    if min(args.batch_size, args.input_len, args.output_len, args.num_iters) < 1 or args.num_iters_warmup < 0:
        raise ValueError("--batch-size, --input-len, --output-len and --num-iters must be >= 1, "
                         "--num-iters-warmup >= 0")


def iterations(args: argparse.Namespace, source: ModelSource) -> list[list[ds.BenchRequest]]:
    """Warm-up then timed iterations, each with its own seed (the same lists for every backend)."""
    seeds = range(args.seed, args.seed + args.num_iters_warmup + args.num_iters)
    if args.dataset == "repeat":
        encode = ds.chat_encoder(load_tokenizer(source, args.tokenizer))
        batches = [ds.repeat_requests(args.batch_size, args.output_len, encode, seed=seed) for seed in seeds]
    else:
        vocab_size = prompt_vocab_size(source, args.tokenizer)
        batches = [ds.random_requests(args.batch_size, args.input_len, args.output_len, vocab_size, seed=seed)
                   for seed in seeds]
    return [[replace(r, stop_at_eos=args.stop_at_eos) for r in batch] for batch in batches]


def measure(backend, batches: list[list[ds.BenchRequest]], num_warmup: int, temperature: float,
            use_tqdm: bool = True) -> tuple[dict[str, Any], list[list[int]]]:
    """The figures of the timed iterations, and their completions' token ids."""
    start = time.perf_counter()
    backend.warmup(batches[0])
    warmup_bar = tqdm(batches[:num_warmup], desc=f"{backend.name} warm-up iterations", disable=not use_tqdm)
    for batch in warmup_bar:
        backend.run(batch, temperature=temperature, use_tqdm=False)
    warmup_iters = time.perf_counter() - start
    engine_stats = getattr(backend, "stats", dict)  # jaxvllm's; HF has none
    before = engine_stats()
    latencies, ttft, tpot, outputs = [], [], [], []
    for batch in tqdm(batches[num_warmup:], desc=f"{backend.name} timed iterations", disable=not use_tqdm):
        run = backend.run(batch, temperature=temperature, use_tqdm=False)
        latencies.append(run.elapsed)
        ttft += run.ttft
        tpot += run.tpot()
        outputs += run.output_token_ids
    result = {
        "e2e_latency": stats(latencies), "ttft": stats(ttft), "tpot": stats(tpot), "latencies": latencies,
        "output_tokens_per_second": sum(map(len, outputs)) / sum(latencies),
        "load_seconds": backend.load_seconds, "warmup_seconds": backend.warmup_seconds,
        "warmup_iters_seconds": warmup_iters,
    }
    spec = spec_decode_figures(before, engine_stats())
    if spec is not None:
        result["spec_decode"] = spec
    return result, outputs


def print_result(label: str, r: dict[str, Any]) -> None:
    print(f"{label}: load {r['load_seconds']:.2f} s, warm-up {r['warmup_seconds']:.2f} s + "
          f"{r['warmup_iters_seconds']:.2f} s of warm-up iterations (not counted)")
    for key, name in _METRICS:
        s = r[key]
        print(f"  {name:<11} mean {1e3 * s['mean']:9.2f} ms   p50 {1e3 * s['p50']:9.2f} ms   "
              f"p90 {1e3 * s['p90']:9.2f} ms   p99 {1e3 * s['p99']:9.2f} ms")


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark the flags describe; print and return its figures (and write --output-json)."""
    check_compare_args(args)
    results: dict[str, dict[str, Any]] = {}
    outputs: dict[str, list[list[int]]] = {}
    hf_device = None
    with resolve_model(args.model) as source:
        batches = iterations(args, source)
        longest = max(r.prompt_len for batch in batches for r in batch)
        kwargs = engine_kwargs(args, source, seed=args.seed, max_model_len=longest + args.output_len)
        if kwargs["max_model_len"] < longest + args.output_len:  # (vLLM's check: requests cut short time less work)
            raise ValueError(f"--max-model-len {kwargs['max_model_len']} is less than the longest prompt plus "
                             f"--output-len ({longest} + {args.output_len})")
        prompt = f"{args.input_len} prompt" if args.dataset == "random" else f"{args.dataset} prompt (<= {longest})"
        outputs_each = f"up to {args.output_len} output tokens (to EOS)" if args.stop_at_eos else \
            f"{args.output_len} output tokens"
        print(f"{args.num_iters} iterations of {args.batch_size} requests, {prompt} + {outputs_each} each")
        runs = [(name, name, kwargs) for name in backend_names(args.backend)]
        if args.compare_speculative:  # the same work without speculative decoding
            runs.append((NO_SPEC_KEY, "jaxvllm", {**kwargs, "speculative_config": None}))
        if args.compare_quantization:  # the same work unquantized
            runs.append((UNQUANTIZED_KEY, "jaxvllm", {**kwargs, "quantization": None}))
        for key, name, run_kwargs in runs:
            backend = make_backend(name, source, args, run_kwargs, hf_batch_size=args.batch_size)  # one generate
            try:
                result, outputs[key] = measure(backend, batches, args.num_iters_warmup, args.temperature,
                                               not args.disable_tqdm)
                if name == "hf":
                    hf_device, result["mode"] = backend.device_name, backend.mode_description
            finally:
                backend.close()
            results[key] = result
            labels = {"jaxvllm": "jaxvllm", NO_SPEC_KEY: "jaxvllm, speculative decoding off",
                      UNQUANTIZED_KEY: "jaxvllm, unquantized"}
            print_result(labels.get(key) or f"hf ({result['mode']})", result)

    report: dict[str, Any] = {
        "benchmark": "latency",
        "config": {"model": args.model, "dataset": args.dataset, "backend": args.backend,
                   "batch_size": args.batch_size, "input_len": args.input_len, "output_len": args.output_len,
                   "stop_at_eos": args.stop_at_eos,
                   "num_iters_warmup": args.num_iters_warmup, "num_iters": args.num_iters, "seed": args.seed,
                   "temperature": args.temperature, "hf_mode": args.hf_mode,
                   "engine_args": kwargs},
        "results": results,
    }
    speculative = speculative_report(results, outputs, greedy=args.temperature == 0)
    if speculative is not None:
        report["speculative"] = speculative
    quantization = quantization_report(results, outputs, greedy=args.temperature == 0)
    if quantization is not None:
        report["quantization"] = quantization
    if "hf" in results:  # < 1: jaxvllm takes less time
        ratio = {key: results["jaxvllm"][key]["mean"] / results["hf"][key]["mean"] for key, _ in _METRICS
                 if results["hf"][key]["mean"] > 0}
        report["ratio"] = ratio
        print("jaxvllm / hf (mean, lower is faster): "
              + ", ".join(f"{name} {ratio[key]:.2f}x" for key, name in _METRICS if key in ratio))
    write_report(args.output_json, report, hf_device)
    return report


if __name__ == "__main__":  # (the same as `jaxvllm bench latency`)
    sys.exit(bench_main(sys.modules[__name__], "latency", sys.argv[1:]))

"""`jaxvllm bench throughput`: offline throughput on a request list, vLLM's flag names.

All requests are given at once; the figure is tokens per second of the whole run,
timed after the engine is built (weights, KV cache, compiled buckets), which is
reported apart. With `--backend both`, HF transformers runs the same requests in
the same process and the ratio jaxvllm / hf is printed.

`--dataset json-schema` measures what structured outputs cost: the requests run
constrained by a JSON schema, then unconstrained with the same output lengths, and
the ratio of their output tokens/s is printed with the share of completions that
validate and the host time spent filling token masks per step.

`--num-loras K` (LoRA) runs the requests again spread over K adapters (`--lora-modules
name=path ...`, completed with random ones of rank max-lora-rank) on the same engine, and
prints their time against the base model's.

`--dataset repeat` asks for copies and rewrites of passages in the prompt, the work of
`--speculative-config` (n-gram prompt lookup), whose acceptance is then reported;
`--compare-speculative` also runs the requests without it (see `common.speculative_report`).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

from jaxvllm.benchmarks import datasets as ds
from jaxvllm.benchmarks.backends import make_backend
from jaxvllm.benchmarks.lora_adapters import bench_adapters
from jaxvllm.benchmarks.common import (NO_SPEC_KEY, UNQUANTIZED_KEY, RunTimings, add_bench_args, backend_names,
                                       bench_main, check_compare_args, quantization_report, spec_decode_figures,
                                       speculative_report, write_report)
from jaxvllm.dummy import ModelSource, resolve_model
from jaxvllm.engine_args import add_engine_args, engine_kwargs
from jaxvllm.loader import load_config

DEFAULT_NUM_PROMPTS = 1000  # vLLM's
DEFAULT_OUTPUT_LEN = 128
DEFAULT_SHARED_PREFIX_LEN = 1024


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_bench_args(parser)
    group = parser.add_argument_group("dataset")
    group.add_argument("--dataset", "--dataset-name", choices=ds.DATASETS, default="random",
                       help="random: lengths around --input-len/--output-len; nanovllm: the B1 workload (256 "
                            "requests, prompt and output lengths uniform in [100, 1024]); shared-prefix: "
                            "--prefix-len shared tokens + --input-len own tokens per request; json-schema: "
                            "prompts asking for a JSON object, run constrained by a JSON schema, then "
                            "unconstrained with the same output lengths (jaxvllm only); repeat: chat prompts "
                            "asking to repeat, reformat or continue a passage (for speculative decoding)")
    group.add_argument("--num-prompts", type=int, default=None,
                       help=f"number of requests (default {DEFAULT_NUM_PROMPTS}; nanovllm: {ds.NANOVLLM_NUM_PROMPTS})")
    group.add_argument("--input-len", type=int, default=1024, help="prompt tokens (shared-prefix: after the prefix)")
    group.add_argument("--output-len", type=int, default=None,
                       help=f"generated tokens per request (EOS ignored; default {DEFAULT_OUTPUT_LEN}); json-schema: "
                            f"the most per completion (default {ds.JSON_SCHEMA_MAX_TOKENS})")
    group.add_argument("--range-ratio", "--random-range-ratio", type=float, default=0.0,
                       help="random: lengths uniform in [len * (1 - r), len * (1 + r)]")
    group.add_argument("--prefix-len", type=int, default=None,
                       help=f"tokens every prompt starts with (random: default 0; shared-prefix: default "
                            f"{DEFAULT_SHARED_PREFIX_LEN})")
    group.add_argument("--compare-prefix-caching", action="store_true",
                       help="run jaxvllm with prefix caching on, then off, and report computed prefill tokens "
                            "and wall time of each")
    group.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                       help="LoRA adapters (PEFT folders) for --num-loras (implies --enable-lora)")
    group.add_argument("--num-loras", type=int, default=0,
                       help="also run the requests spread over this many LoRA adapters (round robin; random "
                            "ones where --lora-modules gives fewer) and report the time against the base model's")
    group.add_argument("--compare-async-scheduling", action="store_true",
                       help="run jaxvllm with async scheduling on, then off, and report output tokens/s of each")
    group.add_argument("--compare-kv-cache-dtype", action="store_true",
                       help="run jaxvllm with an fp8 KV cache (or --kv-cache-dtype's), then with the model's dtype "
                            "('auto'), and report output tokens/s and KV blocks of each")
    add_engine_args(parser)


def check_args(args: argparse.Namespace) -> None:
    """The dataset's own default --prefix-len (random 0, as vLLM's; shared-prefix 1024)."""
    if args.prefix_len is None:
        args.prefix_len = DEFAULT_SHARED_PREFIX_LEN if args.dataset == "shared-prefix" else 0
    if args.prefix_len < 0:
        raise ValueError(f"--prefix-len {args.prefix_len}: at least 0")


def load_tokenizer(source: ModelSource, tokenizer: str | None):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer or source.path, local_files_only=True)


def prompt_vocab_size(source: ModelSource, tokenizer: str | None) -> int:
    """Random prompt ids stay within both the tokenizer's and the model's vocabularies."""
    return min(len(load_tokenizer(source, tokenizer)), load_config(source.path).vocab_size)


def output_len(args: argparse.Namespace) -> int:
    if args.output_len is not None:
        return args.output_len
    return ds.JSON_SCHEMA_MAX_TOKENS if args.dataset == "json-schema" else DEFAULT_OUTPUT_LEN


def make_requests(args: argparse.Namespace, source: ModelSource) -> list[ds.BenchRequest]:
    n = args.num_prompts
    if args.dataset == "json-schema":
        return ds.json_schema_requests(n or DEFAULT_NUM_PROMPTS, output_len(args),
                                       load_tokenizer(source, args.tokenizer).encode)
    if args.dataset == "repeat":
        return ds.repeat_requests(n or DEFAULT_NUM_PROMPTS, output_len(args),
                                  ds.chat_encoder(load_tokenizer(source, args.tokenizer)), seed=args.seed)
    vocab_size = prompt_vocab_size(source, args.tokenizer)
    if args.dataset == "nanovllm":
        return ds.nanovllm_requests(vocab_size, num_prompts=n or ds.NANOVLLM_NUM_PROMPTS, seed=args.seed)
    if args.dataset == "shared-prefix":
        return ds.shared_prefix_requests(n or DEFAULT_NUM_PROMPTS, args.prefix_len, args.input_len, output_len(args),
                                         vocab_size, seed=args.seed)
    return ds.random_requests(n or DEFAULT_NUM_PROMPTS, args.input_len, output_len(args), vocab_size,
                              range_ratio=args.range_ratio, seed=args.seed, prefix_len=args.prefix_len)


def auto_max_model_len(dataset: str, requests: list[ds.BenchRequest], model_max: int) -> int:
    """The longest request, so that no block table is wider than the work needs
    (nanovllm: B1's 4096, where the model allows it)."""
    needed = max(r.prompt_len + r.output_len for r in requests)
    wanted = max(needed, ds.NANOVLLM_MAX_MODEL_LEN) if dataset == "nanovllm" else needed
    return min(wanted, max(needed, model_max))


def summarize(run: RunTimings, requests: list[ds.BenchRequest]) -> dict[str, Any]:
    prompt_tokens = sum(r.prompt_len for r in requests)
    output_tokens = run.num_output_tokens
    return {
        "elapsed_time": run.elapsed,
        "num_requests": len(requests),
        "total_prompt_tokens": prompt_tokens,
        "total_output_tokens": output_tokens,
        "total_num_tokens": prompt_tokens + output_tokens,
        "requests_per_second": len(requests) / run.elapsed,
        "tokens_per_second": (prompt_tokens + output_tokens) / run.elapsed,
        "output_tokens_per_second": output_tokens / run.elapsed,
    }


_RATES = ("requests_per_second", "tokens_per_second", "output_tokens_per_second")
# --compare-X flag -> (the engine option it changes, its value in the first jaxvllm run and in a
# second one, that run's key, its label). kv_cache_dtype: the first run keeps --kv-cache-dtype
# when it is set to other than "auto".
_COMPARISONS = {
    "compare_prefix_caching": ("enable_prefix_caching", True, False, "jaxvllm_no_prefix_caching",
                               "prefix caching off"),
    "compare_async_scheduling": ("async_scheduling", True, False, "jaxvllm_sync", "async scheduling off"),
    "compare_kv_cache_dtype": ("kv_cache_dtype", "fp8", "auto", "jaxvllm_kv_cache_auto", "model-dtype KV cache"),
    # the first run's value is --speculative-config's
    "compare_speculative": ("speculative_config", None, None, NO_SPEC_KEY, "speculative decoding off"),
    "compare_quantization": ("quantization", None, None, UNQUANTIZED_KEY, "unquantized"),  # (--quantization's)
}


def print_result(label: str, r: dict[str, Any]) -> None:
    print(f"{label}: Throughput: {r['requests_per_second']:.2f} requests/s, {r['tokens_per_second']:.2f} total "
          f"tokens/s, {r['output_tokens_per_second']:.2f} output tokens/s")
    print(f"  {r['num_requests']} requests, {r['total_prompt_tokens']} prompt + {r['total_output_tokens']} output "
          f"tokens in {r['elapsed_time']:.2f} s; load {r['load_seconds']:.2f} s and warm-up "
          f"{r['warmup_seconds']:.2f} s not counted")
    steps = r.get("step_timing")
    if steps:
        print(f"  host share of step time: {100 * steps['host_share']:.1f}% (host {steps['host_seconds']:.3f} s, "
              f"waiting for the device {steps['wait_seconds']:.3f} s, {steps['steps']} steps of "
              f"{steps['mean_step_ms']:.2f} ms)")
        ms = steps["host_ms_per_step"]
        print(f"  host ms per step: schedule {ms['schedule']:.3f}, prepare {ms['prepare']:.3f}, launch "
              f"{ms['launch']:.3f} (calls: forward {ms['forward_call']:.3f}, sampler {ms['sampler_call']:.3f}), "
              f"process {ms['process']:.3f}, host {ms['host']:.3f}")


def run_unconstrained(backend, requests: list[ds.BenchRequest], constrained: RunTimings,
                      args: argparse.Namespace) -> RunTimings:
    """The same prompts without their schema, each generating exactly as many tokens as its
    constrained completion did (max_tokens = that length, EOS ignored): both runs then make
    the same output tokens, so their rates differ by what the constraint costs alone (a
    fixed max_tokens would let the two runs make different amounts of work)."""
    same_lengths = [ds.BenchRequest(r.prompt_token_ids, len(ids))
                    for r, ids in zip(requests, constrained.output_token_ids)]
    return backend.run(same_lengths, temperature=args.temperature, use_tqdm=not args.disable_tqdm)


def structured_output_figures(constrained: dict[str, Any], unconstrained: dict[str, Any], texts: list[str],
                              mask_seconds: float, mask_steps: int) -> dict[str, Any]:
    valid = sum(map(ds.is_valid_json, texts))
    rate, base = constrained["output_tokens_per_second"], unconstrained["output_tokens_per_second"]
    return {
        "output_tokens_per_second_constrained": rate,
        "output_tokens_per_second_unconstrained": base,
        "ratio": rate / base,  # the cost of the constraint: 1 = none
        "num_valid": valid,
        "num_completions": len(texts),
        "valid_fraction": valid / len(texts),
        "mask_seconds": mask_seconds,  # host time filling token masks, and the steps that needed one
        "mask_steps": mask_steps,
        "mask_ms_per_step": 1e3 * mask_seconds / mask_steps if mask_steps else 0.0,
        "unconstrained": unconstrained,
    }


def print_structured_output(s: dict[str, Any]) -> None:
    print(f"structured outputs: {s['output_tokens_per_second_constrained']:.1f} output tokens/s constrained vs "
          f"{s['output_tokens_per_second_unconstrained']:.1f} unconstrained ({s['ratio']:.2f}x); "
          f"{s['num_valid']}/{s['num_completions']} valid against the schema; token masks "
          f"{s['mask_ms_per_step']:.3f} ms per step ({s['mask_steps']} steps)")


def lora_run(backend, requests: list[ds.BenchRequest], args: argparse.Namespace, source: ModelSource,
             kwargs: dict[str, Any], num_loras: int, base_elapsed: float) -> dict[str, Any]:
    """The requests again, request i with adapter i mod K, timed on the same engine (whose
    run without adapters took `base_elapsed`)."""
    with tempfile.TemporaryDirectory() as folder:
        adapters = bench_adapters(source.path, args.lora_modules, num_loras, kwargs.get("max_lora_rank", 16),
                                  Path(folder))
        before = backend.stats()["lora_slot_loads"]
        timings = backend.run(requests, temperature=args.temperature, use_tqdm=not args.disable_tqdm,
                              lora_requests=[adapters[i % len(adapters)] for i in range(len(requests))])
    result = summarize(timings, requests)
    return {**result, "num_loras": len(adapters), "max_loras": kwargs["max_loras"],
            "max_lora_rank": kwargs.get("max_lora_rank", 16), "adapters": [a.lora_name for a in adapters],
            "slot_loads": backend.stats()["lora_slot_loads"] - before,
            "time_ratio": result["elapsed_time"] / base_elapsed}


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark the flags describe; print and return its figures (and write --output-json)."""
    results: dict[str, dict[str, Any]] = {}
    outputs: dict[str, list[list[int]]] = {}
    hf_device = None
    check_compare_args(args)
    structured = args.dataset == "json-schema"
    if structured and args.backend != "jaxvllm":
        raise ValueError("--dataset json-schema needs --backend jaxvllm (structured outputs are jaxvllm's)")
    with resolve_model(args.model) as source:
        requests = make_requests(args, source)
        max_model_len = auto_max_model_len(args.dataset, requests, load_config(source.path).max_position_embeddings)
        num_loras = max(args.num_loras, len(args.lora_modules))
        lora_defaults = dict(enable_lora=True, max_loras=num_loras) if num_loras else {}
        kwargs = engine_kwargs(args, source, seed=args.seed, max_model_len=max_model_len, **lora_defaults)
        runs = [(name, name, kwargs) for name in backend_names(args.backend)]
        for flag, (option, first, second, key, _) in _COMPARISONS.items():  # a second jaxvllm run
            if not getattr(args, flag):
                continue
            if args.backend == "hf":
                raise ValueError(f"--{flag.replace('_', '-')} needs the jaxvllm backend")
            if option == "kv_cache_dtype" and kwargs.get(option, "auto") != "auto":
                first = kwargs[option]  # the user's fp8 name
            if option in ("speculative_config", "quantization"):
                first = kwargs[option]  # --speculative-config's or --quantization's (check_compare_args: set)
            kwargs = {**kwargs, option: first}
            runs = [(k, name, kwargs if name == "jaxvllm" else kw) for k, name, kw in runs]
            runs.append((key, "jaxvllm", {**kwargs, option: second}))
        for key, name, run_kwargs in runs:
            backend = make_backend(name, source, args, run_kwargs)
            try:
                backend.warmup(requests)
                if structured:  # the grammar and the masked sampler variants compile when first used
                    backend.run(requests, temperature=args.temperature, use_tqdm=False)
                before = backend.stats() if name == "jaxvllm" else {}
                timings = backend.run(requests, temperature=args.temperature, use_tqdm=not args.disable_tqdm)
                result = summarize(timings, requests)
                if num_loras and key == "jaxvllm":  # the same requests over the adapters, same engine
                    result["lora"] = lora_run(backend, requests, args, source, run_kwargs, num_loras,
                                              result["elapsed_time"])
                result["load_seconds"] = backend.load_seconds
                result["warmup_seconds"] = backend.warmup_seconds
                if name == "hf":
                    hf_device = backend.device_name
                    result.update(mode=backend.mode_description, setup_seconds=timings.setup_seconds)
                else:
                    stats = backend.stats()
                    result.update(step_timing=backend.last_step_timing.to_dict(), engine_stats=stats,
                                  computed_prefill_tokens=result["total_prompt_tokens"] - stats["prefix_cache_hits"])
                    spec = spec_decode_figures(before, stats)
                    if spec is not None:
                        result["spec_decode"] = spec
                    if structured:
                        baseline = summarize(run_unconstrained(backend, requests, timings, args), requests)
                        result["structured_output"] = structured_output_figures(
                            result, baseline, timings.output_texts,
                            stats["structured_output_mask_seconds"] - before["structured_output_mask_seconds"],
                            stats["structured_output_mask_steps"] - before["structured_output_mask_steps"])
            finally:
                backend.close()
            results[key] = result
            outputs[key] = timings.output_token_ids
            label = {"jaxvllm": "jaxvllm", **{k: f"jaxvllm, {what}" for *_, k, what in _COMPARISONS.values()}}.get(key)
            print_result(label or f"hf ({result['mode']})", result)
            if structured:
                print_structured_output(result["structured_output"])

    report: dict[str, Any] = {
        "benchmark": "throughput",
        "config": {"model": args.model, "dataset": args.dataset, "backend": args.backend,
                   "num_prompts": len(requests), "input_len": args.input_len, "output_len": output_len(args),
                   "range_ratio": args.range_ratio, "prefix_len": args.prefix_len, "seed": args.seed,
                   "temperature": args.temperature, "hf_mode": args.hf_mode, "hf_batch_size": args.hf_batch_size,
                   "engine_args": kwargs},
        "results": results,
    }
    if structured:
        report["structured_output"] = results["jaxvllm"]["structured_output"]
    speculative = speculative_report(results, outputs, greedy=args.temperature == 0)
    if speculative is not None:
        report["speculative"] = speculative
    quantization = quantization_report(results, outputs, greedy=args.temperature == 0)
    if quantization is not None:
        report["quantization"] = quantization
    if args.compare_prefix_caching:
        on, off = results["jaxvllm"], results["jaxvllm_no_prefix_caching"]
        report["prefix_caching"] = {
            "computed_prefill_tokens_on": on["computed_prefill_tokens"],
            "computed_prefill_tokens_off": off["computed_prefill_tokens"],
            "prefill_skipped": 1 - on["computed_prefill_tokens"] / off["computed_prefill_tokens"],
            "elapsed_on": on["elapsed_time"], "elapsed_off": off["elapsed_time"],
            "speedup": off["elapsed_time"] / on["elapsed_time"],
        }
        p = report["prefix_caching"]
        print(f"prefix caching: {p['computed_prefill_tokens_on']} prefill tokens computed with it, "
              f"{p['computed_prefill_tokens_off']} without ({100 * p['prefill_skipped']:.1f}% skipped); "
              f"wall time {p['elapsed_on']:.2f} s vs {p['elapsed_off']:.2f} s ({p['speedup']:.2f}x)")
    if num_loras:
        report["lora"] = lora = results["jaxvllm"].pop("lora")
        print(f"LoRA: {lora['num_loras']} adapters (rank <= {lora['max_lora_rank']}, max_loras "
              f"{lora['max_loras']}): {lora['elapsed_time']:.2f} s vs {results['jaxvllm']['elapsed_time']:.2f} s for "
              f"the base model ({lora['time_ratio']:.2f}x the time); {lora['slot_loads']} slot loads")
    if args.compare_async_scheduling:
        on, off = results["jaxvllm"], results["jaxvllm_sync"]
        same = sum(a == b for a, b in zip(outputs["jaxvllm"], outputs["jaxvllm_sync"]))
        report["async_scheduling"] = {
            "output_tokens_per_second_on": on["output_tokens_per_second"],
            "output_tokens_per_second_off": off["output_tokens_per_second"],
            "speedup": on["output_tokens_per_second"] / off["output_tokens_per_second"],
            "host_share_on": on["step_timing"]["host_share"], "host_share_off": off["step_timing"]["host_share"],
            "identical_completions": same,
        }
        a = report["async_scheduling"]
        print(f"async scheduling: {a['output_tokens_per_second_on']:.1f} vs {a['output_tokens_per_second_off']:.1f} "
              f"output tokens/s ({a['speedup']:.2f}x); identical completions {same}/{len(requests)}")
    if args.compare_kv_cache_dtype:
        fp8, base = results["jaxvllm"], results["jaxvllm_kv_cache_auto"]
        same = sum(a == b for a, b in zip(outputs["jaxvllm"], outputs["jaxvllm_kv_cache_auto"]))
        report["kv_cache_dtype"] = {
            "kv_cache_dtype": fp8["engine_stats"]["kv_cache_dtype"],
            "model_kv_cache_dtype": base["engine_stats"]["kv_cache_dtype"],
            "output_tokens_per_second_fp8": fp8["output_tokens_per_second"],
            "output_tokens_per_second_model_dtype": base["output_tokens_per_second"],
            "speedup": fp8["output_tokens_per_second"] / base["output_tokens_per_second"],
            "num_gpu_blocks_fp8": fp8["engine_stats"]["num_gpu_blocks"],
            "num_gpu_blocks_model_dtype": base["engine_stats"]["num_gpu_blocks"],
            "num_preemptions_fp8": fp8["engine_stats"]["num_preemptions"],
            "num_preemptions_model_dtype": base["engine_stats"]["num_preemptions"],
            "identical_completions": same,
        }
        k = report["kv_cache_dtype"]
        print(f"KV cache {k['kv_cache_dtype']} vs {k['model_kv_cache_dtype']}: "
              f"{k['output_tokens_per_second_fp8']:.1f} vs {k['output_tokens_per_second_model_dtype']:.1f} output "
              f"tokens/s ({k['speedup']:.2f}x); {k['num_gpu_blocks_fp8']} vs {k['num_gpu_blocks_model_dtype']} KV "
              f"blocks; {k['num_preemptions_fp8']} vs {k['num_preemptions_model_dtype']} preemptions; identical "
              f"completions {same}/{len(requests)}")
    if "hf" in results:
        ratio = {k: results["jaxvllm"][k] / results["hf"][k] for k in _RATES}
        report["ratio"] = ratio
        print(f"jaxvllm / hf: {ratio['requests_per_second']:.2f}x requests/s, {ratio['tokens_per_second']:.2f}x "
              f"total tokens/s, {ratio['output_tokens_per_second']:.2f}x output tokens/s")
        if args.temperature == 0 and not source.dummy:  # same weights: greedy completions should agree
            same = sum(a == b for a, b in zip(outputs["jaxvllm"], outputs["hf"]))
            report["identical_completions"] = same
            print(f"identical greedy completions: {same}/{len(requests)}")
    write_report(args.output_json, report, hf_device)
    return report


if __name__ == "__main__":  # (the same as `jaxvllm bench throughput`)
    sys.exit(bench_main(sys.modules[__name__], "throughput", sys.argv[1:]))

"""What the benchmark scripts share: `bench throughput` and `bench latency`'s flags, backends,
timings and report; `host_step` and its nano-vllm peer's per-part figures and table.

The environment and the JSON are the kernel harness's (`pallas_kernels.harness`), so that
every benchmark's report says the same things about where it ran.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from jaxvllm.dummy import MODEL_HELP
from jaxvllm.metrics import spec_decode_rates
from pallas_kernels import harness

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


def check_bench_args(module, args: argparse.Namespace) -> None:
    """What `jaxvllm bench` refuses before a benchmark module (`throughput`, `latency`) runs."""
    if args.hf_batch_size < 1:
        raise ValueError("--hf-batch-size must be >= 1")
    if getattr(args, "num_prompts", None) is not None and args.num_prompts < 1:
        raise ValueError("--num-prompts must be >= 1")
    if hasattr(module, "check_args"):
        module.check_args(args)


def bench_main(module, name: str, argv: list[str]) -> int:
    """`python -m jaxvllm.benchmarks.NAME`: the same flags and run as `jaxvllm bench NAME`."""
    from jaxvllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog=f"python -m jaxvllm.benchmarks.{name}", allow_abbrev=False,
                                    description=(module.__doc__ or "").split("\n\n")[0])
    module.add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        check_bench_args(module, args)
        module.run(args)
    except (ValueError, FileNotFoundError) as e:  # (the user's to fix: one line, as `jaxvllm bench`)
        parser.exit(2, f"{parser.prog}: error: {' '.join(str(e).split())}\n")
    return 0


def add_bench_args(parser: argparse.ArgumentParser) -> None:
    """Flags of both bench commands (the engine flags come from `jaxvllm.engine_args`)."""
    parser.add_argument("--model", required=True, help=MODEL_HELP)
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
    parser.add_argument("--compare-speculative", action="store_true",
                        help="run jaxvllm with --speculative-config, then without it (the same other flags), and "
                             "report the acceptance, the ratio of output tokens/s and, greedy, identical completions")
    parser.add_argument("--compare-quantization", action="store_true",
                        help="run jaxvllm with --quantization, then without it (the same other flags), and report "
                             "the ratio of output tokens/s and, greedy, the share of identical completions")


def check_compare_args(args: argparse.Namespace) -> None:
    """Before anything loads: what --compare-speculative and --compare-quantization need."""
    if args.compare_speculative and args.speculative_config is None:
        raise ValueError("--compare-speculative needs --speculative-config JSON (the run to compare)")
    if args.compare_speculative and args.backend == "hf":
        raise ValueError("--compare-speculative needs the jaxvllm backend")
    if args.compare_quantization and args.quantization is None:
        raise ValueError("--compare-quantization needs --quantization (the run to compare)")
    if args.compare_quantization and args.backend == "hf":
        raise ValueError("--compare-quantization needs the jaxvllm backend")
    if args.compare_quantization and args.compare_speculative:
        raise ValueError("--compare-quantization and --compare-speculative: one comparison at a time")


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


# -- speculative decoding -------------------------------------------------------------------

NO_SPEC_KEY = "jaxvllm_no_spec"  # the run without speculative decoding, under --compare-speculative
_SPEC_COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")


def spec_decode_figures(before: dict, after: dict) -> dict[str, Any] | None:
    """Acceptance over the runs between two `stats()` of one engine (its counters are
    cumulative: this leaves warm-up runs out), by the engine's own formulas
    (`metrics.spec_decode_rates`). None when the engine has no speculative decoding."""
    if "spec_decode_num_drafts" not in after:
        return None
    n = {k: after[f"spec_decode_{k}"] - before.get(f"spec_decode_{k}", 0) for k in _SPEC_COUNTERS}
    return {**n, **spec_decode_rates(**n)}


def speculative_report(results: dict, outputs: dict, greedy: bool) -> dict[str, Any] | None:
    """The speculative run's acceptance and, beside a run without it (NO_SPEC_KEY), the ratio
    of their output tokens/s (spec / no spec) and, greedy, how many completions agree.
    `results` and `outputs` are keyed by run; the speculative run is "jaxvllm". Printed too."""
    spec = results.get("jaxvllm", {})
    if spec.get("spec_decode") is None:
        return None
    report = dict(spec["spec_decode"])
    line = (f"speculative decoding: acceptance rate {report['acceptance_rate']:.3f}, mean accepted length "
            f"{report['mean_accepted_length']:.2f} ({report['num_accepted_tokens']} of "
            f"{report['num_draft_tokens']} drafted tokens accepted, {report['num_drafts']} drafts)")
    base = results.get(NO_SPEC_KEY)
    if base is not None:
        rate, base_rate = spec["output_tokens_per_second"], base["output_tokens_per_second"]
        report.update(output_tokens_per_second_spec=rate, output_tokens_per_second_no_spec=base_rate,
                      speedup=rate / base_rate)
        line += f"; {rate:.1f} vs {base_rate:.1f} output tokens/s without ({report['speedup']:.2f}x)"
        if greedy:
            same = sum(a == b for a, b in zip(outputs["jaxvllm"], outputs[NO_SPEC_KEY]))
            report.update(identical_completions=same, num_completions=len(outputs["jaxvllm"]))
            line += f"; identical greedy completions {same}/{len(outputs['jaxvllm'])}"
    print(line)
    return report


UNQUANTIZED_KEY = "jaxvllm_unquantized"  # the run without --quantization, under --compare-quantization


def quantization_report(results: dict, outputs: dict, greedy: bool) -> dict[str, Any] | None:
    """Beside a run without --quantization (UNQUANTIZED_KEY): the ratio of output tokens/s
    (quantized / not), the weight bytes of both where known and, greedy, how many
    completions are identical and the mean share of each completion's tokens before it
    first differs. `results` and `outputs` are keyed by run; the quantized run is "jaxvllm"."""
    base = results.get(UNQUANTIZED_KEY)
    if base is None:
        return None
    quantized = results["jaxvllm"]
    rate, base_rate = quantized["output_tokens_per_second"], base["output_tokens_per_second"]
    report: dict[str, Any] = dict(output_tokens_per_second_quantized=rate, output_tokens_per_second_unquantized=base_rate,
                                  speedup=rate / base_rate)
    line = f"quantization: {rate:.1f} vs {base_rate:.1f} output tokens/s unquantized ({report['speedup']:.2f}x)"
    if "engine_stats" in quantized:
        report.update(weight_bytes_quantized=quantized["engine_stats"]["weight_bytes_per_device"],
                      weight_bytes_unquantized=base["engine_stats"]["weight_bytes_per_device"])
        line += (f"; weights {sum(report['weight_bytes_quantized']) / 2**20:.1f} vs "
                 f"{sum(report['weight_bytes_unquantized']) / 2**20:.1f} MiB")
    if greedy:
        pairs = list(zip(outputs["jaxvllm"], outputs[UNQUANTIZED_KEY]))
        same = sum(a == b for a, b in pairs)
        agree = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b))) / max(len(b), 1)
                 for a, b in pairs]
        report.update(identical_completions=same, num_completions=len(pairs),
                      mean_share_before_first_difference=float(np.mean(agree)))
        line += (f"; identical greedy completions {same}/{len(pairs)}, "
                 f"{100 * report['mean_share_before_first_difference']:.1f}% of tokens before the first difference")
    print(line)
    return report


# The harness's names for its fields -> the names this report has always had (scripts read them).
_ENV_NAMES = {"python": "python_version", "jax": "jax_version", "jaxlib": "jaxlib_version", "backend": "platform",
              "device_kind": "device"}


def environment(hf_device: str | None = None) -> dict[str, Any]:
    """The harness's environment, with the versions that matter to these two benchmarks.
    Touches JAX's devices: call it after the runs."""
    import transformers

    import jaxvllm

    env = {_ENV_NAMES.get(k, k): v for k, v in harness.environment().items()}
    env.update(jaxvllm_version=jaxvllm.__version__, transformers_version=transformers.__version__)
    torch = sys.modules.get("torch")
    if torch is not None:
        env["torch_version"] = torch.__version__
    if hf_device is not None:
        env["hf_device"] = hf_device
    return env


def write_report(path: Path | None, report: dict, hf_device: str | None) -> None:
    """The environment goes in last, after the runs (see `environment`); `--output-json` may be unset."""
    report["environment"] = environment(hf_device)
    if path is not None:
        harness.write_json(path, report)
        print(f"wrote {path}")


# -- host_step and nanovllm_peer: host time per step, part by part -----------------------------


def summarize(times: dict, n: int) -> dict:
    """{part: [seconds per step]} -> {part: mean/p50/p90 ms and us per request} for n requests."""
    figures = {}
    for part, seconds in times.items():
        ms = np.asarray(seconds) * 1e3
        figures[part] = {"mean_ms": float(ms.mean()), "p50_ms": float(np.percentile(ms, 50)),
                         "p90_ms": float(np.percentile(ms, 90)), "us_per_request": float(ms.mean() * 1e3 / n)}
    return figures


def print_parts(parts: dict) -> None:
    print(f"{'part':<16}{'mean ms':>10}{'p50 ms':>10}{'p90 ms':>10}{'us/request':>12}")
    for part, f in parts.items():
        print(f"{part:<16}{f['mean_ms']:>10.3f}{f['p50_ms']:>10.3f}{f['p90_ms']:>10.3f}{f['us_per_request']:>12.2f}")


def print_host_step(result: dict, detail: str, label: str = "") -> None:
    """One run's heading and table of parts. `label` and `detail` say what tells one engine's
    run from the other's (nano-vllm's commit and block size, our requests' earlier output)."""
    print(f"\n{label}{result['num_requests']} decoding requests, {result['steps']} steps "
          f"(prompt {result['prompt_len']}, {detail}, {result['prefill_steps']} prefill steps untimed)")
    print_parts(result["parts"])

"""How long `LLM(...)` takes to be ready, with a cold and with a warm persistent
compilation cache, and where that time goes (load, KV-cache sizing, compiling):

    python -m jaxvllm.benchmarks.startup --model weights/smollm2-135m-instruct dummy:qwen3-0.6b
        [--max-model-len 512] [--runs cold warm] [--json PATH] [--engine-args JSON]

Each start runs in a fresh process (nothing of an earlier start stays in memory), all of
a model's starts over one new cache folder: "cold" is the first (an empty cache), "warm"
the ones after it (every compilation should come from the cache). The figures are
`stats()`'s: load_seconds, profile_seconds, warmup_seconds (until ready), the warm-up's
compilations and persistent-cache hits, and the process's wall time from `import jaxvllm`
to ready and to every compile done (on a CPU the larger buckets compile after ready:
`LLMEngine.finish_warmup`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from jaxvllm.benchmarks.common import write_report

FIELDS = ("load_seconds", "profile_seconds", "warmup_seconds", "warmup_done_seconds", "warmup_compilations",
          "compilation_cache_hits", "compilation_cache_misses", "token_buckets", "max_num_batched_tokens")


def start_once(model: str, cache_dir: str, engine_args: dict) -> dict:
    """One start in this process: `LLM(...)` until ready; its figures."""
    start = time.perf_counter()
    from jaxvllm import LLM

    llm = LLM(model, compilation_cache_dir=cache_dir, **engine_args)
    ready = time.perf_counter() - start
    pending = llm.llm_engine.stats()["warmup_pending_compiles"]
    llm.llm_engine.finish_warmup()
    compiled = time.perf_counter() - start
    stats = llm.llm_engine.stats()
    stats["max_num_batched_tokens"] = llm.llm_engine.config.max_num_batched_tokens
    return {"ready_seconds": ready, "pending_at_ready": pending, "all_compiled_seconds": compiled,
            **{k: stats[k] for k in FIELDS}}


def start_in_child(model: str, cache_dir: str, engine_args: dict) -> dict:
    """`start_once` in a fresh Python process; its figures come back as the last line."""
    code = ("import json, sys; from jaxvllm.benchmarks.startup import start_once; "
            "print(json.dumps(start_once(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]))))")
    # (JAX's own setting would win over `cache_dir`: a cold start would find a warm cache)
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    done = subprocess.run([sys.executable, "-c", code, model, cache_dir, json.dumps(engine_args)],
                          capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"starting {model} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", nargs="+", required=True, help="checkpoint folders or dummy:NAME")
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--runs", nargs="+", default=["cold", "warm"], choices=("cold", "warm"),
                        help="cold: the first start over a new cache folder; warm: each one after it")
    parser.add_argument("--engine-args", type=json.loads, default={}, help='more LLM(...) arguments, as JSON')
    parser.add_argument("--json", type=Path, help="write the figures and the environment here")
    args = parser.parse_args(argv)
    if args.runs[0] != "cold":
        args.runs.insert(0, "cold")  # a warm start needs the cache a cold one fills

    engine_args = {"max_model_len": args.max_model_len, **args.engine_args}
    report = {"engine_args": engine_args, "results": {}}
    print(f"{'model':<34}{'run':<6}{'ready s':>9}{'load s':>8}{'profile s':>10}{'compile s':>10}"
          f"{'all compiled s':>15}{'compiles':>9}{'cache hits':>11}")
    for model in args.model:
        runs = report["results"][model] = []
        with tempfile.TemporaryDirectory(prefix="jaxvllm-startup-cache-") as cache_dir:
            for run in args.runs:
                r = {"run": run, **start_in_child(model, cache_dir, engine_args)}
                runs.append(r)
                print(f"{model:<34}{run:<6}{r['ready_seconds']:>9.1f}{r['load_seconds']:>8.1f}"
                      f"{r['profile_seconds']:>10.1f}{r['warmup_seconds']:>10.1f}{r['all_compiled_seconds']:>15.1f}"
                      f"{r['warmup_compilations']:>9}"
                      f"{r['compilation_cache_hits']:>11}", flush=True)
        print(f"{'':<34}buckets {runs[0]['token_buckets']} (max_num_batched_tokens {runs[0]['max_num_batched_tokens']})")
    write_report(args.json, report, None)
    return 0


if __name__ == "__main__":
    sys.exit(main())

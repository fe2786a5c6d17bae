"""Engine step time with every sampling feature on, against greedy, on the same requests.

    python -m jaxvllm.benchmarks.sampling_overhead [--model dummy:tiny] [--num-prompts 64]

"All features": temperature, top_k, top_p, min_p, the three penalties, logit_bias,
per-request seeds, logprobs=5, a stop string and min_tokens. Each configuration runs
the same prompts with the same lengths (ignore_eos) after a warm-up run; the figure is
the mean engine step time and its ratio to greedy.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from jaxvllm.benchmarks.jaxvllm_backend import time_steps
from jaxvllm.dummy import MODEL_HELP, resolve_model
from jaxvllm.llm import LLM
from jaxvllm.sampling_params import SamplingParams


def configurations(max_tokens: int) -> dict[str, list[SamplingParams] | SamplingParams]:
    common = dict(max_tokens=max_tokens, ignore_eos=True)
    return {
        "greedy": SamplingParams(temperature=0, **common),
        "random": SamplingParams(temperature=0.8, seed=0, **common),
        "all_features": SamplingParams(
            temperature=0.8, top_k=50, top_p=0.9, min_p=0.05, presence_penalty=0.5, frequency_penalty=0.5,
            repetition_penalty=1.1, logit_bias={5: 2.0, 6: -2.0}, seed=0, logprobs=5,
            stop=["never-appears-\u2603"], min_tokens=2, **common,
        ),
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="dummy:tiny", help=MODEL_HELP)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per configuration (the best counts)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)

    with resolve_model(args.model) as source:
        llm = LLM(source.path, load_format=source.load_format or "auto",
                  max_model_len=args.input_len + args.output_len, max_num_seqs=args.num_prompts,
                  max_num_batched_tokens=max(args.num_prompts, 1024), enable_prefix_caching=False)
        llm.llm_engine.finish_warmup()
    vocab = llm.llm_engine.model_config.vocab_size
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(3, vocab, args.input_len).tolist()} for _ in range(args.num_prompts)]
    result = {"model": args.model, "num_prompts": args.num_prompts, "input_len": args.input_len,
              "output_len": args.output_len, "configs": {}}
    for name, params in configurations(args.output_len).items():
        llm.generate(prompts, params, use_tqdm=False)  # warm the host paths (first admission, etc.)
        best = None
        for _ in range(args.repeats):
            with time_steps(llm) as timing:
                llm.generate(prompts, params, use_tqdm=False)
            figures = timing.to_dict()
            if best is None or figures["mean_step_ms"] < best["mean_step_ms"]:
                best = figures
        result["configs"][name] = best
    greedy = result["configs"]["greedy"]["mean_step_ms"]
    print(f"{args.num_prompts} prompts x {args.input_len} in / {args.output_len} out on {args.model}")
    print(f"{'config':<14}{'step ms':>10}{'wait ms':>11}{'vs greedy':>11}")
    for name, f in result["configs"].items():
        f["ratio_to_greedy"] = f["mean_step_ms"] / greedy
        wait_ms = 1e3 * f["wait_seconds"] / f["steps"]
        print(f"{name:<14}{f['mean_step_ms']:>10.3f}{wait_ms:>11.3f}{f['ratio_to_greedy']:>10.2f}x")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()

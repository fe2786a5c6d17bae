"""Loglikelihood scoring, lm-eval's main workload, against lm-eval's own `hf` backend:

    python -m jaxvllm.benchmarks.loglikelihood --model weights/smollm2-135m-instruct
        [--workloads mmlu hellaswag] [--docs 40] [--hf-batch-size 16] [--no-full-prompt] [--hf-float64]
        [--json PATH] [--engine-args '{"max_num_seqs": 64}']

Two synthetic workloads of random token ids (timing and equality need no real text):
- "mmlu": 5-shot contexts of about 600 tokens (a ~500-token few-shot prefix shared by the
  documents of one subject, then a ~100-token question) and 4 one-token choices;
- "hellaswag": ~80-token contexts and 4 continuations of 15-25 tokens.

Each document's requests go through the backends' own `_loglikelihood_tokens`, the call
lm-eval makes: jaxvllm's lm-eval backend (`jaxvllm.integrations.lm_eval`, prompt logprobs
from the continuation on, shared contexts from the prefix cache), the same engine asked
for vLLM's whole-prompt `prompt_logprobs=0` (the path the backend took before:
`full_prompt`), and lm-eval's `HFLM` (float32 on CPU, `--hf-batch-size`; it computes a
context once when the choices are single tokens). Figures: documents/s of the scoring
phase, start-up seconds, the max abs difference of the loglikelihoods from HF's and how
many greedy flags differ. A dummy model (`dummy:NAME`, random weights) has no HF peer:
jaxvllm's two paths only.

`--hf-float64` also scores with lm-eval's `hf` backend in float64, the exact value to a
float32 run's rounding, and reports how far jaxvllm's and HF's float32 scores each lie
from it: the floor under any float32 comparison of the two.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

from jaxvllm.benchmarks.common import write_report
from jaxvllm.dummy import is_dummy

Request = tuple[None, list[int], list[int]]  # lm-eval's (cache key, context ids, continuation ids)


def workload(name: str, num_docs: int, vocab_size: int, seed: int = 0) -> list[list[Request]]:
    """Per document, its 4 requests."""
    rng = random.Random(seed)
    tokens = lambda n: [rng.randrange(100, vocab_size) for _ in range(n)]  # noqa: E731  (past special ids)
    docs = []
    if name == "mmlu":
        shots = [tokens(rng.randint(480, 520)) for _ in range(4)]  # one few-shot prefix per subject
        for d in range(num_docs):
            context = shots[d % len(shots)] + tokens(rng.randint(80, 120))
            docs.append([(None, context, tokens(1)) for _ in range(4)])
    elif name == "hellaswag":
        for _ in range(num_docs):
            context = tokens(rng.randint(70, 90))
            docs.append([(None, context, tokens(rng.randint(15, 25))) for _ in range(4)])
    else:
        raise ValueError(f"unknown workload {name!r}: mmlu or hellaswag")
    return docs


def timed(score, requests: list[Request]) -> tuple[list[tuple[float, bool]], float]:
    start = time.perf_counter()
    scores = score(requests)
    return scores, time.perf_counter() - start


def full_prompt_scores(llm, requests: list[Request]) -> list[tuple[float, bool]]:
    """vLLM's prompt_logprobs=0 over each whole prompt, no prefix cache: the scores read off it."""
    from jaxvllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0, detokenize=False)
    outputs = llm.generate([{"prompt_token_ids": c + t} for _, c, t in requests], params, use_tqdm=False)
    scores = []
    for (_, context, continuation), out in zip(requests, outputs):
        ids = context + continuation
        tail = [out.prompt_logprobs[p][ids[p]] for p in range(len(context), len(ids))]
        scores.append((sum(lp.logprob for lp in tail), all(lp.rank == 1 for lp in tail)))
    return scores


def compare(scores: list[tuple[float, bool]], reference: list[tuple[float, bool]]) -> dict:
    return {"max_abs_diff": max(abs(a - b) for (a, _), (b, _) in zip(scores, reference)),
            "greedy_differs": sum(ga != gb for (_, ga), (_, gb) in zip(scores, reference))}


def run(model: str, workloads: list[str], num_docs: int, hf_batch_size: int, engine_args: dict,
        full_prompt: bool = True, hf_float64: bool = False) -> dict:
    import jaxvllm.integrations.lm_eval as integration
    from jaxvllm import LLM
    from jaxvllm.dummy import get_dummy

    start = time.perf_counter()
    kwargs = {**get_dummy(model).engine_defaults, "load_format": "dummy"} if is_dummy(model) else {}
    llm = LLM(model, **{**kwargs, **engine_args})
    llm.llm_engine.finish_warmup()  # (scoring is timed with every bucket compiled)
    report: dict[str, Any] = {"jaxvllm_ready_seconds": time.perf_counter() - start, "workloads": {}}
    lm = integration.JaxvllmLM(llm=llm)
    hf = None
    if not is_dummy(model):
        from lm_eval.models.huggingface import HFLM

        start = time.perf_counter()
        hf = HFLM(pretrained=model, device="cpu", dtype="float32", batch_size=hf_batch_size)
        report["hf_ready_seconds"] = time.perf_counter() - start
    exact = None  # the float64 scores' model
    if hf is not None and hf_float64:
        exact = HFLM(pretrained=model, device="cpu", dtype="float64", batch_size=hf_batch_size)
    vocab = llm.llm_engine.runner.cfg.vocab_size
    for name in workloads:
        docs = workload(name, num_docs, vocab)
        requests = [r for doc in docs for r in doc]
        longest = max(len(c) + len(t) for _, c, t in requests)
        if longest > lm.max_length + 1:  # (truncated, the backends would score different windows)
            raise ValueError(f"the {name} workload's longest request is {longest} tokens: --max-model-len must be "
                             f"at least {longest + 1} (it is {lm.max_model_len})")
        figures: dict[str, Any] = {"docs": len(docs), "requests": len(requests),
                                   "tokens": sum(len(c) + len(t) for _, c, t in requests)}
        llm.reset_prefix_cache()  # (nothing cached from an earlier workload)
        ours, seconds = timed(lambda r: lm._loglikelihood_tokens(r, disable_tqdm=True), requests)
        figures["jaxvllm"] = {"seconds": seconds, "docs_per_s": len(docs) / seconds}
        if full_prompt:
            full, seconds = timed(lambda r: full_prompt_scores(llm, r), requests)
            figures["jaxvllm_full_prompt"] = {"seconds": seconds, "docs_per_s": len(docs) / seconds,
                                              **compare(full, ours)}
            figures["speedup_vs_full_prompt"] = seconds / figures["jaxvllm"]["seconds"]
        if hf is not None:
            theirs, seconds = timed(lambda r: hf._loglikelihood_tokens(r, disable_tqdm=True), requests)
            figures["hf"] = {"seconds": seconds, "docs_per_s": len(docs) / seconds}
            figures["jaxvllm"].update(compare(ours, theirs))
            figures["speedup_vs_hf"] = figures["hf"]["seconds"] / figures["jaxvllm"]["seconds"]
        if exact is not None:
            truth = exact._loglikelihood_tokens(requests, disable_tqdm=True)
            figures["float64"] = {"jaxvllm": compare(ours, truth), "hf": compare(theirs, truth)}
        report["workloads"][name] = figures
    report["jaxvllm_stats"] = {k: v for k, v in llm.stats().items() if k.startswith("prefix_cache")}
    llm.shutdown()
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a checkpoint folder (HF compared) or dummy:NAME")
    parser.add_argument("--workloads", nargs="+", default=["mmlu", "hellaswag"], choices=("mmlu", "hellaswag"))
    parser.add_argument("--docs", type=int, default=40, help="documents per workload (4 requests each)")
    parser.add_argument("--hf-batch-size", type=int, default=16, help="lm-eval's batch_size for the hf backend")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--engine-args", type=json.loads, default={}, help="more LLM(...) arguments, as JSON")
    parser.add_argument("--no-full-prompt", action="store_true",
                        help="skip the whole-prompt path (the slowest: every context computed per choice)")
    parser.add_argument("--hf-float64", action="store_true",
                        help="also score with hf in float64 and compare both float32 runs with it")
    parser.add_argument("--json", type=Path, help="write the figures and the environment here")
    args = parser.parse_args(argv)
    if args.docs < 1:
        parser.error(f"--docs {args.docs}: at least 1")
    engine_args = {"max_model_len": args.max_model_len, "dtype": args.dtype, **args.engine_args}
    report = {"model": args.model, "engine_args": engine_args, "hf_batch_size": args.hf_batch_size,
              **run(args.model, args.workloads, args.docs, args.hf_batch_size, engine_args,
                    full_prompt=not args.no_full_prompt, hf_float64=args.hf_float64)}
    print(f"{args.model}: jaxvllm ready in {report['jaxvllm_ready_seconds']:.1f} s"
          + (f", hf in {report['hf_ready_seconds']:.1f} s" if "hf_ready_seconds" in report else ""))
    for name, f in report["workloads"].items():
        print(f"{name}: {f['docs']} docs, {f['requests']} requests, {f['tokens']} tokens")
        for backend in ("jaxvllm", "jaxvllm_full_prompt", "hf"):
            if backend in f:
                b = f[backend]
                diff = "" if "max_abs_diff" not in b else (
                    f"  max |diff| {b['max_abs_diff']:.2e} from {'hf' if backend == 'jaxvllm' else 'jaxvllm'}'s,"
                    f" greedy flags differing {b['greedy_differs']}")
                print(f"  {backend:<20}{b['docs_per_s']:>8.2f} docs/s ({b['seconds']:.2f} s){diff}")
        ratios = [f"{f[key]:.2f}x {peer}" for key, peer in (("speedup_vs_hf", "hf"),
                                                              ("speedup_vs_full_prompt", "the full-prompt path"))
                  if key in f]
        print("  jaxvllm: " + ", ".join(ratios))
        if "float64" in f:
            print("  from hf's float64 scores: max |diff| " + ", ".join(
                f"{backend} {f['float64'][backend]['max_abs_diff']:.2e}" for backend in ("jaxvllm", "hf")))
    write_report(args.json, report, "cpu")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Wall time of one `LLM.generate` over many prompts vs HF transformers generating them one by one.

Same checkpoint, prompts and greedy lengths, in one process, so the ratio means
something on a shared machine:

    python -m jaxvllm.benchmarks.generate_vs_hf [--model PATH | --arch qwen3] [--num-prompts 64]

Without --model a tiny random checkpoint is written to a temp folder (needs torch, the
`test` extra). jaxvllm's warm-up (compiling the buckets) is reported apart.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from jaxvllm import LLM, SamplingParams


def mixed_prompts(n: int, max_len: int, vocab: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, size=int(k)).tolist() for k in rng.integers(1, max_len + 1, size=n)]


def run_hf(path: str, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]]]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    outputs = []
    start = time.perf_counter()
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                 min_new_tokens=max_tokens, do_sample=False)
            outputs.append(out[0, len(p):].tolist())
    return time.perf_counter() - start, outputs


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="local checkpoint folder (default: a tiny random one)")
    ap.add_argument("--arch", default="qwen3", help="tiny architecture when --model is not given")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-prompt-len", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, help="write the figures here")
    args = ap.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        path = args.model
        if path is None:
            sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # weights/ is a repo folder
            from weights.make_tiny import make_tiny

            path = str(make_tiny(args.arch, Path(tmp) / args.arch))
        start = time.perf_counter()
        llm = LLM(path, max_model_len=args.max_prompt_len + args.max_tokens, 
                  max_num_batched_tokens=args.max_num_batched_tokens,
                  max_num_seqs=min(256, args.max_num_batched_tokens))
        init_s = time.perf_counter() - start
        prompts = mixed_prompts(args.num_prompts, args.max_prompt_len, llm.llm_engine.model_config.vocab_size,
                                args.seed)
        params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
        start = time.perf_counter()
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        jax_s = time.perf_counter() - start
        hf_s, hf_outputs = run_hf(path, prompts, args.max_tokens)

    same = sum(o.outputs[0].token_ids == h for o, h in zip(outputs, hf_outputs))
    result = {
        "num_prompts": args.num_prompts, "max_tokens": args.max_tokens,
        "jaxvllm_init_s": init_s, "jaxvllm_warmup_s": llm.stats()["warmup_seconds"],
        "jaxvllm_generate_s": jax_s, "hf_sequential_s": hf_s, "speedup": hf_s / jax_s,
        "identical_completions": same,
    }
    print(f"{args.num_prompts} prompts (1-{args.max_prompt_len} tokens), {args.max_tokens} greedy tokens each")
    print(f"jaxvllm LLM.generate: {jax_s:.2f} s (start-up {init_s:.1f} s, of which warm-up {result['jaxvllm_warmup_s']:.1f} s)")
    print(f"HF generate, one prompt after another: {hf_s:.2f} s")
    print(f"speed-up {result['speedup']:.1f}x; identical completions {same}/{args.num_prompts}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()

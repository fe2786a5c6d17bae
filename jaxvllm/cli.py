"""The `jaxvllm` command (also `python -m jaxvllm`): `generate` and `bench {throughput,latency}`.

    jaxvllm generate --model dummy:tiny --prompt "Hello, my name is"
    jaxvllm bench throughput --model dummy:tiny --dataset random --num-prompts 64 --backend both
    jaxvllm bench latency --model PATH --batch-size 8 --input-len 32 --output-len 128

Exit codes: 0 done, 2 a usage error (argparse's, a missing model folder, a value the
engine refuses), with one line on stderr saying what is wrong.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import jaxvllm
from jaxvllm.engine_args import add_engine_args, engine_kwargs

# flag -> (type, help) of SamplingParams fields, by vLLM's names. Only the flags a user
# sets reach SamplingParams, so this list may run ahead of what SamplingParams supports:
# it says so when one is set.
_SAMPLING_FLAGS: dict[str, tuple[type, str]] = {
    "temperature": (float, "0 = greedy"),
    "top-p": (float, "nucleus sampling: smallest set of tokens with this total probability"),
    "top-k": (int, "sample among the k most likely tokens (-1 or 0: all)"),
    "min-p": (float, "drop tokens less likely than min_p times the most likely one"),
    "max-tokens": (int, "most tokens to generate per completion"),
    "seed": (int, "per-request sampling seed"),
    "n": (int, "completions per prompt"),
    "presence-penalty": (float, "penalty on tokens already generated"),
    "frequency-penalty": (float, "penalty growing with how often a token was generated"),
    "repetition-penalty": (float, "HF-style repetition penalty (1 = none)"),
    "logprobs": (int, "return this many log-probabilities per token"),
}


class UsageError(Exception):
    """A mistake in what the user asked for: reported in one line, exit code 2."""


def build_parser() -> argparse.ArgumentParser:
    from jaxvllm.benchmarks import latency, throughput

    parser = argparse.ArgumentParser(
        prog="jaxvllm",
        description="jaxvllm: LLM inference on JAX/XLA. Try: jaxvllm generate --model dummy:tiny "
        '--prompt "Hello, my name is"',
    )
    parser.add_argument("--version", action="version", version=f"jaxvllm {jaxvllm.__version__}")
    commands = parser.add_subparsers(dest="command", metavar="{generate,bench}")

    gen = commands.add_parser("generate", help="complete prompts and print (or write) the completions",
                              description="Complete prompts with a local checkpoint or a built-in dummy model.")
    gen.add_argument("--model", required=True,
                     help="checkpoint folder, or dummy:tiny | dummy:qwen3-0.6b | dummy:llama3-8b (random weights)")
    gen.add_argument("--prompt", action="append", default=[], help="a prompt (repeat for several)")
    gen.add_argument("--prompts-file", type=Path,
                     help='JSONL: per line a string, {"prompt": str} or {"prompt_token_ids": [int, ...]}')
    gen.add_argument("--output", type=Path, help="write one JSON line per prompt here instead of printing")
    gen.add_argument("--disable-tqdm", action="store_true", help="no progress bar during generation")
    sampling = gen.add_argument_group("sampling parameters (SamplingParams)")
    for flag, (kind, help_text) in _SAMPLING_FLAGS.items():
        sampling.add_argument(f"--{flag}", type=kind, default=None, help=help_text)
    sampling.add_argument("--ignore-eos", action="store_true", default=None, help="keep generating past EOS")
    sampling.add_argument("--stop-token-ids", type=int, nargs="+", default=None, help="token ids that end a completion")
    sampling.add_argument("--stop", action="append", default=None, help="a string that ends a completion (repeat)")
    add_engine_args(gen)
    gen.set_defaults(func=run_generate)

    bench = commands.add_parser("bench", help="benchmarks: throughput, latency",
                                description="Benchmarks, optionally side by side with HF transformers.")
    benches = bench.add_subparsers(dest="bench", metavar="{throughput,latency}", required=True)
    for name, module, help_text in (
        ("throughput", throughput, "offline throughput of a request list (requests/s, tokens/s)"),
        ("latency", latency, "latency of one batch: end to end, time to first token, time per output token"),
    ):
        sub = benches.add_parser(name, help=help_text, description=(module.__doc__ or "").split("\n\n")[0])
        module.add_arguments(sub)
        sub.set_defaults(func=_bench_runner(module))
    return parser


def _bench_runner(module):
    def run(args: argparse.Namespace) -> int:
        if args.hf_batch_size < 1:
            raise UsageError("--hf-batch-size must be >= 1")
        if getattr(args, "num_prompts", None) is not None and args.num_prompts < 1:
            raise UsageError("--num-prompts must be >= 1")
        if hasattr(module, "check_args"):
            module.check_args(args)
        module.run(args)
        return 0

    return run


# -- generate -----------------------------------------------------------------------------


def sampling_params(args: argparse.Namespace):
    """SamplingParams from the sampling flags the user set; UsageError for one it refuses."""
    from jaxvllm import SamplingParams

    kwargs: dict[str, Any] = {}
    for flag in (*_SAMPLING_FLAGS, "ignore-eos", "stop-token-ids", "stop"):
        value = getattr(args, flag.replace("-", "_"))
        if value is not None:
            kwargs[flag.replace("-", "_")] = value
    try:
        return SamplingParams(**kwargs)
    except TypeError as e:
        raise UsageError(f"a sampling flag is not supported by this jaxvllm ({e}); set: {sorted(kwargs)}") from e
    except ValueError as e:
        raise UsageError(f"bad sampling parameter: {e}") from e


def read_prompts(args: argparse.Namespace) -> list:
    prompts: list = list(args.prompt)
    if args.prompts_file is not None:
        try:
            lines = args.prompts_file.read_text().splitlines()
        except OSError as e:
            raise UsageError(f"cannot read --prompts-file: {e}") from e
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                prompt = json.loads(line)
            except ValueError as e:
                raise UsageError(f"{args.prompts_file}:{number}: not JSON ({e})") from e
            if not isinstance(prompt, (str, dict)):
                raise UsageError(f"{args.prompts_file}:{number}: expected a string or an object, "
                                 f"got {type(prompt).__name__}")
            prompts.append(prompt)
    if not prompts:
        raise UsageError("no prompts: give --prompt TEXT or --prompts-file FILE.jsonl")
    return prompts


def output_record(out) -> dict[str, Any]:
    return {
        "prompt": out.prompt,
        "prompt_token_ids": out.prompt_token_ids,
        "outputs": [{"index": c.index, "text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason}
                    for c in out.outputs],
    }


def run_generate(args: argparse.Namespace) -> int:
    from jaxvllm import LLM
    from jaxvllm.dummy import resolve_model

    params = sampling_params(args)
    prompts = read_prompts(args)
    with resolve_model(args.model) as source:
        llm = LLM(source.path, **engine_kwargs(args, source))
        try:
            outputs = llm.generate(prompts, params, use_tqdm=not args.disable_tqdm)
        except (TypeError, ValueError) as e:  # generate checks every prompt before it queues any
            raise UsageError(f"bad prompt: {e}") from e
    records = [output_record(out) for out in outputs]
    if args.output is not None:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
        print(f"wrote {len(records)} completions to {args.output}")
        return 0
    for r in records:
        prompt = r["prompt"] if r["prompt"] is not None else r["prompt_token_ids"]
        for c in r["outputs"]:
            index = f"[{c['index']}] " if len(r["outputs"]) > 1 else ""
            # A dummy model's ids mostly lie past its small tokenizer's vocabulary: show them.
            ids = "" if c["text"] else f", token ids: {c['token_ids']}"
            print(f"Prompt: {prompt!r}, {index}Generated text: {c['text']!r}{ids}")
    return 0


# -- entry point ----------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help, --version, or argparse's usage error (code 2)
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    if args.command is None:
        parser.print_help()
        return 0
    prog = f"jaxvllm {args.command}" + (f" {args.bench}" if args.command == "bench" else "")
    try:
        return args.func(args)
    except (UsageError, ValueError, FileNotFoundError, ImportError) as e:
        # What the engine refuses (a missing folder, an unsupported config or value) is the
        # user's to fix: one line, not a traceback.
        message = " ".join(str(e).split())
        print(f"{prog}: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

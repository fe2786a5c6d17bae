"""The `jaxvllm` command (also `python -m jaxvllm`): `generate` and `bench {throughput,latency}`.

    jaxvllm generate --model dummy:tiny --prompt "Hello, my name is"
    jaxvllm generate --model dummy:tiny --prompt "Yes or no?" --choice yes no
    jaxvllm bench throughput --model dummy:tiny --dataset random --num-prompts 64 --backend both
    jaxvllm bench latency --model PATH --batch-size 8 --input-len 32 --output-len 128
    jaxvllm bench latency --model PATH --dataset repeat --compare-speculative \
        --speculative-config '{"method": "ngram", "num_speculative_tokens": 4}'

Exit codes: 0 done, 2 a usage error (argparse's, a missing model folder, a value the
engine refuses, a bad prompt: named by its --prompts-file line), 130 Ctrl-C, with one line
on stderr saying what is wrong.

`generate --output FILE` writes each chunk of prompts' completions as soon as the chunk is
done (one JSON object per line, with the prompt's "index"), so a run that is interrupted
or fails keeps what it finished, and `--resume` completes such a file.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import jaxvllm
from jaxvllm.dummy import MODEL_HELP
from jaxvllm.engine_args import add_engine_args, engine_kwargs
from jaxvllm.interrupts import ProgressBar, defer_interrupts
from jaxvllm.utils.argparse_utils import FlexibleArgumentParser

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


class Interrupted(Exception):
    """Ctrl-C, with what was kept: reported in one line, exit code 130."""


def build_parser() -> argparse.ArgumentParser:
    from jaxvllm.benchmarks import latency, throughput

    # (never abbreviated: a flag of vLLM's this command lacks, `--n`, `--profile`, is refused as
    # unknown, not read as another one that starts the same)
    parser = FlexibleArgumentParser(
        allow_abbrev=False,
        prog="jaxvllm",
        description="jaxvllm: LLM inference on JAX/XLA. Try: jaxvllm generate --model dummy:tiny "
        '--prompt "Hello, my name is"',
    )
    parser.add_argument("--version", action="version", version=f"jaxvllm {jaxvllm.__version__}")
    commands = parser.add_subparsers(dest="command", metavar="{generate,bench}")

    gen = commands.add_parser("generate", allow_abbrev=False,
                              help="complete prompts and print (or write) the completions",
                              description="Complete prompts with a local checkpoint or a built-in dummy model.")
    gen.add_argument("--model", required=True, help=MODEL_HELP)
    gen.add_argument("--prompt", action="append", default=[], help="a prompt (repeat for several)")
    gen.add_argument("--prompts-file", type=Path,
                     help='JSONL: per line a string, {"prompt": str} or {"prompt_token_ids": [int, ...]}')
    gen.add_argument("--output", type=Path,
                     help="write one JSON line per prompt here (with the prompt's \"index\"), chunk by chunk "
                     "as they finish, instead of printing; an existing file is overwritten")
    gen.add_argument("--resume", action="store_true",
                     help="keep the prompts already in --output (by index) and generate only the missing ones")
    gen.add_argument("--chunk-size", type=int, default=None,
                     help="prompts per generation chunk, each written when done (default: 4 x max-num-seqs)")
    gen.add_argument("--disable-tqdm", action="store_true", help="no progress bar during generation")
    gen.add_argument("--lora", type=Path, default=None, metavar="FOLDER",
                     help="a LoRA adapter (PEFT folder) for every prompt (implies --enable-lora; its rank must "
                     "be at most --max-lora-rank, 16 by default)")
    sampling = gen.add_argument_group("sampling parameters (SamplingParams)")
    for flag, (kind, help_text) in _SAMPLING_FLAGS.items():
        sampling.add_argument(f"--{flag}", type=kind, default=None, help=help_text)
    sampling.add_argument("--ignore-eos", action="store_true", default=None, help="keep generating past EOS")
    sampling.add_argument("--stop-token-ids", type=int, nargs="+", default=None, help="token ids that end a completion")
    sampling.add_argument("--stop", action="append", default=None, help="a string that ends a completion (repeat)")
    constrained = gen.add_argument_group("structured outputs (StructuredOutputsParams): each completion matches one of")
    kinds = constrained.add_mutually_exclusive_group()
    kinds.add_argument("--json-schema", type=Path, metavar="FILE", help="the JSON schema in this file")
    kinds.add_argument("--regex", metavar="PATTERN", help="this regular expression, in full")
    kinds.add_argument("--choice", nargs="+", metavar="TEXT", help="one of these strings")
    constrained.add_argument("--disable-any-whitespace", action="store_true",
                             help="JSON without whitespace between its tokens (a small model can loop on whitespace)")
    add_engine_args(gen)
    gen.set_defaults(func=run_generate)

    bench = commands.add_parser("bench", allow_abbrev=False, help="benchmarks: throughput, latency",
                                description="Benchmarks, optionally side by side with HF transformers.")
    benches = bench.add_subparsers(dest="bench", metavar="{throughput,latency}", required=True)
    for name, module, help_text in (
        ("throughput", throughput, "offline throughput of a request list (requests/s, tokens/s)"),
        ("latency", latency, "latency of one batch: end to end, time to first token, time per output token"),
    ):
        sub = benches.add_parser(name, allow_abbrev=False, help=help_text,
                                 description=(module.__doc__ or "").split("\n\n")[0])
        module.add_arguments(sub)
        sub.set_defaults(func=_bench_runner(module))
    return parser


def _bench_runner(module):
    def run(args: argparse.Namespace) -> int:
        from jaxvllm.benchmarks.common import check_bench_args  # (as build_parser: benchmarks load when used)

        check_bench_args(module, args)
        module.run(args)
        return 0

    return run


# -- generate -----------------------------------------------------------------------------


def sampling_params(args: argparse.Namespace, defaults=None):
    """SamplingParams from the sampling flags the user set, over `defaults` (the model's
    generation config: `LLM.get_default_sampling_params()`, as vLLM's entry points take it);
    UsageError for one it refuses."""
    from jaxvllm import SamplingParams

    kwargs: dict[str, Any] = {}
    for flag in (*_SAMPLING_FLAGS, "ignore-eos", "stop-token-ids", "stop"):
        value = getattr(args, flag.replace("-", "_"))
        if value is not None:
            kwargs[flag.replace("-", "_")] = value
    try:
        constraint = structured_outputs(args)
        if constraint is not None:
            kwargs["structured_outputs"] = constraint
        return SamplingParams(**kwargs) if defaults is None else dataclasses.replace(defaults, **kwargs)
    except TypeError as e:
        raise UsageError(f"a sampling flag is not supported by this jaxvllm ({e}); set: {sorted(kwargs)}") from e
    except ValueError as e:
        raise UsageError(f"bad sampling parameter: {e}") from e


def structured_outputs(args: argparse.Namespace):
    """StructuredOutputsParams from --json-schema, --regex or --choice (None without them);
    the schema file is read here, before the model loads, so a bad one costs nothing."""
    from jaxvllm import StructuredOutputsParams

    if args.json_schema is not None:
        try:
            kind = {"json": json.loads(args.json_schema.read_text(encoding="utf-8"))}
        except (OSError, UnicodeDecodeError) as e:
            raise UsageError(f"cannot read --json-schema: {e}") from e
        except ValueError as e:
            raise UsageError(f"--json-schema {args.json_schema}: not JSON ({e})") from e
    elif args.regex is not None:
        kind = {"regex": args.regex}
    elif args.choice is not None:
        kind = {"choice": args.choice}
    elif args.disable_any_whitespace:
        raise UsageError("--disable-any-whitespace goes with --json-schema")
    else:
        return None
    return StructuredOutputsParams(**kind, disable_any_whitespace=args.disable_any_whitespace)


def read_prompts(args: argparse.Namespace) -> tuple[list, list[str]]:
    """The prompts (the --prompt ones first) and, for each, where it came from: "--prompt 2"
    or "FILE line 3", which names it in errors."""
    prompts: list = list(args.prompt)
    labels = [f"--prompt {k}" for k in range(1, len(prompts) + 1)]
    if args.prompts_file is not None:
        try:
            # Lines end at "\n" only: str.splitlines would also cut at U+2028, U+0085, ... inside a string.
            lines = args.prompts_file.read_text(encoding="utf-8").split("\n")
        except (OSError, UnicodeDecodeError) as e:
            raise UsageError(f"cannot read --prompts-file: {e}") from e
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            label = f"{args.prompts_file} line {number}"
            try:
                prompt = json.loads(line)
            except ValueError as e:
                raise UsageError(f"{label}: not JSON ({e})") from e
            if not isinstance(prompt, (str, dict)):
                raise UsageError(f'{label}: expected a string, {{"prompt": ...}} or {{"prompt_token_ids": [...]}}, '
                                 f"got {type(prompt).__name__}")
            prompts.append(prompt)
            labels.append(label)
    if not prompts:
        raise UsageError("no prompts: give --prompt TEXT or --prompts-file FILE.jsonl")
    return prompts, labels


def check_prompts(llm, prompts: list, labels: list[str], params) -> list[list[int]]:
    """Every prompt's token ids, checked by the engine's own rules (type, emptiness, token
    ids, keys, length within max_model_len) before any is generated; UsageError naming the
    first bad prompt (and how many more there are)."""
    from jaxvllm.input_processor import MULTIMODAL_KEYS, PROMPT_KEYS

    engine = llm.llm_engine
    try:
        params.check_vocab(engine.model_config.vocab_size)
    except ValueError as e:
        raise UsageError(f"bad sampling parameter: {e}") from e
    if params.structured_outputs is not None and engine.structured_outputs is not None:
        # Checked once (and compiled meanwhile): a bad regex or schema is no prompt's fault.
        engine.structured_outputs.grammar(params.structured_outputs)
    token_ids: list[list[int]] = []
    errors: list[str] = []
    for i, (prompt, label) in enumerate(zip(prompts, labels)):
        # (the API ignores them, as vLLM's; multimodal ones the engine names)
        if isinstance(prompt, dict) and (unknown := set(prompt) - PROMPT_KEYS - MULTIMODAL_KEYS):
            errors.append(f"{label}: unknown prompt key(s) {sorted(unknown)}; allowed: {sorted(PROMPT_KEYS)}")
            continue
        try:  # builds the request without queueing it
            parent = engine.make_requests(f"check-{i}", prompt, params)
        except (TypeError, ValueError) as e:
            errors.append(f"{label}: {e}")
            continue
        token_ids.append(list(parent.children[0].prompt_token_ids))
    if errors:
        more = f" (and {len(errors) - 1} more bad prompt{'s' * (len(errors) > 2)})" if len(errors) > 1 else ""
        raise UsageError(errors[0] + more)
    return token_ids


def check_output_path(path: Path) -> None:
    """Before anything is loaded: --output must be a file we can write, in a folder that exists."""
    if path.is_dir():
        raise UsageError(f"--output {path} is a directory")
    parent = path.parent
    if not parent.exists():
        raise UsageError(f"--output {path}: the folder {parent} does not exist")
    if not parent.is_dir():
        raise UsageError(f"--output {path}: {parent} is not a folder")
    try:
        if path.exists():
            open(path, "a").close()  # writable, and left as it is
        else:
            tempfile.TemporaryFile(dir=parent).close()  # the folder takes new files
    except OSError as e:
        raise UsageError(f"--output {path}: cannot write there ({e.strerror or e})") from e


def read_finished(path: Path) -> tuple[dict[int, Any], int]:
    """For --resume: the records already in `path` (prompt index -> its prompt token ids),
    and the bytes of its complete lines; a last line cut short (a run killed mid-write) is
    not counted, and its prompt is generated again."""
    if not path.exists():
        return {}, 0
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1
    finished: dict[int, Any] = {}
    for number, line in enumerate(data[:end].decode("utf-8", errors="replace").split("\n"), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as e:
            raise UsageError(f"{path} line {number}: not JSON ({e}); cannot --resume from this file") from e
        index = record.get("index") if isinstance(record, dict) else None
        if not isinstance(index, int) or isinstance(index, bool) or index < 0:
            raise UsageError(f"{path} line {number}: a record without a prompt \"index\"; "
                             "cannot --resume from this file")
        finished.setdefault(index, record.get("prompt_token_ids"))
    return finished, end


def check_finished(path: Path, finished: dict[int, Any], token_ids: list[list[int]], labels: list[str]) -> None:
    """--resume only completes a file written for these same prompts."""
    for index, ids in sorted(finished.items()):
        if index >= len(token_ids):
            raise UsageError(f"--resume: {path} has prompt index {index}, but there are {len(token_ids)} prompts; "
                             "was it written for other prompts?")
        if ids is not None and ids != token_ids[index]:
            raise UsageError(f"--resume: {path} has other prompt tokens at index {index} than {labels[index]}; "
                             "was it written for other prompts?")


def sort_output(path: Path) -> None:
    """After --resume: the records in input order, each prompt once (rewritten only when needed)."""
    lines = [line for line in path.read_text(encoding="utf-8").split("\n") if line.strip()]
    indexes = [json.loads(line)["index"] for line in lines]
    if indexes == list(range(len(indexes))):
        return
    by_index: dict[int, str] = {}
    for index, line in zip(indexes, lines):
        by_index.setdefault(index, line)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write("".join(by_index[i] + "\n" for i in sorted(by_index)))
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def output_record(out) -> dict[str, Any]:
    return {
        "prompt": out.prompt,
        "prompt_token_ids": out.prompt_token_ids,
        "outputs": [{"index": c.index, "text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason,
                     **({} if c.logprobs is None else {"logprobs": [
                         {str(t): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
                          for t, lp in step.items()} for step in c.logprobs]})}
                    for c in out.outputs],
    }


def print_record(r: dict[str, Any]) -> None:
    prompt = r["prompt"] if r["prompt"] is not None else r["prompt_token_ids"]
    for c in r["outputs"]:
        index = f"[{c['index']}] " if len(r["outputs"]) > 1 else ""
        # A dummy model's ids mostly lie past its small tokenizer's vocabulary: show them.
        ids = "" if c["text"] else f", token ids: {c['token_ids']}"
        print(f"Prompt: {prompt!r}, {index}Generated text: {c['text']!r}{ids}")
        for position, step in enumerate(c.get("logprobs") or ()):
            ranked = sorted(step.items(), key=lambda item: item[1]["rank"])
            print(f"  logprobs[{position}]: " + ", ".join(
                f"{t} {v['decoded_token']!r} {v['logprob']:.4f}" for t, v in ranked))


def run_generate(args: argparse.Namespace) -> int:
    from jaxvllm import LLM
    from jaxvllm.dummy import resolve_model

    params = sampling_params(args)
    prompts, labels = read_prompts(args)
    if args.chunk_size is not None and args.chunk_size < 1:
        raise UsageError("--chunk-size must be >= 1")
    if args.resume and args.output is None:
        raise UsageError("--resume needs --output FILE (the file to complete)")
    finished: dict[int, Any] = {}
    keep_bytes = 0
    if args.output is not None:  # before the model is loaded: a bad path costs nothing
        check_output_path(args.output)
        if args.resume:
            finished, keep_bytes = read_finished(args.output)

    lora = None
    if args.lora is not None:
        from jaxvllm.lora.request import LoRARequest

        lora = LoRARequest(args.lora.name, 1, str(args.lora))
    with resolve_model(args.model) as source:
        llm = LLM(source.path, **engine_kwargs(args, source, **({"enable_lora": True} if lora else {})))
        params = sampling_params(args, llm.get_default_sampling_params())  # (checked before the load too)
        if lora is not None:
            try:
                llm.llm_engine.add_lora(lora)
            except ValueError as e:
                raise UsageError(str(e)) from e
        token_ids = check_prompts(llm, prompts, labels, params)
        check_finished(args.output, finished, token_ids, labels)
        todo = [i for i in range(len(prompts)) if i not in finished]
        chunk = args.chunk_size or 4 * llm.llm_engine.config.max_num_seqs
        if finished:
            print(f"resuming: {len(finished)} of {len(prompts)} prompts are already in {args.output}")
        sink = None
        if args.output is not None:
            if args.resume and args.output.exists():
                if keep_bytes < args.output.stat().st_size:
                    os.truncate(args.output, keep_bytes)  # a record cut short: its prompt runs again
                sink = open(args.output, "a", encoding="utf-8")
            else:
                sink = open(args.output, "w", encoding="utf-8")
        # One chunk: the engine's own progress bar; several: one bar over all of them.
        chunks = [todo[k:k + chunk] for k in range(0, len(todo), chunk)]
        bar = ProgressBar(total=len(todo), desc="Processed prompts", dynamic_ncols=True,
                          disable=args.disable_tqdm or len(chunks) <= 1)
        written = 0
        try:
            for batch in chunks:
                try:
                    outputs = llm.generate([prompts[i] for i in batch], params, lora_request=lora,
                                           use_tqdm=not args.disable_tqdm and len(chunks) == 1)
                except (TypeError, ValueError) as e:  # checked above, so not expected
                    raise UsageError(f"bad prompt: {e}") from e
                records = [{"index": i, **output_record(out)} for i, out in zip(batch, outputs)]
                with defer_interrupts():
                    if sink is not None:
                        sink.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
                        sink.flush()
                        os.fsync(sink.fileno())
                    else:
                        for r in records:
                            print_record(r)
                        sys.stdout.flush()
                    written += len(batch)
                bar.update(len(batch))
        except KeyboardInterrupt:
            if sink is None:
                raise Interrupted(f"interrupted after {written} of {len(prompts)} prompts") from None
            raise Interrupted(f"interrupted: {len(finished) + written} of {len(prompts)} prompts are in "
                              f"{args.output}; add --resume to finish the rest") from None
        except BaseException:
            if sink is not None:
                print(f"jaxvllm generate: {len(finished) + written} of {len(prompts)} prompts are in {args.output}; "
                      "add --resume to finish the rest", file=sys.stderr)
            raise
        finally:
            bar.close()
            if sink is not None:
                sink.close()
    if args.output is not None:
        if finished:
            sort_output(args.output)
        kept = f" ({len(finished)} were already there)" if finished else ""
        print(f"wrote {written} completions to {args.output}{kept}")
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
    except (Interrupted, KeyboardInterrupt) as e:  # Ctrl-C: one line, the shell's 128 + SIGINT
        print(f"{prog}: {e if isinstance(e, Interrupted) else 'interrupted'}", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

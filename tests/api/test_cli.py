"""The `jaxvllm` command: generate end to end on dummy:tiny, its output, and its errors.

Engine flags are the same small shapes in every in-process run (and in test_bench*.py),
so that the token buckets compile once per test session.
"""

import ast
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest

from jaxvllm.cli import main

ROOT = Path(__file__).resolve().parents[2]
# Two token buckets (16, 32), a 64-token context: compiles in seconds on a CPU.
ENGINE = ["--max-model-len", "64", "--max-num-batched-tokens", "32", "--max-num-seqs", "8"]


def generate(*args: str) -> int:
    return main(["generate", "--model", "dummy:tiny", *ENGINE, "--disable-tqdm", *args])


def test_no_command_prints_help(capsys):
    assert main([]) == 0
    out = capsys.readouterr().out
    assert "usage: jaxvllm" in out and "generate" in out and "bench" in out


def test_generate_prints_completions(capsys):
    assert generate("--prompt", "Hello, my name is", "--prompt", "Hi", "--max-tokens", "4", "--temperature", "0") == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("Prompt: ")]
    assert len(lines) == 2
    assert lines[0].startswith("Prompt: 'Hello, my name is', Generated text: ")
    assert lines[1].startswith("Prompt: 'Hi', Generated text: ")


def test_generate_prompts_file_to_jsonl(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('"Hello, my name is"\n\n{"prompt": "Hello, my name is"}\n{"prompt_token_ids": [5, 6, 7]}\n')
    out = tmp_path / "completions.jsonl"
    code = generate("--prompts-file", str(prompts), "--prompt", "Hi", "--output", str(out),
                    "--max-tokens", "5", "--temperature", "0", "--ignore-eos")
    assert code == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["prompt"] for r in records] == ["Hi", "Hello, my name is", "Hello, my name is", None]
    assert [r["index"] for r in records] == [0, 1, 2, 3]
    assert records[3]["prompt_token_ids"] == [5, 6, 7]
    for r in records:
        (completion,) = r["outputs"]
        assert len(completion["token_ids"]) == 5 and completion["finish_reason"] == "length"
        assert isinstance(completion["text"], str)
    # Greedy: the same text as a bare string or as {"prompt": ...} gives the same tokens.
    assert records[1]["outputs"][0]["token_ids"] == records[2]["outputs"][0]["token_ids"]


def printed_completions(capsys) -> list[str]:
    return [ast.literal_eval(line.split(", Generated text: ", 1)[1])
            for line in capsys.readouterr().out.splitlines() if line.startswith("Prompt: ")]


PROMPTS = ["--prompt", "Hello, my name is", "--prompt", "Hi", "--prompt", "1 2 3", "--temperature", "1", "--seed", "0"]
# Bounded everywhere, no whitespace: random weights finish well within the 64-token context.
SCHEMA = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no"]}, "n": {"type": "integer", "minimum": 0, "maximum": 99},
                   "name": {"type": "string", "maxLength": 5}},
    "required": ["answer", "n", "name"],
    "additionalProperties": False,
}


def test_generate_matches_a_regex(capsys):
    assert generate(*PROMPTS, "--regex", "[a-z]{2,5}-[0-9]{1,3}", "--max-tokens", "40") == 0
    texts = printed_completions(capsys)
    assert len(texts) == 3 and all(re.fullmatch("[a-z]{2,5}-[0-9]{1,3}", t) for t in texts), texts


def test_generate_picks_a_choice(capsys):
    assert generate(*PROMPTS, "--choice", "yes", "no", "maybe not") == 0
    texts = printed_completions(capsys)
    assert len(texts) == 3 and set(texts) <= {"yes", "no", "maybe not"}, texts


def test_generate_follows_a_json_schema(tmp_path, capsys):
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMA))
    assert generate(*PROMPTS, "--json-schema", str(schema), "--disable-any-whitespace", "--max-tokens", "50") == 0
    texts = printed_completions(capsys)
    assert len(texts) == 3
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)
        assert " " not in text.replace(json.loads(text)["name"], "")


@pytest.mark.parametrize("args, message", [
    (["--json-schema", "NOPE"], "cannot read --json-schema"),
    (["--json-schema", "BAD"], "--json-schema {tmp}/bad.json: not JSON"),
    (["--regex", "[a-z"], "Grammar error: "),  # the engine's ValueError, once for all prompts
    (["--json-schema", "FOO"], "Grammar error: "),
    (["--disable-any-whitespace"], "--disable-any-whitespace goes with --json-schema"),
    (["--regex", "a", "--choice", "a", "b"], "not allowed with argument"),  # argparse's
])
def test_structured_output_usage_errors(tmp_path, capsys, args, message):
    (tmp_path / "bad.json").write_text('{"type": ')
    (tmp_path / "foo.json").write_text('{"type": "foo"}')
    files = {"NOPE": tmp_path / "nope.json", "BAD": tmp_path / "bad.json", "FOO": tmp_path / "foo.json"}
    args = [str(files.get(a, a)) for a in args]
    assert generate("--prompt", "x", "--prompt", "y", *args) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("jaxvllm generate: error: ") and message.format(tmp=tmp_path) in err, err
    assert "--prompt" not in err  # not blamed on a prompt


@pytest.mark.parametrize("args", [
    ["generate", "--model", "dummy:tiny", "--prompt", "x", "--temperature", "hot"],  # not a float
    ["generate", "--model", "dummy:tiny", "--prompt", "x", "--dtype", "int8"],  # not a choice
    ["generate", "--prompt", "x"],  # --model missing
    ["generate", "--model", "dummy:tiny", "--no-such-flag"],
    ["bench", "throughput", "--model", "dummy:tiny", "--dataset", "sharegpt"],
    ["bench", "latency", "--model", "dummy:tiny", "--batch-size", "two"],
    ["bench"],  # a benchmark is required
])
def test_bad_flags_are_argparse_errors(args, capsys):
    assert main(args) == 2
    assert "error:" in capsys.readouterr().err


@pytest.mark.parametrize("args, message", [
    (["generate", "--model", "/no/such/model", "--prompt", "x"], "does not exist"),
    (["bench", "throughput", "--model", "/no/such/model"], "does not exist"),
    (["bench", "latency", "--model", "/no/such/model"], "does not exist"),
    (["generate", "--model", "dummy:gpt5", "--prompt", "x"], "unknown dummy model"),
    (["generate", "--model", "dummy:tiny"], "no prompts"),
    (["generate", "--model", "dummy:tiny", "--prompt", "x", "--temperature", "-1"], "temperature"),
    (["generate", "--model", "dummy:tiny", "--prompt", "x", "--max-tokens", "0"], "max_tokens"),
    (["generate", "--model", "dummy:tiny", "--prompt", "x", "--load-format", "safetensors"], "dummy"),
    (["bench", "throughput", "--model", "dummy:tiny", "--num-prompts", "0"], "--num-prompts"),
    (["bench", "latency", "--model", "dummy:tiny", "--num-iters", "0"], "--num-iters"),
])
def test_usage_errors_are_one_line_and_exit_2(args, message, capsys):
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err and "Traceback" not in err, err
    assert err.startswith("jaxvllm ")


def test_missing_model_folder_exits_2_from_the_console(tmp_path):
    result = subprocess.run([sys.executable, "-m", "jaxvllm", "generate", "--model", str(tmp_path / "nope"),
                             "--prompt", "x"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "does not exist" in result.stderr and "Traceback" not in result.stderr


def test_bad_prompts_file_line(tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('"fine"\n[1, 2]\n')
    assert generate("--prompts-file", str(prompts)) == 2
    assert "p.jsonl line 2: expected a string" in capsys.readouterr().err


def test_readme_first_command_runs():
    """The README's first command line runs as written, from the console (`python -m jaxvllm`),
    on dummy:tiny's own CPU-sized engine defaults."""
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"## Command line.*?```bash\n(.*?)```", readme, re.S).group(1)
    command = block.strip().splitlines()[0]
    assert command == 'jaxvllm generate --model dummy:tiny --prompt "Hello, my name is"'
    argv = shlex.split(command)
    result = subprocess.run([sys.executable, "-m", "jaxvllm", *argv[1:]], capture_output=True, text=True,
                            timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("Prompt: 'Hello, my name is', Generated text: ")
    # Progress bars on the long phases go to stderr.
    assert "Compiling token buckets" in result.stderr and "Processed prompts" in result.stderr


@pytest.mark.parametrize("args, message", [
    # vLLM's flags that ours only start like: unknown, not read as another (--num-prompts, --profiler-config)
    (["bench", "throughput", "--model", "dummy:tiny", "--n", "2"], "unrecognized arguments: --n 2"),
    (["generate", "--model", "dummy:tiny", "--prompt", "x", "--max-tok", "2"], "unrecognized arguments: --max-tok"),
    (["generate", "--model", "dummy:tiny", "--prompt", "x", "--max-model-len", "1.5K"],
     "no decimals with a binary suffix"),
])
def test_flags_are_never_abbreviated_and_sizes_are_vllms(args, message, capsys):
    assert main(args) == 2
    assert message in capsys.readouterr().err


def test_generate_follows_the_generation_config_and_writes_logprobs(tmp_path):
    """The model's generation config (here --override-generation-config) under the flags
    given, as vLLM's entry points take it; --logprobs reach the output records; vLLM's
    spellings of engine flags (underscores, short names, sizes with k)."""
    out = tmp_path / "completions.jsonl"
    code = main(["generate", "--model", "dummy:tiny", "--max_model_len", "0.064k", "--max-num-batched-tokens", "32",
                 "--max-num-seqs", "8", "-pp", "1", "-dp", "1", "--disable-tqdm", "--prompt", "Hi", "--ignore-eos",
                 "--override-generation-config", '{"max_new_tokens": 3, "temperature": 0}', "--logprobs", "2",
                 "--output", str(out)])
    assert code == 0
    (completion,) = json.loads(out.read_text())["outputs"]
    assert len(completion["token_ids"]) == 3 and len(completion["logprobs"]) == 3
    for token, step in zip(completion["token_ids"], completion["logprobs"]):
        assert str(token) in step and len(step) in (2, 3)  # (the top 2, and the sampled token if not among them)
        assert min(v["rank"] for v in step.values()) == 1  # (greedy: the sampled token is the top one)
    code = main(["generate", "--model", "dummy:tiny", *ENGINE, "--disable-tqdm", "--prompt", "Hi", "--ignore-eos",
                 "--override-generation-config", '{"max_new_tokens": 3}', "--max-tokens", "5", "--output", str(out)])
    assert code == 0 and len(json.loads(out.read_text())["outputs"][0]["token_ids"]) == 5  # (the flag wins)

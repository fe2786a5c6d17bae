"""`jaxvllm generate` on bad input and long runs: prompt errors named by their
--prompts-file line, --output checked before the model loads, written chunk by chunk,
Ctrl-C (exit 130) leaving a valid partial file, and --resume completing it.

Same engine shapes as test_cli.py, so the token buckets compile once per session.
"""

import json

import pytest

from jaxvllm.cli import main
from jaxvllm.llm import LLM

ENGINE = ["--max-model-len", "64", "--max-num-batched-tokens", "32", "--max-num-seqs", "8"]
GREEDY = ["--max-tokens", "3", "--temperature", "0", "--ignore-eos"]


def generate(*args: str) -> int:
    return main(["generate", "--model", "dummy:tiny", *ENGINE, "--disable-tqdm", *args])


def one_line_error(capsys) -> str:
    """The one line the command wrote about what went wrong (after the loading's progress bars)."""
    err = capsys.readouterr().err
    ours = [line for line in err.splitlines() if line.startswith("jaxvllm ")]
    assert len(ours) == 1 and err.rstrip().endswith(ours[0]) and "Traceback" not in err, err
    return ours[0]


def read_jsonl(path):
    text = path.read_text(encoding="utf-8")
    assert text == "" or text.endswith("\n")
    return [json.loads(line) for line in text.split("\n")[:-1]]  # every line a whole JSON object


@pytest.fixture
def prompts_file(tmp_path):
    """Ten prompts (strings, {"prompt"}, {"prompt_token_ids"}), one blank line among them;
    prompt 3 holds U+2028 and U+0085 as they are (not escaped)."""
    lines = []
    for k in range(10):
        if k == 3:  # a line separator to str.splitlines, not to JSONL
            lines.append(json.dumps(f"Prompt number {k}\u2028says\x85", ensure_ascii=False))
        elif k % 3 == 0:
            lines.append(json.dumps(f"Prompt number {k} says"))
        elif k % 3 == 1:
            lines.append(json.dumps({"prompt": f"Hello {k}, my name is"}))
        else:
            lines.append(json.dumps({"prompt_token_ids": [5 + k, 6 + k, 7 + k]}))
        if k == 4:
            lines.append("")
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


# -- prompt errors name their line -------------------------------------------------------------


@pytest.mark.parametrize("bad, message", [
    ('""', "The decoder prompt cannot be empty"),
    ('{"prompt": ""}', "The decoder prompt cannot be empty"),
    ("42", "expected a string"),
    ('{"prompt": 5}', "a prompt must be a str or a dict"),
    ('{"prompt_token_ids": "abc"}', "prompt_token_ids must be a list of ints"),
    ('{"prompt_token_ids": [1, -5]}', "Token id -5 is out of vocabulary"),
    ('{"prompt_token_ids": []}', "The decoder prompt cannot be empty"),
    ('{"prompt": "x", "max_tokens": 3}', "unknown prompt key"),
    ('{"prompt": 5, "prompt_token_ids": [1]}', "must be a str"),
    ('{"cache_salt": "x"}', "needs 'prompt'"),
    (json.dumps({"prompt_token_ids": [5] * 70}), "context length is only"),
    ("{not json", "not JSON"),
])
def test_prompt_errors_name_the_line(tmp_path, capsys, bad, message):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(f'"fine"\n\n{bad}\n"also fine"\n')
    out = tmp_path / "out.jsonl"
    out.write_text("keep me\n")
    assert generate("--prompts-file", str(prompts), "--output", str(out), *GREEDY) == 2
    err = one_line_error(capsys)
    assert "prompts.jsonl line 3: " in err and message in err, err
    assert out.read_text() == "keep me\n"  # nothing generated, nothing overwritten


def test_several_bad_prompts_name_the_first_and_count_the_rest(tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('"fine"\n{"prompt_token_ids": [999999]}\n""\n{"prompt": "x", "oops": 1}\n')
    assert generate("--prompts-file", str(prompts), "--prompt", "", *GREEDY) == 2
    err = one_line_error(capsys)
    assert "--prompt 1: The decoder prompt cannot be empty (the text '' encodes to no tokens) (and 3 more bad prompts)" \
        in err, err


def test_empty_multimodal_fields_in_a_prompts_file_are_read_as_the_api_reads_them(tmp_path, capsys):
    """Empty multimodal fields pass, as the engine (and vLLM) ignores them; filled ones get
    the engine's message, not "unknown prompt key"."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "hello", "multi_modal_data": null}\n')
    assert generate("--prompts-file", str(prompts), *GREEDY) == 0
    prompts.write_text('{"prompt": "hello", "multi_modal_data": {"image": "x.png"}}\n')
    assert generate("--prompts-file", str(prompts), *GREEDY) == 2
    assert "multimodal inputs (['multi_modal_data']) are not supported" in one_line_error(capsys)


# -- --output is checked before the model loads ------------------------------------------------


@pytest.fixture
def no_model(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded")
    monkeypatch.setattr(LLM, "__init__", refuse)


@pytest.mark.parametrize("case, message", [
    ("directory", "is a directory"),
    ("missing parent", "does not exist"),
    ("parent is a file", "is not a folder"),
])
def test_bad_output_paths_exit_2_before_loading(tmp_path, capsys, no_model, case, message):
    output = {"directory": tmp_path, "missing parent": tmp_path / "nope" / "out.jsonl",
              "parent is a file": tmp_path / "p.jsonl" / "out.jsonl"}[case]
    (tmp_path / "p.jsonl").write_text('"x"\n')
    assert generate("--prompt", "x", "--output", str(output)) == 2
    err = one_line_error(capsys)
    assert message in err and err.startswith("jaxvllm generate: error: --output"), err


@pytest.mark.parametrize("output", ["/proc/version", "/proc/jaxvllm-out.jsonl"], ids=["existing", "new"])
def test_unwritable_output_exits_2_before_loading(capsys, no_model, output):
    """/proc takes no new files and its files refuse appends, even for root (CI runs as root,
    where permission bits would not stop a write)."""
    assert generate("--prompt", "x", "--output", output) == 2
    assert "cannot write there" in one_line_error(capsys)


@pytest.mark.parametrize("args, message", [
    (["--resume"], "--resume needs --output"),
    (["--chunk-size", "0"], "--chunk-size"),
])
def test_flag_errors_exit_2_before_loading(capsys, no_model, args, message):
    assert generate("--prompt", "x", *args) == 2
    assert message in one_line_error(capsys)


# -- streaming writes, Ctrl-C and --resume -----------------------------------------------------


def count_generate_calls(monkeypatch, fail_on=None, error=KeyboardInterrupt):
    """LLM.generate, recording each call's number of prompts; call `fail_on` (1-based) raises."""
    calls: list[int] = []
    real = LLM.generate

    def generate_(self, prompts, *args, **kwargs):
        calls.append(len(prompts))
        if len(calls) == fail_on:
            raise error()
        return real(self, prompts, *args, **kwargs)

    monkeypatch.setattr(LLM, "generate", generate_)
    return calls


def test_interrupt_keeps_a_valid_partial_file_and_resume_completes_it(tmp_path, prompts_file, monkeypatch, capsys):
    full = tmp_path / "full.jsonl"
    calls = count_generate_calls(monkeypatch)
    assert generate("--prompts-file", str(prompts_file), "--output", str(full), "--chunk-size", "4", *GREEDY) == 0
    assert calls == [4, 4, 2]  # chunks of --chunk-size
    expected = read_jsonl(full)
    assert [r["index"] for r in expected] == list(range(10))
    capsys.readouterr()

    # Ctrl-C during the second chunk: exit 130, one line, the first chunk on disk.
    out = tmp_path / "out.jsonl"
    out.write_text("an old file is overwritten\n")
    monkeypatch.undo()
    calls = count_generate_calls(monkeypatch, fail_on=2)
    assert generate("--prompts-file", str(prompts_file), "--output", str(out), "--chunk-size", "4", *GREEDY) == 130
    err = one_line_error(capsys)
    assert err == f"jaxvllm generate: interrupted: 4 of 10 prompts are in {out}; add --resume to finish the rest"
    partial = read_jsonl(out)
    assert partial == expected[:4]

    # --resume generates only the 6 missing prompts; the result is the uninterrupted run's.
    monkeypatch.undo()
    calls = count_generate_calls(monkeypatch)
    assert generate("--prompts-file", str(prompts_file), "--output", str(out), "--chunk-size", "4",
                    "--resume", *GREEDY) == 0
    assert calls == [4, 2]
    assert "resuming: 4 of 10 prompts are already in" in capsys.readouterr().out
    assert read_jsonl(out) == expected

    # Resuming a complete file generates nothing and changes nothing.
    calls.clear()
    assert generate("--prompts-file", str(prompts_file), "--output", str(out), "--resume", *GREEDY) == 0
    assert calls == [] and read_jsonl(out) == expected

    # Without --resume the file is generated afresh.
    assert generate("--prompts-file", str(prompts_file), "--output", str(out), *GREEDY) == 0
    assert calls == [10] and read_jsonl(out) == expected


def test_resume_drops_a_cut_record_and_fills_gaps_in_order(tmp_path, prompts_file, capsys):
    out = tmp_path / "out.jsonl"
    assert generate("--prompts-file", str(prompts_file), "--output", str(out), *GREEDY) == 0
    expected = read_jsonl(out)
    lines = [line + "\n" for line in out.read_text(encoding="utf-8").split("\n")[:-1]]
    # Prompts 2 and 5 missing, 7 written twice, and the file ends in half a record (a killed run).
    damaged = [line for k, line in enumerate(lines[:9]) if k not in (2, 5)] + [lines[7], lines[9][:20]]
    out.write_text("".join(damaged), encoding="utf-8")
    assert generate("--prompts-file", str(prompts_file), "--output", str(out), "--resume", *GREEDY) == 0
    assert read_jsonl(out) == expected
    assert "(7 were already there)" in capsys.readouterr().out


def test_resume_refuses_another_prompt_list(tmp_path, prompts_file, capsys):
    out = tmp_path / "out.jsonl"
    assert generate("--prompts-file", str(prompts_file), "--output", str(out), *GREEDY) == 0
    before = out.read_text()
    capsys.readouterr()
    assert generate("--prompt", "Something else", "--output", str(out), "--resume", *GREEDY) == 2
    assert "was it written for other prompts?" in one_line_error(capsys)
    other = tmp_path / "other.jsonl"
    other.write_text('"Something else"\n' + prompts_file.read_text())
    assert generate("--prompts-file", str(other), "--output", str(out), "--resume", *GREEDY) == 2
    assert "other prompt tokens at index 0 than " in one_line_error(capsys)
    assert out.read_text() == before
    out.write_text('{"no": "index"}\n')
    assert generate("--prompts-file", str(prompts_file), "--output", str(out), "--resume", *GREEDY) == 2
    assert 'out.jsonl line 1: a record without a prompt "index"' in one_line_error(capsys)


def test_a_failing_run_keeps_its_finished_chunks(tmp_path, prompts_file, monkeypatch, capsys):
    out = tmp_path / "out.jsonl"
    count_generate_calls(monkeypatch, fail_on=3, error=lambda: RuntimeError("device lost"))
    with pytest.raises(RuntimeError, match="device lost"):
        generate("--prompts-file", str(prompts_file), "--output", str(out), "--chunk-size", "3", *GREEDY)
    assert [r["index"] for r in read_jsonl(out)] == list(range(6))
    assert "6 of 10 prompts are in" in capsys.readouterr().err


def test_printing_is_chunked_too(prompts_file, monkeypatch, capsys):
    calls = count_generate_calls(monkeypatch)
    assert generate("--prompts-file", str(prompts_file), "--chunk-size", "6", *GREEDY) == 0
    assert calls == [6, 4]
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("Prompt: ")]
    assert len(lines) == 10 and lines[0].startswith("Prompt: 'Prompt number 0 says', Generated text: ")

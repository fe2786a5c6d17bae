"""vLLM's offline examples (examples/*.py, vLLM's with only the import and the model line
changed) run against jaxvllm on a tiny model, each in its own Python process as a user
would run it."""

import os
import subprocess
import sys
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
TIMEOUT_S = 300

PROMPTS = [
    "Hello, my name is",
    "The president of the United States is",
    "The capital of France is",
    "The future of AI is",
]

# A template for chat.py's --chat-template-path.
PLAIN = "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}assistant:"


def run_example(script: str, *args: str, model: str | Path | None = None) -> str:
    """Run examples/<script> from the repository root; return its stdout (rc must be 0).

    model: JAXVLLM_EXAMPLE_MODEL (None: the script's own default, dummy:tiny).
    """
    env = dict(os.environ)
    env.pop("JAXVLLM_EXAMPLE_MODEL", None)
    if model is not None:
        env["JAXVLLM_EXAMPLE_MODEL"] = str(model)
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / script), *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S,
    )
    output = f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    assert proc.returncode == 0, f"{script} exited with {proc.returncode}:\n{output}"
    return proc.stdout


def engine_flags(**values) -> list[str]:
    """Command-line engine flags for `values` (the rest keep the engine's defaults)."""
    return [f"--{k.replace('_', '-')}={v}" for k, v in values.items()]


# CPU-sized engine arguments for the tiny checkpoint (dummy:tiny brings its own).
SMALL = dict(max_model_len=512, max_num_seqs=16, max_num_batched_tokens=256)


@pytest.fixture(scope="module")
def tiny_qwen3(tiny_checkpoint) -> Path:
    return tiny_checkpoint("qwen3")


def test_basic_default_model():
    out = run_example("basic.py")  # no JAXVLLM_EXAMPLE_MODEL: dummy:tiny
    assert out.count("Output:    ") == len(PROMPTS)
    for prompt in PROMPTS:
        assert f"Prompt:    {prompt!r}" in out


def test_generate_sampling_flags(tiny_qwen3):
    # --model on the command line beats the default (here a JAXVLLM_EXAMPLE_MODEL that does not exist).
    out = run_example(
        "generate.py", *engine_flags(**SMALL), "--model", str(tiny_qwen3),
        "--max-tokens", "5", "--temperature", "0.7", "--top-p", "0.9", "--top-k", "20",
        model="dummy:no-such-model",
    )
    assert out.count("Generated text: ") == len(PROMPTS)
    for prompt in PROMPTS:
        assert f"Prompt: {prompt!r}\n" in out


def test_chat(tmp_path):
    # dummy:tiny (the script's default): its tokenizer has a chat template, used first; then the file's.
    template = tmp_path / "plain.jinja"
    template.write_text(PLAIN)
    out = run_example("chat.py", "--max_tokens", "4", "--chat-template-path", str(template))  # vLLM's _ spelling too
    # One conversation, then a batch of 10 with the checkpoint's template, then 10 with the file's.
    assert out.count("Generated text: ") == 1 + 10 + 10
    assert out.count("Generated Outputs:") == 3
    assert out.count("'Write an essay about the importance of higher education.'") == 21


def test_llm_engine_example(tiny_qwen3):
    out = run_example("llm_engine_example.py", *[f"--{k.replace('_', '-')}={v}" for k, v in SMALL.items()],
                      model=tiny_qwen3)
    finished = [line for line in out.splitlines() if line.startswith("RequestOutput(")]
    assert len(finished) == 3
    by_id = {line.split("request_id='")[1].split("'")[0]: line for line in finished}
    assert sorted(by_id) == ["0", "1", "2"]
    assert "prompt='A robot may not injure a human being'" in by_id["0"]
    assert "Logprob(logprob=" in by_id["0"]  # logprobs=1
    assert "finished=True" in by_id["1"]
    # n=2, streamed (CUMULATIVE): as vLLM V1's, each output holds one completion, and the
    # request's last one says finished.
    assert by_id["2"].count("CompletionOutput(index=") == 1 and "finished=True" in by_id["2"]


def test_prefix_caching():
    # dummy:tiny (the script's default): its CPU-sized engine defaults keep the two LLMs' start-up short.
    out = run_example("prefix_caching.py")
    assert "Results with `enable_prefix_caching=False`" in out
    assert "Results with `enable_prefix_caching`" in out
    assert out.count("Generated text: ") == 2 * len(PROMPTS)
    for prompt in PROMPTS:
        assert out.count(f"the following paragraph: {prompt}") == 2
    assert "Generated answers are the same: True" in out

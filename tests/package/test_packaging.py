"""The installed package: imports, console script, and the tiny-checkpoint script."""

import json
import subprocess
import sys


def test_both_packages_import():
    import jaxvllm
    import pallas_kernels

    assert jaxvllm.__version__
    assert callable(pallas_kernels.ragged_paged_attention_reference)


def test_console_script_prints_help():
    for cmd in (["jaxvllm"], [sys.executable, "-m", "jaxvllm"], ["jaxvllm", "--help"]):
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr
        assert "usage: jaxvllm" in result.stdout


def test_make_tiny_script(tmp_path):
    out = tmp_path / "tiny-qwen3"
    result = subprocess.run(
        [sys.executable, "weights/make_tiny.py", "--arch", "qwen3", "--out", str(out)],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["hidden_size"] == 64
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(out))
    text = "Hello, world! Ünïcödé 🙂"
    assert tokenizer.decode(tokenizer(text).input_ids) == text
    assert len(tokenizer) <= config["vocab_size"]


def test_readme_quickstart_runs(tmp_path):
    """The README's Python quickstart runs as written (writing its checkpoint under tmp)."""
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    code = re.search(r"## Quickstart.*?```python\n(.*?)```", readme, re.S).group(1)
    assert '"weights/tiny-qwen3"' in code
    code = code.replace('"weights/tiny-qwen3"', repr(str(tmp_path / "tiny-qwen3")))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                            cwd=Path(__file__).resolve().parents[2])
    assert result.returncode == 0, result.stderr
    assert result.stdout.count(" -> ") == 2 and "num_gpu_blocks" in result.stdout

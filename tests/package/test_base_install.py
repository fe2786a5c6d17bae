"""`pip install jaxvllm` without extras serves: in a process where only the distributions
that pyproject.toml's base dependencies pull in (and the standard library) can be
imported, an LLM starts, chats, generates and follows a JSON schema. The test venv has
far more installed (torch, the oracles), which would hide a missing base dependency."""

from __future__ import annotations

import importlib.metadata as metadata
import re
import subprocess
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]

# Runs first in the child: every top-level module of an installed distribution outside
# ALLOWED looks absent (`find_spec` None, import fails), as if it were not installed.
HIDE = """
import sys, importlib.machinery
blocked = frozenset({blocked!r})
class Hidden(importlib.machinery.PathFinder):
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name.partition(".")[0] in blocked:
            return None
        return super().find_spec(name, path, target)
sys.meta_path = [Hidden if f is importlib.machinery.PathFinder else f for f in sys.meta_path]
"""

SERVE = """
import json
from jaxvllm import LLM, SamplingParams, StructuredOutputsParams
llm = LLM("dummy:tiny", max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64, token_buckets=[64])
greedy = SamplingParams(temperature=0, max_tokens=8)
assert llm.chat([[{"role": "user", "content": "Hi"}]], greedy, use_tqdm=False)[0].outputs[0].token_ids
assert llm.generate(["Hello"], greedy, use_tqdm=False)[0].outputs[0].token_ids
schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
json_params = SamplingParams(temperature=0, max_tokens=40, structured_outputs=StructuredOutputsParams(json=schema))
out = llm.generate(["{"], json_params, use_tqdm=False)[0].outputs[0]
assert out.finish_reason != "stop" or isinstance(json.loads(out.text)["a"], int), out.text
import torch  # noqa: F401  (must fail: the check hides what the base install lacks)
"""


def _name(dist: str) -> str:
    return re.sub(r"[-_.]+", "-", dist).lower()


def base_distributions() -> set[str]:
    """The installed distributions that pyproject.toml's dependencies need, transitively,
    without extras (markers evaluated for this interpreter)."""
    wanted = [Requirement(r) for r in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]]
    found: set[str] = set()
    while wanted:
        req = wanted.pop()
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        name = _name(req.name)
        if name in found:
            continue
        found.add(name)
        for extra in req.extras:  # (what an extra of a dependency adds is part of the base install)
            wanted += [r for r in map(Requirement, metadata.requires(req.name) or [])
                       if r.marker is not None and r.marker.evaluate({"extra": extra})]
        wanted += map(Requirement, metadata.requires(req.name) or [])
    return found


def test_the_base_install_serves_without_the_extras():
    allowed = base_distributions() | {"jaxvllm", "pip", "setuptools"}
    blocked = {module for module, dists in metadata.packages_distributions().items()
               if module.isidentifier() and not {_name(d) for d in dists} & allowed}
    assert "torch" in blocked and "jax" not in blocked and "transformers" not in blocked
    result = subprocess.run([sys.executable, "-c", HIDE.format(blocked=sorted(blocked)) + SERVE],
                            capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert "ModuleNotFoundError: No module named 'torch'" in result.stderr, result.stderr[-3000:]
    assert "AssertionError" not in result.stderr and "ImportError" not in result.stderr, result.stderr[-3000:]

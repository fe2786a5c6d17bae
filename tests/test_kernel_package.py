"""pallas_kernels is a leaf package: it imports nothing from jaxvllm (jaxvllm imports it),
so the kernels, their benchmark and their AOT check can be used and moved on their own."""

from __future__ import annotations

import ast
import subprocess
import sys
from graphlib import TopologicalSorter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_pallas_kernels_imports_nothing_from_jaxvllm():
    # A fresh interpreter: this test process has long imported jaxvllm.
    code = ("import pallas_kernels, pallas_kernels.bench, pallas_kernels.aot_check, sys; "
            "assert not any(m.startswith('jaxvllm') for m in sys.modules)")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr


def test_pallas_kernels_has_no_import_cycle():
    """Imports inside functions count too: a lazy import only hides a cycle."""
    modules = {p.stem: p for p in (ROOT / "pallas_kernels").glob("*.py") if p.stem != "__init__"}
    graph = {}
    for name, path in modules.items():
        imported = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("pallas_kernels."):
                imported.add(node.module.split(".")[1])
            elif isinstance(node, ast.Import):
                imported |= {a.name.split(".")[1] for a in node.names if a.name.startswith("pallas_kernels.")}
        graph[name] = imported & modules.keys()
    TopologicalSorter(graph).prepare()  # raises CycleError, naming the cycle

"""The packages' import structure: no import cycle anywhere in jaxvllm or pallas_kernels
(imports inside functions count: a lazy import only hides a cycle); pallas_kernels is a
leaf that imports nothing from jaxvllm, and the config layer imports nothing from the
rest of jaxvllm, so that validating engine arguments loads neither jax nor the kernels."""

from __future__ import annotations

import ast
import subprocess
import sys
from graphlib import TopologicalSorter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("jaxvllm", "pallas_kernels")


def modules() -> dict[str, Path]:
    """Every module of both packages by its dotted name (a package by its own name)."""
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The modules of `known` that `name` imports, anywhere in its file."""

    def module_of(dotted: str) -> str | None:  # the longest known prefix: `a.b.c` of `a.b.c.name`
        while dotted and dotted not in known:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {module_of(a.name) for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, up level - 1
                parent = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(parent + ([base] if base else []))
            found |= {module_of(f"{base}.{a.name}") for a in node.names} | {module_of(base)}
    return found - {None, name}


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def test_no_import_cycle_in_either_package():
    TopologicalSorter(graph()).prepare()  # raises CycleError, naming the cycle


def test_the_cycle_check_sees_lazy_imports(tmp_path):
    """The check itself: a cycle closed by an import inside a function is found."""
    known = {"p.a": tmp_path / "a.py", "p.b": tmp_path / "b.py"}
    known["p.a"].write_text("import p.b\n")
    known["p.b"].write_text("def f():\n    from p import a\n    from . import a as again\n")
    assert imports("p.b", known["p.b"], known) == {"p.a"}


def test_pallas_kernels_imports_nothing_from_jaxvllm():
    assert not [(m, d) for m, deps in graph().items() if m.startswith("pallas_kernels")
                for d in deps if d.startswith("jaxvllm")]
    # A fresh interpreter: this test process has long imported jaxvllm.
    code = ("import pallas_kernels, pallas_kernels.bench, pallas_kernels.aot_check, sys; "
            "assert not any(m.startswith('jaxvllm') for m in sys.modules)")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr


def test_config_is_a_leaf():
    assert graph()["jaxvllm.config"] == set()
    code = ("import sys; from jaxvllm.config import EngineConfig; EngineConfig(model='m', dtype='bfloat16'); "
            "loaded = sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'pallas_kernels', 'transformers')"
            " or (m.startswith('jaxvllm.') and m != 'jaxvllm.config')); assert not loaded, loaded")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr


def test_lower_layers_never_import_higher_ones():
    """Data flows one way: LLM -> engine -> scheduler -> model runner -> model -> kernels."""
    layers = [  # each may import only from the ones after it
        {"jaxvllm.llm"},
        {"jaxvllm.beam_search"},
        {"jaxvllm.engine"},
        {"jaxvllm.input_processor", "jaxvllm.output_processor", "jaxvllm.scheduler"},
        {"jaxvllm.model_runner"},
        {"jaxvllm.batch_builder", "jaxvllm.kv_cache"},
        {"jaxvllm.models", "jaxvllm.models.llama", "jaxvllm.models.gemma3"},
        {"jaxvllm.models.moe"},
        {"jaxvllm.models.common"},
        {"jaxvllm.layers"},
    ]
    g = graph()
    for i, layer in enumerate(layers):
        higher = set().union(*layers[:i])
        for module in layer:
            assert not g[module] & higher, f"{module} imports {sorted(g[module] & higher)}"


def test_no_architecture_imports_another():
    """Every architecture builds on jaxvllm.models.common, never on another architecture."""
    from jaxvllm.models import MODELS

    architectures = {m.__name__ for m in MODELS.values()}
    g = graph()
    assert not [(a, sorted(g[a] & architectures)) for a in architectures if g[a] & architectures]

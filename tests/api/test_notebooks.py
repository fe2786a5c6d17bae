"""The notebooks run top to bottom (nbclient, kernel `python3`), so they cannot rot.

Each runs as a copy in a temporary folder, with the repository root on PYTHONPATH for
`weights.make_tiny`. The folder is the kernel's working directory, where throughput.ipynb
saves its figure (beside the notebook, as for a user), and its TMPDIR, where quickstart.ipynb
writes its model: what a run writes stays with pytest's temporary folders.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat", reason="the test extra installs nbformat")
nbclient = pytest.importorskip("nbclient", reason="the test extra installs nbclient")

REPO = Path(__file__).resolve().parents[2]
NOTEBOOKS = REPO / "notebooks"


def execute(name: str, tmp_path: Path, monkeypatch) -> nbformat.NotebookNode:
    """Run a copy of notebooks/NAME in tmp_path; a cell that raises fails the test with its traceback."""
    copy = tmp_path / name
    shutil.copy(NOTEBOOKS / name, copy)
    # The kernel is a subprocess: it inherits the environment and, should nbclient not pass
    # it the path below, this working directory rather than the repository's.
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    nb = nbformat.read(copy, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()
    nbformat.write(nb, copy)  # executed, for a look when a check below fails
    return nb


def text_output(nb) -> str:
    return "".join(
        out.get("text", "") + "".join(str(v) for v in out.get("data", {}).values() if isinstance(v, str))
        for cell in nb.cells if cell.cell_type == "code" for out in cell.outputs
    )


def test_notebooks_are_clean():
    """Committed without outputs: the tests are what runs them."""
    for path in sorted(NOTEBOOKS.glob("*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        nbformat.validate(nb)
        assert nb.metadata.kernelspec.name == "python3"
        for cell in nb.cells:
            if cell.cell_type == "code":
                assert not cell.outputs and cell.execution_count is None, f"{path.name} has outputs"


@pytest.mark.slow
def test_quickstart_runs(tmp_path, monkeypatch):
    nb = execute("quickstart.ipynb", tmp_path, monkeypatch)
    out = text_output(nb)
    for expected in ("greedy:", "completion 1:", "prompt logprobs", "->", "step 1:", "finished ['medium']",
                     "KV blocks used 0/"):
        assert expected in out, expected
    # shutdown() and the with block gave back every device array the kernel had
    assert "after shutdown(): 0 arrays" in out and "after the with:   0 arrays" in out


@pytest.mark.slow
def test_throughput_runs_and_saves_the_figure(tmp_path, monkeypatch):
    nb = execute("throughput.ipynb", tmp_path, monkeypatch)
    figure = tmp_path / "throughput.png"
    assert figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and figure.stat().st_size > 10_000
    out = text_output(nb)
    assert "dummy:tiny" in out or "dummy:qwen3-0.6b" in out
    table = out[out.index("output tok/s"):].splitlines()[1:5]
    assert [int(line.split()[0]) for line in table] == [1, 4, 16, 64] or "gpu" in out


@pytest.mark.slow
def test_lora_runs_and_plots_a_score_per_adapter(tmp_path, monkeypatch):
    nb = execute("lora.ipynb", tmp_path, monkeypatch)
    figure = tmp_path / "lora_scores.png"
    assert figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = text_output(nb)
    assert "== adapter-a" in out and "== adapter-b" in out and "'base':" in out


@pytest.mark.slow
def test_rl_live_weights_reward_rises(tmp_path, monkeypatch):
    nb = execute("rl_live_weights.ipynb", tmp_path, monkeypatch)
    assert (tmp_path / "grpo_reward.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = text_output(nb)
    first, last = map(float, re.search(r"mean reward ([\d.]+) -> ([\d.]+);", out).groups())
    assert last > first + 0.2, out

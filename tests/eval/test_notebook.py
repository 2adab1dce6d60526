"""The notebooks execute top to bottom on CPU: quickstart (real SmolLM2, a few minutes at most), pictures (no model)."""

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def execute(name: str, monkeypatch):
    """Runs notebooks/<name> from the notebooks/ folder (as a user opening it would) and returns it with outputs."""
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # tiny chunked forwards thrash with more on a busy CPU
    monkeypatch.setenv("PYTHONWARNINGS", "ignore")
    nb = nbformat.read(ROOT / "notebooks" / name, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=170, kernel_name="python3",
                                     resources={"metadata": {"path": str(ROOT / "notebooks")}})
    client.execute()
    return nb


@pytest.mark.slow
def test_quickstart_notebook_executes(monkeypatch):
    nb = execute("quickstart.ipynb", monkeypatch)
    outputs = ["".join(o.get("text", "") or str(o.get("data", {}).get("text/markdown", "")) for o in c.outputs)
               for c in nb.cells if c.cell_type == "code"]
    assert "TurboQuantCache k4v4" in outputs[1]  # the summary line after generating
    assert "| 4bit (all layers) |" in outputs[2]
    assert "| fp16 | " in outputs[3] and "| naive-int4 |" in outputs[3]
    assert any(o.get("data", {}).get("image/png") for o in nb.cells[-1].outputs)


def test_pictures_notebook_executes(monkeypatch):
    """No model is loaded: the memory figure is measured on a random-init cache geometry, the others read eval/results."""
    nb = execute("pictures.ipynb", monkeypatch)
    code = [c for c in nb.cells if c.cell_type == "code"]
    figures = [c for c in code if "plt.subplots" in c.source]
    assert len(figures) == 4  # memory, quality, needle, speed
    for cell in figures:
        assert any(o.get("data", {}).get("image/png") for o in cell.outputs), cell.source[:80]
    memory = next("".join(o.get("text", "") for o in c.outputs) for c in code if "measured = " in c.source)
    for cache in ("fp16", "k8v4", "4bit", "k3v4", "3bit"):
        assert sum(line.startswith(f"| {cache} | ") for line in memory.splitlines()) == 1, cache

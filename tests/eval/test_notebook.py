"""notebooks/quickstart.ipynb executes top to bottom on CPU (real SmolLM2, so a few minutes at most)."""

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_quickstart_notebook_executes(monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # tiny chunked forwards thrash with more on a busy CPU
    monkeypatch.setenv("PYTHONWARNINGS", "ignore")
    nb = nbformat.read(ROOT / "notebooks" / "quickstart.ipynb", as_version=4)
    client = nbclient.NotebookClient(nb, timeout=170, kernel_name="python3",
                                     resources={"metadata": {"path": str(ROOT / "notebooks")}})
    client.execute()
    outputs = ["".join(o.get("text", "") or str(o.get("data", {}).get("text/markdown", "")) for o in c.outputs)
               for c in nb.cells if c.cell_type == "code"]
    assert "TurboQuantCache k4v4" in outputs[1]  # the summary line after generating
    assert "| 4bit (all layers) |" in outputs[2]
    assert "| fp16 | " in outputs[3] and "| naive-int4 |" in outputs[3]
    assert any(o.get("data", {}).get("image/png") for o in nb.cells[-1].outputs)

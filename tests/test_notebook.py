"""examples/quickstart.ipynb runs top to bottom (nbclient, a fresh python3 kernel in the repository root, CPU)."""

from __future__ import annotations

import os

import pytest

nbclient = pytest.importorskip("nbclient")
nbformat = pytest.importorskip("nbformat")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_quickstart_notebook_executes():
    nb = nbformat.read(os.path.join(ROOT, "examples", "quickstart.ipynb"), as_version=4)
    client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": ROOT}})
    client.execute()  # raises CellExecutionError with the failing cell's traceback
    outputs = "".join(o.get("text", "") for cell in nb.cells if cell.cell_type == "code" for o in cell.get("outputs", []))
    assert "serving at http://127.0.0.1:" in outputs and "image tokens:" in outputs and "fits:" in outputs

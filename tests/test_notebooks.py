"""The notebooks in notebooks/ run top to bottom in a Jupyter kernel (nbclient + ipykernel) on their fast setting
(``LCONV_NOTEBOOK_FAST=1``: tiny models, a few updates; each well under two minutes on a 2-core CPU), and are
committed without outputs."""
import os
import pathlib

import nbformat
import pytest
from nbclient import NotebookClient

from lconv.data import sources

pytestmark = pytest.mark.slow  # each notebook trains a tiny model: run by CI, skipped by the quick command

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOK_DIR = ROOT / "notebooks"
NOTEBOOKS = sorted(p.name for p in NOTEBOOK_DIR.glob("*.ipynb"))


def test_there_are_notebooks():
    assert len(NOTEBOOKS) >= 4, NOTEBOOKS


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_is_committed_without_outputs(name):
    notebook = nbformat.read(NOTEBOOK_DIR / name, as_version=4)
    nbformat.validate(notebook)
    for i, cell in enumerate(notebook.cells):
        if cell.cell_type == "code":
            assert not cell.outputs and cell.execution_count is None, (
                f"{name} cell {i} has outputs: clear them before committing "
                "(jupyter nbconvert --clear-output --inplace notebooks/*.ipynb)")


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """The bundled corpus prepared once for every notebook (the notebooks' own first run does this too)."""
    path = str(tmp_path_factory.mktemp("notebook_data"))
    for dataset in ("ddtp/en_de", "ddtp/lm_en"):
        sources.get_source(dataset, "train", path)
    return path


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs(name, data_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("LCONV_NOTEBOOK_FAST", "1")
    monkeypatch.setenv("LCONV_NOTEBOOK_DATA_DIR", data_dir)
    monkeypatch.setenv("LCONV_NOTEBOOK_RUNS", str(tmp_path / "runs"))
    # The kernel imports this checkout (as the other tests do), on one CPU device: conftest's 8 virtual devices
    # are for the sharding tests.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    notebook = nbformat.read(NOTEBOOK_DIR / name, as_version=4)
    client = NotebookClient(notebook, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(NOTEBOOK_DIR)}})
    client.execute()  # raises CellExecutionError naming the cell and its traceback

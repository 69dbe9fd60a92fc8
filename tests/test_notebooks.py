"""The notebooks in notebooks/ run top to bottom in a Jupyter kernel (nbclient + ipykernel) on their fast setting
(``LCONV_NOTEBOOK_FAST=1``: tiny models, a few updates; each well under two minutes on a 2-core CPU), and are
committed without outputs.

The kernel imports the lconv this test imports: the checkout's in the suite, the installed package's when CI runs
this file with ``notebooks/`` from a directory outside the checkout, in a venv where only ``pip install .`` put lconv
(``.ci/run``)."""
import os
import pathlib

import helpers
import nbformat
import pytest
from nbclient import NotebookClient

import lconv

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


@pytest.fixture
def data_dir(tiny_data):
    """The bundled corpus as the suite prepared it once (tests/conftest.py; the notebooks' own first run prepares
    it too), shared by the notebooks on every xdist worker."""
    return str(tiny_data.data_dir)


@pytest.mark.slow  # each notebook trains a tiny model in a kernel process: run by CI, skipped by the quick command
@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs(name, data_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("LCONV_NOTEBOOK_FAST", "1")
    monkeypatch.setenv("LCONV_NOTEBOOK_DATA_DIR", data_dir)
    monkeypatch.setenv("LCONV_NOTEBOOK_RUNS", str(tmp_path / "runs"))
    # The kernel imports the lconv this process does (ROOT is the checkout, or in CI's package check a folder
    # holding only tests/ and notebooks/), on one CPU device: conftest's 8 virtual devices are for sharding tests.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("XLA_FLAGS", helpers.xla_flags())
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    notebook = nbformat.read(NOTEBOOK_DIR / name, as_version=4)
    client = NotebookClient(notebook, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(NOTEBOOK_DIR)}})
    notebook.cells.append(nbformat.v4.new_code_cell("import lconv; print(lconv.__file__)"))
    client.execute()  # raises CellExecutionError naming the cell and its traceback
    assert notebook.cells[-1].outputs[0]["text"].strip() == lconv.__file__  # the lconv under test, not another

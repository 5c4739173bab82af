"""Executes every notebook in notebooks/ on CPU with nbclient: a cell that raises (the notebooks assert their key
numbers) fails the test. Needs the `notebooks` extra (nbclient, nbformat, ipykernel, matplotlib); the imports are
inside the tests so that collecting this file works without it (e.g. `make gpu` on the GPU machine).

The notebooks are committed without outputs. `NOTEBOOK_OUTPUT_DIR=dir` writes the executed copies, with their
plots, into dir (also when a cell fails)."""

import os
import pathlib
import time

import pytest

NOTEBOOK_DIR = pathlib.Path(__file__).resolve().parent.parent / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
CELL_TIMEOUT_S = 300  # per cell; each notebook takes well under a minute on an idle 2-core CPU


def test_all_notebooks_found():
    assert len(NOTEBOOKS) >= 5, f"expected the five notebooks in {NOTEBOOK_DIR}, found {NOTEBOOKS}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_committed_without_outputs(path):
    import nbformat

    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    dirty = [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and (c.outputs or c.execution_count)]
    assert not dirty, f"{path.name}: clear the outputs of cells {dirty} before committing"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_executes(path, tmp_path, monkeypatch):
    import nbformat
    from nbclient import NotebookClient

    # The kernel inherits this environment (conftest: JAX_PLATFORMS=cpu); keep its runtime files and IPython
    # profile out of the user's home so parallel workers do not share them.
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path / "runtime"))
    monkeypatch.setenv("IPYTHONDIR", str(tmp_path / "ipython"))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    nb = nbformat.read(path, as_version=4)
    # kernel_name "python3" is ipykernel's own spec; jupyter_client runs it with this interpreter (sys.executable).
    client = NotebookClient(
        nb,
        kernel_name="python3",
        timeout=CELL_TIMEOUT_S,
        startup_timeout=120,
        extra_arguments=["--InteractiveShell.colors=nocolor"],  # plain tracebacks in failures
        resources={"metadata": {"path": str(NOTEBOOK_DIR)}},
    )  # run from notebooks/
    t0 = time.perf_counter()
    try:
        client.execute()  # raises CellExecutionError, with the cell's traceback, if a cell raises
    finally:
        if os.environ.get("NOTEBOOK_OUTPUT_DIR"):
            out = pathlib.Path(os.environ["NOTEBOOK_OUTPUT_DIR"])
            out.mkdir(parents=True, exist_ok=True)
            nbformat.write(nb, out / path.name)
    print(f"{path.name}: {time.perf_counter() - t0:.1f} s")

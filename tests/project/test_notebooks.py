"""The teaching notebooks run top to bottom, headless, on this machine (small sizes on a CPU, the lab's sizes
on a GPU), and the committed files carry the outputs of a clean run on a Hopper GPU, made by the code they hold."""
import hashlib
import json
import pathlib
import tempfile

import pytest

nbformat = pytest.importorskip("nbformat", reason="the notebook tests need the [test] extra (nbformat, nbclient)")
NotebookClient = pytest.importorskip("nbclient", reason="the notebook tests need the [test] extra").NotebookClient

NOTEBOOKS = sorted((pathlib.Path(__file__).resolve().parents[2] / "notebooks").glob("*.ipynb"))
NAMES = ["lab_3_2_3_fp8_training_inference.ipynb", "fp8_scaling_strategies.ipynb"]


def test_both_teaching_notebooks_are_there():
    assert [p.name for p in NOTEBOOKS if p.name in NAMES] == sorted(NAMES)


_EXECUTED = {}  # path -> the executed notebook, or the error its run raised: one run per notebook and session


def executed_notebook(path, progress=lambda text: None):
    """The notebook at `path` run top to bottom on this machine, once per test session: this file's test and
    test_notebook_claims.py read the same run (a failed run raises the same error in both)."""
    if path not in _EXECUTED:
        nb = nbformat.read(path, as_version=4)
        cells = sum(c.cell_type == "code" for c in nb.cells)
        done = []

        def executed(cell, cell_index, **_):  # a line every few cells: these tests take minutes on a CPU
            done.append(cell_index)
            if len(done) % 5 == 0 or len(done) == cells:
                progress(f"{len(done)}/{cells} code cells ran")

        with tempfile.TemporaryDirectory() as work:
            client = NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": work}},
                                    on_cell_executed=executed)
            try:
                client.execute()  # raises CellExecutionError, with the cell and its traceback, on any error
                _EXECUTED[path] = nb
            except Exception as e:  # kept, and raised again for the other test that reads this run
                _EXECUTED[path] = e
    if isinstance(_EXECUTED[path], Exception):
        raise _EXECUTED[path]
    return _EXECUTED[path]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_headless_without_errors(path, progress):
    nb = executed_notebook(path, progress)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(c.execution_count is not None for c in code), "every code cell ran"
    errors = [o for c in code for o in c.outputs if o.output_type == "error"]
    assert not errors, errors[0]
    images = sum("image/png" in o.get("data", {}) for c in code for o in c.outputs)
    assert images >= 3, f"{path.name}: the plots were drawn ({images} images)"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_committed_notebook_holds_a_clean_run_under_2_mb(path):
    assert path.stat().st_size < 2 * 1024 * 1024, f"{path.name} is {path.stat().st_size} bytes"
    nb = json.loads(path.read_text())
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    counts = [c["execution_count"] for c in code]
    assert counts == list(range(1, len(code) + 1)), f"{path.name}: committed from one clean top-to-bottom run"
    assert not [o for c in code for o in c["outputs"] if o["output_type"] == "error"], "no error outputs"


def _stamp(cell):
    return cell.get("metadata", {}).get("fp8ext", {}).get("source_sha256")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_committed_outputs_come_from_the_code_beside_them(path):
    # benchmarks/run_notebooks.py stamps every code cell it executed with the SHA-256 of the source it ran
    nb = json.loads(path.read_text())
    stale = [i for i, c in enumerate(nb["cells"]) if c["cell_type"] == "code"
             and _stamp(c) != hashlib.sha256("".join(c["source"]).encode("utf-8")).hexdigest()]
    assert not stale, (f"{path.name}: code cells {stale} differ from the code that produced their outputs (or carry "
                       "no stamp). Re-run the notebook on a GPU machine with `bash benchmarks/gpu_check.sh notebooks` "
                       "and commit the executed copy it writes.")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_committed_run_was_made_on_a_hopper_gpu(path):
    run = json.loads(path.read_text())["metadata"].get("fp8ext", {})
    assert run.get("fp8ext_cuda") and any(g in run.get("device", "") for g in ("H100", "H200")), (
        f"{path.name}: the committed outputs should come from an H100 or H200 with fp8ext's CUDA kernels; "
        f"the recorded run is {run or 'missing'}")

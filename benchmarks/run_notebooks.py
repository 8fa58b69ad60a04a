"""Execute the teaching notebooks top to bottom and stamp each executed code cell with the hash of its source.

    python benchmarks/run_notebooks.py OUT_DIR [NOTEBOOK ...]    # default: every notebooks/*.ipynb

Each executed copy is written to OUT_DIR under its own name, with
- metadata.fp8ext.source_sha256 on every code cell: the SHA-256 of the source that produced its outputs, and
- metadata.fp8ext on the notebook: where and when it ran (GPU name, torch and fp8ext builds, UTC date).
tests/project/test_notebooks.py checks the stamps of the committed notebooks: an edited code cell whose outputs were
not regenerated fails there. benchmarks/gpu_check.sh runs this script in its `notebooks` step; commit the
executed copies it brings back. Needs nbformat, nbclient and ipykernel (the [test] extra).
"""
from __future__ import annotations

import datetime
import hashlib
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]


def source_sha256(source: str) -> str:
    """The stamp of one code cell: SHA-256 of its source text (tests/project/test_notebooks.py computes the same)."""
    return hashlib.sha256(source.encode("utf-8")).hexdigest()


def run_info() -> dict:
    import torch

    import fp8ext
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "none (CPU run)"
    return {"device": gpu, "torch": torch.__version__, "fp8ext_cuda": bool(fp8ext.cuda_available()),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")}


def execute(path: pathlib.Path, out_dir: pathlib.Path, info: dict) -> bool:
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    nb = nbformat.read(path, as_version=4)
    start = time.time()
    ok = True
    try:
        NotebookClient(nb, timeout=600, kernel_name="python3",
                       resources={"metadata": {"path": str(path.parent)}}).execute()
    except CellExecutionError as e:
        print(f"{path.name}: FAILED\n{str(e)[:2000]}")
        ok = False
    for cell in nb.cells:
        if cell.cell_type == "code" and cell.get("execution_count") is not None:
            cell.metadata["fp8ext"] = {"source_sha256": source_sha256(cell.source)}
    nb.metadata["fp8ext"] = dict(info, seconds=round(time.time() - start))
    nbformat.write(nb, out_dir / path.name)
    if ok:
        print(f"{path.name}: ran in {time.time() - start:.0f} s on {info['device']}")
    return ok


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__)
        return 2
    out_dir = pathlib.Path(argv[0])
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [pathlib.Path(p) for p in argv[1:]] or sorted((ROOT / "notebooks").glob("*.ipynb"))
    info = run_info()
    results = [execute(p.resolve(), out_dir, info) for p in paths]
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

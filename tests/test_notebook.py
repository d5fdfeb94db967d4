"""notebooks/finetune.ipynb, executed headless top to bottom with nbclient in
a fresh kernel of this interpreter: no cell may raise, the loss curve must be drawn (an image/png
output), the loss must clearly fall, and the exported Hugging Face model must answer as the
trained weights do. The notebook writes only under the kernel's working directory (tmp_path)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "finetune.ipynb"
KERNEL_NAME = "zerotrain-test-python"
# The notebook's last cell prints this dict as JSON; the test reads it back from that output.
SUMMARY_KEYS = {"seconds_total", "loss_before", "loss_after", "sample_before", "sample_after",
                "sample_transformers", "correct_before", "correct_after"}

pytestmark = [pytest.mark.notebook, pytest.mark.launches]  # a kernel is a process of its own


@pytest.fixture
def this_python_kernel(tmp_path, monkeypatch) -> str:
    """A kernelspec running THIS interpreter. The name `python3` could resolve to a user-level
    kernelspec (~/.local/share/jupyter comes before the venv's share/jupyter) pointing at another
    Python without zerotrain; JUPYTER_PATH is searched before both."""
    spec_dir = tmp_path / "jupyter" / "kernels" / KERNEL_NAME
    spec_dir.mkdir(parents=True)
    (spec_dir / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "zerotrain test kernel", "language": "python"}))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the kernel inherits this process's environment
    return KERNEL_NAME


def outputs(cell) -> list[dict]:
    return cell.get("outputs", []) if cell.cell_type == "code" else []


def test_finetune_notebook_runs_and_learns(tmp_path, this_python_kernel):
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(NOTEBOOK, as_version=4)
    work = tmp_path / "work"
    work.mkdir()
    # raises CellExecutionError (with the cell's traceback) on the first cell that fails
    NotebookClient(nb, kernel_name=this_python_kernel, timeout=180,
                   resources={"metadata": {"path": str(work)}}).execute()

    images = [o for c in nb.cells for o in outputs(c) if "image/png" in o.get("data", {})]
    assert images, "no cell drew a plot (no image/png output): the loss curve is missing"

    last = "".join(o.get("text", "") for o in outputs(nb.cells[-1]) if o.get("output_type") == "stream")
    summary = json.loads(last)
    assert SUMMARY_KEYS <= set(summary), summary
    print(json.dumps(summary))  # the run's numbers (pytest -s); docs/notebook.md shows the API

    assert summary["loss_after"] < summary["loss_before"] / 4, summary  # 5.8 -> ~0.1 when it works
    assert summary["correct_after"] >= summary["correct_before"] + 50, summary
    # the export is the trained model: transformers' greedy answer equals the checkpoint's
    assert summary["sample_transformers"] == summary["sample_after"], summary
    assert (work / "runs" / "notebook-finetune" / "hf" / "model.safetensors").is_file()

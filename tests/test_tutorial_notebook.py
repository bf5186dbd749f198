"""docs/tutorial.ipynb runs top to bottom on a CPU in a Jupyter kernel, as a reader runs it:
it shows its figures, prints what it promises, and leaves no file behind.

nbclient executes the notebook in an ipykernel from the repository root; the first cell
that raises fails the test and names itself. The notebook is committed without outputs.
"""

import json
import sys

import pytest
from background import Command
from conftest import REPO
from launch import RUN_DIR

# The test extra installs them; a GPU machine collecting `-m cuda tests` may lack them.
nbformat = pytest.importorskip("nbformat")
pytest.importorskip("nbclient")

NOTEBOOK = REPO / "docs" / "tutorial.ipynb"
# Executes the notebook in a kernel started from the repository root; prints it, outputs and all.
EXECUTE = """import os, sys, nbclient, nbformat
os.mkdir(os.environ["TMPDIR"])
notebook = nbformat.read(sys.argv[1], as_version=4)
nbclient.NotebookClient(notebook, timeout=300, kernel_name="python3",
                        resources={"metadata": {"path": sys.argv[2]}}).execute()
sys.stdout.write(nbformat.writes(notebook))
"""
# The kernel inherits this environment: the notebook's temporary folder lands in an empty
# TMPDIR of the run's own (torch's compile cache elsewhere: it is torch's, meant to stay), and
# matplotlib draws inline (as in Jupyter), not to a file.
RUN = Command((sys.executable, "-c", EXECUTE, str(NOTEBOOK), str(REPO)),
              (("TMPDIR", f"{RUN_DIR}/tmp"), ("TORCHINDUCTOR_CACHE_DIR", f"{RUN_DIR}/inductor"),
               ("OMP_NUM_THREADS", "1"), ("MPLBACKEND", None)), timeout=900, long=True)
PLANNED_COMMANDS = [RUN]  # run from the session's start (conftest.py's planned_command)


def test_notebook_is_clean_json():
    notebook = json.loads(NOTEBOOK.read_text())
    code = [c for c in notebook["cells"] if c["cell_type"] == "code"]
    assert notebook["nbformat"] == 4 and code
    # Committed without outputs: reruns then leave no diff, and no stale numbers are shown.
    assert all(c["outputs"] == [] and c["execution_count"] is None for c in code)
    nbformat.validate(nbformat.reads(NOTEBOOK.read_text(), as_version=4))


@pytest.mark.slow
def test_notebook_runs_shows_its_figures_and_cleans_up(planned_command):
    proc, folder = planned_command(RUN)
    assert proc.returncode == 0, proc.stderr[-3000:]  # nbclient names the first cell that raised
    notebook = nbformat.reads(proc.stdout, as_version=4)

    outputs = [o for c in notebook.cells if c.cell_type == "code" for o in c.outputs]
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "loss check passed" in text
    assert "| `loop` | 1 / 1 |" in text  # the results page made from its own runs
    figures = [o for o in outputs if o.output_type == "display_data" and "image/png" in o.data]
    assert len(figures) >= 2, [o.output_type for o in outputs]  # the loss curves and the phase profile
    assert list((folder / "tmp").iterdir()) == []  # its runs and results page removed by its last cell

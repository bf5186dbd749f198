"""docs/tutorial.ipynb runs top to bottom on a CPU, as a reader would run it.

No Jupyter needed: the notebook is JSON, and its code cells are plain Python (no shell or
magic lines, which this test would reject as syntax errors). They run in order in one fresh
interpreter, in one shared namespace, from the repository root; the first exception fails
the test and names its cell.
"""

import json
import os
import subprocess
import sys

import pytest
from conftest import REPO

NOTEBOOK = REPO / "docs" / "tutorial.ipynb"

RUNNER = """
import json, sys, traceback
cells = [c for c in json.load(open(sys.argv[1]))["cells"] if c["cell_type"] == "code"]
namespace = {"__name__": "__main__"}
for index, cell in enumerate(cells):
    source = "".join(cell["source"])
    print(f"--- code cell {index}", flush=True)
    try:
        exec(compile(source, f"<code cell {index}>", "exec"), namespace)
    except BaseException:
        traceback.print_exc()
        print(f"NOTEBOOK FAILED in code cell {index}:\\n{source}", file=sys.stderr)
        sys.exit(1)
print(f"--- all {len(cells)} code cells ran", flush=True)
"""


def test_notebook_is_clean_json():
    notebook = json.loads(NOTEBOOK.read_text())
    code = [c for c in notebook["cells"] if c["cell_type"] == "code"]
    assert notebook["nbformat"] == 4 and code
    # Committed without outputs: reruns then leave no diff, and no stale numbers are shown.
    assert all(c["outputs"] == [] and c["execution_count"] is None for c in code)


@pytest.mark.slow
def test_notebook_runs_top_to_bottom(tmp_path):
    # TMPDIR: the notebook's runs land in this test's folder, which pytest cleans up.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", RUNNER, str(NOTEBOOK)], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert proc.stdout.splitlines()[-1].startswith("--- all")
    # What the notebook promises to show.
    assert "loss check passed" in proc.stdout
    assert "| `loop` | 1 / 1 |" in proc.stdout  # the results page made from its own runs

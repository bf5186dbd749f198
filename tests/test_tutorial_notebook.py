"""docs/tutorial.ipynb runs top to bottom on a CPU in a Jupyter kernel, as a reader runs it:
it shows its figures, prints what it promises, and leaves no file behind.

nbclient executes the notebook in an ipykernel from the repository root; the first cell
that raises fails the test and names itself. The notebook is committed without outputs.

What docs/tutorial.md and the notebook's text show of the code is the code's: each line of
their Python excerpts, and each passage they quote from a docstring, is in te_mixtral/ as
written; each command of the tutorial loads as a valid config; and the loss check output the
tutorial prints is the one the notebook's `hf` run prints.
"""

import json
import re
import shlex
import sys

import pytest
import torch
from background import Command
from conftest import REPO
from launch import RUN_DIR

from te_mixtral.cli import parse_args
from te_mixtral.config import load_run_config

# The test extra installs them; a GPU machine collecting `-m cuda tests` may lack them.
nbformat = pytest.importorskip("nbformat")
pytest.importorskip("nbclient")

NOTEBOOK = REPO / "docs" / "tutorial.ipynb"
TUTORIAL = REPO / "docs" / "tutorial.md"
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
    # The loss check output tutorial.md prints (section 4): the notebook's `hf` run prints it.
    [quoted] = [block for _, block in re.findall(r"```(\w*)\n(.*?)```", TUTORIAL.read_text(), re.DOTALL)
                if "loss check passed" in block]
    assert all(line == "..." or line in text.splitlines() for line in quoted.splitlines()), quoted
    figures = [o for o in outputs if o.output_type == "display_data" and "image/png" in o.data]
    assert len(figures) >= 2, [o.output_type for o in outputs]  # the loss curves and the phase profile
    assert list((folder / "tmp").iterdir()) == []  # its runs and results page removed by its last cell


def tutorial_texts() -> dict[str, str]:
    """tutorial.md's markdown and the notebook's markdown cells, by where they are."""
    cells = json.loads(NOTEBOOK.read_text())["cells"]
    return {"docs/tutorial.md": TUTORIAL.read_text(),
            **{f"notebook cell {i}": "".join(c["source"]) for i, c in enumerate(cells) if c["cell_type"] == "markdown"}}


def test_what_the_tutorial_shows_of_the_code_is_the_codes():
    # Before, its excerpts showed MoEBlock.forward, the loop tier, the tier interface and the
    # grouped_linear tier as they were before adapters and chunked dispatch, and it quoted a
    # dispatch docstring that had been rewritten.
    files = sorted((REPO / "te_mixtral").rglob("*.py"))
    lines = [line.strip() for path in files for line in path.read_text().splitlines()]
    prose_of_code = " ".join(" ".join(path.read_text().split()) for path in files)
    stale, checked = [], 0
    for where, text in tutorial_texts().items():
        for block in re.findall(r"```python\n(.*?)```", text, re.DOTALL):
            for line in block.splitlines():
                # Less the excerpt's own comments and an abridged body (`def f(): ...`).
                code = re.sub(r"\s*\.\.\.$", "", re.sub(r"\s+#.*$", "", line).strip())
                checked += bool(code)
                if code and not any(code in known for known in lines):
                    stale.append(f"{where}: {line.strip()}")
        prose = " ".join(re.sub(r"```.*?```", "", text, flags=re.DOTALL).split())
        for quote in re.findall(r'"([^"]{40,}?)"(?=[\s.,;:)])', prose):  # a docstring quoted, [...] its cuts
            for part in quote.split("[...]"):
                checked += 1
                if " ".join(part.split()) not in prose_of_code:
                    stale.append(f"{where}: \"{part.strip()}\"")
    assert checked > 60 and not stale, "\n".join(stale)


TUTORIAL_COMMANDS = [" ".join(line.split()) for block in re.findall(r"```bash\n(.*?)```", TUTORIAL.read_text(),
                                                                     re.DOTALL)
                     for line in block.replace("\\\n", " ").splitlines() if "run_finetune_ep.py" in line]


@pytest.mark.parametrize("command", TUTORIAL_COMMANDS)
def test_each_tutorial_command_is_a_valid_config(command, monkeypatch):
    # As on the GPU machine the tutorial has in mind: CUDA resolves precision auto to bf16.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    words = shlex.split(command.split("#")[0])
    args, overrides = parse_args(words[words.index("run_finetune_ep.py") + 1:])
    ranks = next((int(word.split("=")[1]) for word in words if word.startswith("--nproc_per_node=")), 1)
    load_run_config(str(REPO / args.config), overrides, world_size=ranks)

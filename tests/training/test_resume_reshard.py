"""Resume on another layout (CPU, gloo): a run stopped after N of 2N steps resumes on another
number of ranks, EP size or sharding, and trains as the run that was never stopped at the
layout it resumed on. Not bit for bit: the first N steps ran on the other layout, whose sums
add in another order, so losses, evaluations, weights and optimizer state agree to fp32
rounding. The data position carries over because the global batches do not depend on the
layout (te_mixtral/data/packing.py)."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from launch import run_app, run_cli, train_and_save
from test_resume import COMMON, N, whole_run
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

# Each layout: (ranks, what its arguments add to the EP=2 run of test_resume.py).
LAYOUTS = {
    "ep2": (2, []),
    "one": (1, ["--ep-size", "1"]),
    "fsdp": (2, ["--ep-size", "1", "--sharding", "fsdp"]),  # dense and experts sharded over both ranks
}


def whole(layout: str) -> list[str]:
    return [*whole_run("fp32-adamw"), *LAYOUTS[layout][1]]


# The runs never stopped train with the other modules' runs (conftest.py's launch_planned); the
# EP=2 one is test_resume.py's own, launched once for both modules.
PLANNED_RUNS = {1: [whole("one")], 2: [whole("ep2"), whole("fsdp")]}


def global_state(checkpoint: Path, out: Path) -> dict[str, torch.Tensor]:
    """A checkpoint's weights and optimizer state as whole tensors, by name."""
    dcp_to_torch_save(checkpoint, out)
    return torch.load(out, weights_only=True)


@pytest.mark.slow
@pytest.mark.parametrize("saved, resumed", [("ep2", "one"), ("one", "ep2"), ("ep2", "fsdp"), ("fsdp", "one")])
def test_resume_on_another_layout_equals_one_run_there(tmp_path, saved, resumed, launch_planned):
    for layout in {saved, resumed}:
        launch_planned(LAYOUTS[layout][0])
    runs = {layout: tmp_path / layout for layout in {saved, resumed}}
    for layout, folder in runs.items():
        train_and_save(folder, whole(layout), nproc=LAYOUTS[layout][0])

    # The state a run killed right after its step-N checkpoint leaves behind, resumed elsewhere.
    folder = tmp_path / "resumed"
    shutil.copytree(runs[saved] / "ckpt", folder / "ckpt")
    shutil.rmtree(folder / "ckpt" / f"step-{2 * N:06d}")
    (folder / "ckpt" / "latest").write_text(f"step-{N:06d}\n")
    args = [*COMMON, *LAYOUTS[resumed][1], "--checkpoint-dir", str(folder / "ckpt"), "--output-dir", str(folder),
            "--resume"]
    nproc = LAYOUTS[resumed][0]
    proc = run_app(args, nproc=nproc) if nproc > 1 else run_cli(args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"resuming from {folder / 'ckpt' / f'step-{N:06d}'} (step {N} of {2 * N})" in proc.stdout

    want = json.loads((runs[resumed] / "results.json").read_text())
    got = json.loads((folder / "results.json").read_text())
    assert got["losses"][:N] == json.loads((runs[saved] / "results.json").read_text())["losses"][:N]
    assert got["losses"] == pytest.approx(want["losses"], rel=1e-6)
    assert [e["loss"] for e in got["evals"]] == pytest.approx([e["loss"] for e in want["evals"]], rel=1e-6)
    final = f"step-{2 * N:06d}"
    got_state = global_state(folder / "ckpt" / final, tmp_path / "got.pt")
    want_state = global_state(runs[resumed] / "ckpt" / final, tmp_path / "want.pt")
    assert got_state.keys() == want_state.keys()
    for name, value in want_state.items():
        # atol: 1e-4 of the tensor's largest magnitude. Adam divides by the root of the second
        # moment, so where a gradient is tiny its rounding moves the weight by up to ~1/300 of
        # a step (1e-6 at lr 3e-4, measured); a misplaced slice moves it by the weights' size.
        torch.testing.assert_close(got_state[name], value, rtol=1e-5, atol=1e-4 * value.abs().max().item(), msg=name)

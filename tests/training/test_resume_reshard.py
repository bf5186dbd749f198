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
from launch import run_cli, train_and_save, train_and_save_many
from test_resume import COMMON, N, whole_run

ADAM_STEP = 3e-3  # the tiny config's lr: about how far one AdamW step moves a weight
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


CASES = [("ep2", "one"), ("one", "ep2"), ("ep2", "fsdp"), ("fsdp", "one")]  # (saved on, resumed on)


@pytest.mark.slow
def test_resume_on_another_layout_equals_one_run_there(tmp_path, launch_planned):
    whole_runs = {}
    for layout in LAYOUTS:
        launch_planned(LAYOUTS[layout][0])
        whole_runs[layout] = tmp_path / layout
        train_and_save(whole_runs[layout], whole(layout), nproc=LAYOUTS[layout][0])

    # The state a run killed right after its step-N checkpoint leaves behind, resumed elsewhere:
    # on one rank in this process, on two in one launch (tests/workers/train_and_save.py).
    resumed = {}
    for saved, layout in CASES:
        folder = resumed[saved, layout] = tmp_path / f"{saved}-to-{layout}"
        shutil.copytree(whole_runs[saved] / "ckpt", folder / "ckpt")
        shutil.rmtree(folder / "ckpt" / f"step-{2 * N:06d}")
        (folder / "ckpt" / "latest").write_text(f"step-{N:06d}\n")
    args = {case: [*COMMON, *LAYOUTS[case[1]][1], "--checkpoint-dir", str(folder / "ckpt"), "--resume"]
            for case, folder in resumed.items()}
    train_and_save_many([(resumed[case], args[case]) for case in CASES if LAYOUTS[case[1]][0] == 2], nproc=2)
    for case in CASES:
        if LAYOUTS[case[1]][0] == 1:
            proc = run_cli([*args[case], "--output-dir", str(resumed[case])])
            assert proc.returncode == 0, proc.stderr[-3000:]
            assert f"(step {N} of {2 * N}), written by 2 rank(s), read by 1" in proc.stdout

    for (saved, layout), folder in resumed.items():
        want = json.loads((whole_runs[layout] / "results.json").read_text())
        got = json.loads((folder / "results.json").read_text())
        where = f"saved on {saved}, resumed on {layout}"
        assert got["losses"][:N] == json.loads((whole_runs[saved] / "results.json").read_text())["losses"][:N]
        assert got["losses"] == pytest.approx(want["losses"], rel=1e-6), where
        assert [e["loss"] for e in got["evals"]] == pytest.approx([e["loss"] for e in want["evals"]], rel=1e-6), where
        final = f"step-{2 * N:06d}"
        got_state = global_state(folder / "ckpt" / final, tmp_path / "got.pt")
        want_state = global_state(whole_runs[layout] / "ckpt" / final, tmp_path / "want.pt")
        assert got_state.keys() == want_state.keys()
        for name, value in want_state.items():
            # atol: a hundredth of one Adam step (the tiny config's lr, 3e-3). Adam divides by the
            # root of the second moment, so where a gradient is tiny (a rare token's embedding row)
            # its rounding moves the weight by a fraction of a step (2e-5 measured, 1/150); a
            # misplaced slice moves weights by their own size (~0.02).
            torch.testing.assert_close(got_state[name], value, rtol=1e-5, atol=ADAM_STEP / 100,
                                       msg=lambda m, where=where, name=name: f"{where}: {name}: {m}")

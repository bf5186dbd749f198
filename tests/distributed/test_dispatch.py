"""Token dispatch over two gloo ranks: empty experts and a rank that receives nothing, step by
step and overlapped in chunks, a padded exchange too short for its rows, and the order the
overlapped path runs its exchanges in."""

import dataclasses

import torch
from conftest import REPO
from launch import WORKER, run_worker

from te_mixtral.config import load_run_config
from te_mixtral.distributed.layout import Layout
from te_mixtral.training.loop import build_model

SCRIPT = "tests/workers/dispatch_edge_cases.py"
PLANNED_RUNS = {2: [[WORKER, SCRIPT]]}  # run in the session's two-rank launch (conftest.py's launch_planned)


def test_dispatch_edge_cases(tmp_path, launch_planned):
    launch_planned(2)
    proc = run_worker(tmp_path, SCRIPT, [], nproc=2, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("ok:") == 5


def test_ep_chunks_reaches_every_layers_dispatcher():
    """The overlap setting gets to the dispatcher of every MoE layer the loop builds (the
    gradient tests above would pass as well if it were dropped on the way)."""
    # Set past the config's check, which refuses ep_chunks without ep_size > 1: one process builds the layers.
    cfg = dataclasses.replace(load_run_config(REPO / "configs" / "tiny.yaml"), ep_chunks=3)
    model, _ = build_model(cfg, Layout(0, 1, 1, None, None), torch.device("cpu"))
    assert [layer.mlp.dispatcher.chunks for layer in model.model.layers] == [3] * cfg.model.num_hidden_layers

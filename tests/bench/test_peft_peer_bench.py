"""benchmarks/peft_peer.py, the parts that run without a GPU: refusing bad arguments in one
line before importing anything heavy, and refusing a machine without CUDA; the PEFT model it
builds trains exactly our adapters (a cross-check of our adapter count against PEFT's); its
packed rows keep transformers' attention inside each document; one step trains on CPU.
Timing it needs CUDA; that part runs on GPU machines only."""

import argparse
import json
import math
import re

import pytest
import torch
from bench.refusals import refusals
from conftest import REPO
from launch import WORKER, run_worker

from benchmarks.peer_workload import random_rows
from benchmarks.peft_peer import (
    build_peft_model,
    packed_row,
    run,
    train_step,
    workload_config,
)
from te_mixtral.config import load_config
from te_mixtral.measure.model_state import count_adapters

TINY = str(REPO / "configs/tiny.yaml")


def _tiny(**overrides: str):
    return load_config(TINY, {"lora.rank": "4", "lora.alpha": "8", **overrides})


def test_bad_arguments_are_refused_in_one_line_before_heavy_imports():
    cases = [
        (["--steps", "5", "--warmup", "5"], "--warmup 5 must leave some of the --steps 5 to time"),
        (["--doc-len", "0"], "--doc-len must be positive, got 0"),
        (["--layers", "0"], "--layers must be positive, got 0"),
        (["--rank", "0"], "--rank must be positive (this peer trains LoRA adapters), got 0"),
        (["--alpha", "-1"], "--alpha must be positive, got -1.0"),
        (["--config", "configs/missing.yaml"], "cannot read config configs/missing.yaml"),
    ]
    answers, imported = refusals("peft_peer", [args for args, _ in cases], ('torch', 'transformers', 'peft'))
    for (code, stderr), (args, message) in zip(answers, cases):
        assert code == 2 and stderr.startswith(f"peft_peer: error: {message}"), (args, stderr)
        assert stderr.count("\n") == 1, (args, stderr)
    assert imported == []


def test_rank_and_alpha_are_the_configs_unless_given():
    def workload(config, layers=None, rank=None, alpha=None):
        cfg = workload_config(argparse.Namespace(config=str(REPO / config), layers=layers, rank=rank, alpha=alpha))
        return cfg.lora.rank, cfg.lora.alpha, cfg.model.num_hidden_layers

    assert workload("configs/mixtral-8x7b-8layer.yaml") == (16, 16.0, 8)  # full fine-tuning's config: rank 16
    assert workload("configs/mixtral-8x7b-lora.yaml") == (16, 32.0, 32)
    assert workload("configs/mixtral-8x7b-lora.yaml", layers=2, rank=8, alpha=4.0) == (8, 4.0, 2)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_a_machine_without_cuda_is_refused_in_one_line(capsys):
    from benchmarks.peft_peer import main

    assert main(["--config", TINY]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.splitlines()[-1] == ("peft_peer: error: the transformers + PEFT peer needs a CUDA GPU, "
                                                  "and none is visible")
    assert not any(line.startswith("peft_peer") for line in err.splitlines()[:-1])


@pytest.mark.parametrize("targets", [None, "k_proj,down_proj"])
def test_peft_trains_exactly_our_adapters(targets):
    cfg = _tiny(**({} if targets is None else {"lora.targets": targets}))
    model = build_peft_model(cfg, "cpu", torch.float32)
    trainable = {name: p.numel() for name, p in model.named_parameters() if p.requires_grad}
    adapter = re.compile(r"base_model\.model\.model\.layers\.\d+\.(self_attn\.(q|k|v|o)_proj|mlp\.experts"
                         r"(\.base_layer)*)\.lora_[AB]\.default\.weight")
    assert all(adapter.fullmatch(name) for name in trainable), sorted(trainable)
    targeted = len(cfg.lora.target_list())
    assert len(trainable) == cfg.model.num_hidden_layers * targeted * 2  # an A and a B per target and layer
    # PEFT's own count of what it trains is ours, which the memory estimate and FLOPs build on.
    assert sum(trainable.values()) == count_adapters(cfg.model, 1, cfg.lora)
    assert model.base_model.model.config._experts_implementation == "grouped_mm"


def test_packed_rows_keep_attention_inside_each_document():
    cfg = _tiny()
    torch.manual_seed(0)
    model = build_peft_model(cfg, "cpu", torch.float32, gradient_checkpointing=False).eval()
    (row,) = random_rows(cfg, 1, 50, torch.Generator().manual_seed(0), "cpu")
    batch = packed_row(row)
    assert "attention_mask" not in batch
    assert batch["position_ids"][0, 48:53].tolist() == [48, 49, 0, 1, 2]
    with torch.no_grad():
        packed = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
        alone = model(input_ids=batch["input_ids"][:, 50:100]).logits
    # The second document alone gives what it gives inside the packed row: it saw nothing before it.
    torch.testing.assert_close(packed[:, 50:100], alone, rtol=1e-5, atol=1e-5)


def test_one_step_on_cpu_trains_the_adapters_only():
    cfg = _tiny()
    torch.manual_seed(0)
    model = build_peft_model(cfg, "cpu", torch.float32)
    named = dict(model.named_parameters())
    before = {name: p.detach().clone() for name, p in named.items()}
    optimizer = torch.optim.AdamW([p for p in named.values() if p.requires_grad], lr=cfg.train.lr)
    (row,) = random_rows(cfg, 1, 50, torch.Generator().manual_seed(0), "cpu")
    loss = train_step(model, optimizer, packed_row(row))
    assert torch.isfinite(loss) and loss.ndim == 0
    changed = {name for name, p in named.items() if not torch.equal(p, before[name])}
    assert changed and changed <= {name for name, p in named.items() if p.requires_grad}
    assert all(p.grad is None for p in named.values())  # zero_grad sets them to None


@pytest.mark.parametrize("doc_len", [None, 40])
def test_the_whole_run_measures_on_cpu(doc_len):
    """What the GPU run does, on a CPU in bf16: our rows or random ones, figures and --json's fields."""
    args = argparse.Namespace(config=TINY, layers=1, rank=None, alpha=None, steps=2, warmup=1, doc_len=doc_len,
                              gradient_checkpointing=True)
    cfg = workload_config(args)
    result = run(args, cfg, torch.device("cpu"))
    assert len(result["loss"]) == len(result["step_ms"]) == 2 and all(map(math.isfinite, result["loss"]))
    w = result["workload"]
    assert w["trainable_parameters"] == count_adapters(cfg.model, 1, cfg.lora)
    assert (w["attention"], w["experts"], w["lora"]["rank"]) == ("sdpa", "grouped_mm", 16)
    assert w["rows"] == ("ours" if doc_len is None else "random, 40-token documents")
    assert result["summary"]["tokens_per_s"] > 0 and result["flops_per_step"][0] > 0
    json.dumps(result)  # what --json writes


DDP_SCRIPT = "tests/workers/peft_peer_ddp.py"
PLANNED_RUNS = {2: [[WORKER, DDP_SCRIPT, TINY]]}  # run in the session's two-rank launch (conftest.py's launch_planned)


@pytest.mark.slow
def test_two_processes_train_as_distributed_data_parallel(tmp_path, launch_planned):
    """Under torchrun (two CPU processes, gloo): each rank its own row, the adapters kept
    equal by DistributedDataParallel (tests/workers/peft_peer_ddp.py checks)."""
    launch_planned(2)
    proc = run_worker(tmp_path, DDP_SCRIPT, [TINY], nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count(": ok") == 2

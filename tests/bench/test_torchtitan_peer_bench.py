"""benchmarks/torchtitan_peer.py (and peer_workload.py's rows per rank and figures per GPU),
the parts that run without a GPU: refusing bad arguments in one line before importing
anything heavy, and refusing a machine without CUDA; where torchtitan 0.2.2 imports, the model
it builds has our Mixtral's parameters, keeps attention inside each packed document, its MoE
trains on a CPU, and under torchrun (two CPU processes, gloo) its trainer's parallelisation
builds it at EP 1 and EP 2 with the same loss. torchtitan's MoE is written for CUDA: three of
its steps are swapped for the same computation on a CPU (tests/bench/titan_on_cpu.py). A whole
training step needs CUDA: torchtitan's attention backends have no CPU backward, which
`test_a_training_step_on_cpu_or_why_not` checks rather than assumes."""

import argparse
import contextlib
import os

import pytest
import torch
from background import Command
from bench.refusals import refusals
from conftest import REPO
from launch import app_command
from workers.token_cache import tokenize_once

from benchmarks.peer_workload import our_rows, random_rows, summarize_steps, workload_config
from benchmarks.torchtitan_peer import titan_inputs
from te_mixtral.measure.model_state import count_parameters
from te_mixtral.measure.report import package_version

TINY = str(REPO / "configs/tiny.yaml")
TITAN = "0.2.2"  # the release the peer is written against (pyproject.toml's torchtitan-peer extra)
HAS_TITAN = package_version("torchtitan") == TITAN
needs_titan = pytest.mark.skipif(not HAS_TITAN,
                                 reason=f"torchtitan {TITAN} is not installed (pip install -e .[torchtitan-peer])")
EP_RUN = Command((*app_command([TINY], 2, "tests/workers/torchtitan_peer_ep.py"),),
                 (("OMP_NUM_THREADS", "1"),
                  ("PYTHONPATH", os.pathsep.join([str(REPO), str(REPO / "tests"), os.environ.get("PYTHONPATH", "")]))))
# run from the session's start (conftest.py's planned_command), where it can run at all
PLANNED_COMMANDS = [EP_RUN] if HAS_TITAN else []


def _tiny_cfg():
    return workload_config(argparse.Namespace(config=TINY, layers=1))


def _tiny_model(cfg, monkeypatch):
    from bench.titan_on_cpu import PATCHES, count_in_float
    from torchtitan.models.qwen3 import Qwen3Model

    from benchmarks.torchtitan_peer import mixtral_args

    for module, name, value in PATCHES:
        monkeypatch.setattr(module, name, value)
    torch.manual_seed(0)
    model = Qwen3Model(mixtral_args(cfg.model, "flex"))
    with torch.no_grad():  # as torchtitan's trainer initialises it
        model.init_weights()
    count_in_float(model)
    return model


def test_bad_arguments_are_refused_in_one_line_before_heavy_imports():
    cases = [
        (["--steps", "5", "--warmup", "5"], "--warmup 5 must leave some of the --steps 5 to time"),
        (["--doc-len", "0"], "--doc-len must be positive, got 0"),
        (["--layers", "0"], "--layers must be positive, got 0"),
        (["--ep", "0"], "--ep must be positive, got 0"),
        (["--config", "configs/missing.yaml"], "cannot read config configs/missing.yaml: No such file or directory"),
    ]
    answers, imported = refusals("torchtitan_peer", [args for args, _ in cases], ('torch', 'torchtitan'))
    for (code, stderr), (args, message) in zip(answers, cases):
        assert code == 2 and stderr == f"torchtitan_peer: error: {message}\n", (args, stderr)
    assert imported == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_a_machine_without_cuda_is_refused_in_one_line(capsys):
    from benchmarks.torchtitan_peer import main

    assert main(["--config", TINY]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == ("torchtitan_peer: error: the torchtitan peer needs CUDA GPUs (its attention cannot "
                                 "train on a CPU), and none is visible\n")


def test_inputs_are_torchtitans_packed_batch():
    cfg = _tiny_cfg()
    (row,) = random_rows(cfg, 1, 50, torch.Generator().manual_seed(0), "cpu")
    batch = titan_inputs(row)
    tokens, labels = batch["tokens"][0], batch["labels"][0]
    assert batch["positions"][0, 48:53].tolist() == [48, 49, 0, 1, 2]
    # Token i predicts token i + 1, except the last token of each document and of the row.
    ends = row["cu_seq_lens_q"][1:] - 1
    assert len(ends) > 4 and (labels == -100).nonzero().flatten().tolist() == ends.tolist()
    # torchtitan's masks end a document at its EOS token: here the row marking each last token.
    assert batch["document_ends"][0].nonzero().flatten().tolist() == ends.tolist()
    kept = labels != -100
    assert torch.equal(labels[kept], tokens[1:][kept[:-1]])


@needs_titan
def test_the_model_holds_our_mixtrals_parameters(monkeypatch):
    cfg = _tiny_cfg()
    model = _tiny_model(cfg, monkeypatch)
    assert sum(p.numel() for p in model.parameters()) == count_parameters(cfg.model).total
    moe, m = model.layers["0"].moe, cfg.model
    assert moe.experts.w1.shape == (m.num_experts, m.intermediate_size, m.hidden_size)
    assert moe.router.top_k == m.num_experts_per_tok and moe.shared_experts is None
    assert (moe.router.score_func, moe.router.route_norm, moe.score_before_experts) == ("softmax", True, False)


@needs_titan
def test_packed_documents_attend_only_to_themselves(monkeypatch):
    from benchmarks.torchtitan_peer import DOCUMENT_END

    cfg = _tiny_cfg()
    model = _tiny_model(cfg, monkeypatch).eval()
    (row,) = random_rows(cfg, 1, 50, torch.Generator().manual_seed(0), "cpu")
    batch = titan_inputs(row)
    with torch.no_grad():
        packed = model(batch["tokens"], model.get_attention_masks(batch["document_ends"], DOCUMENT_END),
                       batch["positions"])
        second = slice(50, 100)
        alone = model(batch["tokens"][:, second],
                      model.get_attention_masks(batch["document_ends"][:, second], DOCUMENT_END),
                      batch["positions"][:, second])
    # Routing is per token, so the second document alone gives what it gives inside the row.
    torch.testing.assert_close(packed[:, 50:100], alone, rtol=1e-5, atol=1e-5)


@needs_titan
def test_its_moe_trains_on_cpu(monkeypatch):
    cfg = _tiny_cfg()
    moe = _tiny_model(cfg, monkeypatch).layers["0"].moe
    x = torch.randn(1, 64, cfg.model.hidden_size, requires_grad=True)
    moe(x).square().sum().backward()
    experts = moe.experts
    assert x.grad is not None and torch.isfinite(x.grad).all()
    for weight in (experts.w1, experts.w2, experts.w3, moe.router.gate.weight):
        assert weight.grad is not None and weight.grad.abs().sum() > 0


@needs_titan
def test_a_training_step_on_cpu_or_why_not(monkeypatch):
    from benchmarks.torchtitan_peer import train_step

    cfg = _tiny_cfg()
    model = _tiny_model(cfg, monkeypatch)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.train.lr)
    (row,) = random_rows(cfg, 1, 50, torch.Generator().manual_seed(0), "cpu")
    try:
        loss = train_step(model, optimizer, titan_inputs(row), contextlib.nullcontext())
    except NotImplementedError as error:
        if "does not support backward on CPU" not in str(error):
            raise
        pytest.skip("torchtitan's attention (FlexAttention) has no backward on a CPU: the step runs on GPUs only")
    assert torch.isfinite(loss)


@needs_titan
@pytest.mark.slow
def test_its_trainer_parallelises_it_at_ep_1_and_2(planned_command):
    """Under torchrun (two CPU processes, gloo): `build_parallel` at EP 1 and 2, the same loss
    on each rank at both (tests/workers/torchtitan_peer_ep.py checks)."""
    proc, _ = planned_command(EP_RUN)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("ep 1: ok") == 2 and proc.stdout.count("ep 2: ok") == 2


def test_each_data_parallel_rank_trains_on_its_own_rows(monkeypatch):
    from te_mixtral.data import packing

    # Tokenized once: every rank's rows and batch are packed from the same token stream.
    monkeypatch.setattr(packing, "token_stream", tokenize_once(packing.token_stream))
    cfg = _tiny_cfg()
    rows = [our_rows(cfg, 1, "cpu", rank, 2)[0] for rank in range(2)]
    for rank, row in enumerate(rows):
        (batch,) = packing.PackedData(cfg.data, cfg.train.batch_size, rank, 2, cfg.train.seed).micro_batches(0)
        assert torch.equal(row["input_ids"], batch.input_ids.reshape(1, -1))
        assert torch.equal(row["cu_seq_lens_q"], batch.packed.cu_seqlens)
    assert not torch.equal(rows[0]["input_ids"], rows[1]["input_ids"])


def test_figures_are_per_gpu_over_the_ranks():
    # Two GPUs, 2 s steps, 4000 tokens and 8e12 FLOPs a step over both: 1000 tokens/s and 2 TFLOP/s per GPU.
    summary = summarize_steps([9.0, 2.0, 2.0], 1, 4000, [1.0, 8e12, 8e12], torch.device("cpu"), world_size=2)
    assert summary["median_step_ms"] == 2000.0
    assert summary["tokens_per_s_per_gpu"] == 1000.0 and summary["tflops_per_gpu"] == 2.0

"""benchmarks/te_example.py (and peer_workload.py, the rows it trains on), the parts that run without a GPU: refusing bad arguments in one
line before importing anything heavy, loading the example's files beside our own te_mixtral
package, packing rows the way the example's collator does, and taking our own run's rows. Training TE's model needs
CUDA and Transformer Engine; that part runs on GPU machines only."""

import subprocess
import sys

import pytest
import torch
from conftest import REPO

from benchmarks.peer_workload import our_rows, random_rows, rows_per_gpu
from benchmarks.te_example import load_example
from te_mixtral.config import load_config
from te_mixtral.data.packing import PackedData
from te_mixtral.errors import UserError
from te_mixtral.measure.metrics import causal_pairs


def _bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "benchmarks.te_example", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=60, check=False)


def _fake_example(folder, body="TEMixtralForCausalLM = Marker"):
    folder.mkdir()
    (folder / "hf_to_te_weights.py").write_text(
        "from __future__ import annotations\nfrom dataclasses import dataclass\n\n"
        "@dataclass\nclass Marker:\n    rows: int = 0\n")
    (folder / "te_mixtral.py").write_text(f"from hf_to_te_weights import Marker\n{body}\n")
    return folder


def test_missing_example_dir_is_refused_in_one_line_before_heavy_imports():
    result = _bench("--example-dir", "/nonexistent")
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.splitlines() == [(
        "te_example: error: --example-dir /nonexistent lacks hf_to_te_weights.py, te_mixtral.py: copy TE's example "
        "there first (scripts/fetch_te_example.sh TE_REPO /nonexistent)")]
    script = ("import sys; from benchmarks.te_example import main; code = main(['--example-dir', '/nonexistent']); "
              "print(code, sorted(m for m in ('torch', 'transformers', 'transformer_engine') if m in sys.modules))")
    probe = subprocess.run(
        [sys.executable, "-c", script],
        cwd=REPO, capture_output=True, text=True, timeout=60, check=False)
    assert probe.stdout.split("\n")[0] == "2 []", probe.stdout + probe.stderr


def test_bad_config_and_warmup_are_refused_in_one_line(tmp_path):
    example = _fake_example(tmp_path / "example")
    for args, message in [
        (["--config", "configs/missing.yaml"], "te_example: error: cannot read config configs/missing.yaml"),
        (["--steps", "5", "--warmup", "5"], "te_example: error: --warmup 5 must leave some of the --steps 5"),
    ]:
        result = _bench("--example-dir", str(example), *args)
        assert result.returncode == 2 and result.stdout == "", result.stderr
        assert len(result.stderr.splitlines()) == 1 and result.stderr.startswith(message), result.stderr


def test_example_loads_under_its_own_name_beside_our_package(tmp_path):
    import te_mixtral

    try:
        module = load_example(_fake_example(tmp_path / "example"))
        assert module.__name__ == "te_example_mixtral"
        assert module.TEMixtralForCausalLM is sys.modules["hf_to_te_weights"].Marker
        assert module.TEMixtralForCausalLM(rows=3).rows == 3
        assert sys.modules["te_mixtral"] is te_mixtral  # ours, not the example's file of that name
    finally:
        sys.modules.pop("te_example_mixtral", None)
        sys.modules.pop("hf_to_te_weights", None)


def test_random_rows_match_the_collator_layout():
    cfg = load_config(None, {"seq_len": "8", "batch_size": "2", "vocab_size": "50", "tokenizer_vocab_size": "50"})
    generator = torch.Generator().manual_seed(0)
    (batch,) = random_rows(cfg, 1, 3, generator, "cpu")
    assert batch["input_ids"].shape == (1, 16) and int(batch["input_ids"].max()) < 50
    assert batch["cu_seq_lens_q"].tolist() == [0, 3, 6, 8, 11, 14, 16]
    assert batch["cu_seq_lens_k"] is batch["cu_seq_lens_q"] and batch["cu_seq_lens_q"].dtype == torch.int32
    assert batch["max_length_q"] == batch["max_length_k"] == 3
    # The first token of every document but the first is not a target, as the collator's separator_id does.
    ignored = (batch["labels"][0] == -100).nonzero().flatten().tolist()
    assert ignored == [3, 6, 8, 11, 14]
    kept = batch["labels"][0] != -100
    assert torch.equal(batch["labels"][0][kept], batch["input_ids"][0][kept])
    assert causal_pairs(batch["cu_seq_lens_q"]) == 2 * (6 + 6 + 3)  # per sample: documents of 3, 3 and 2 tokens


def test_a_gpu_trains_its_share_of_the_global_batch():
    """train.batch_size is the global batch, as in our runs: on 2 GPUs each trains half of it,
    in both kinds of rows, and the token count a peer reports is that of its rows."""
    cfg = load_config(None, {"seq_len": "64", "batch_size": "4", "vocab_size": "50", "tokenizer_vocab_size": "50"})
    assert rows_per_gpu(cfg, 1) == 4 and rows_per_gpu(cfg, 2) == 2
    (random_row,) = random_rows(cfg, 1, 16, torch.Generator().manual_seed(0), "cpu", world_size=2)
    (our_row,) = our_rows(cfg, 1, "cpu", rank=1, world_size=2)
    for row in (random_row, our_row):
        assert row["input_ids"].numel() == int(row["cu_seq_lens_q"][-1]) == rows_per_gpu(cfg, 2) * 64
    with pytest.raises(UserError, match="train.batch_size 4 does not split over 3 GPUs"):
        rows_per_gpu(cfg, 3)


def test_our_rows_are_what_our_run_trains_on():
    cfg = load_config(None, {"seq_len": "2048", "batch_size": "2", "max_position_embeddings": "2048"})
    rows = our_rows(cfg, 3, "cpu")
    data = PackedData(cfg.data, 2, 0, 1, cfg.train.seed)
    for step, row in enumerate(rows):
        (batch,) = data.micro_batches(step)
        assert torch.equal(row["input_ids"], batch.input_ids.reshape(1, -1))
        assert torch.equal(row["cu_seq_lens_q"], batch.packed.cu_seqlens)
        assert row["max_length_q"] == batch.packed.max_seqlen
    assert len(rows[0]["cu_seq_lens_q"]) > 3  # real text: several documents in a row


def test_the_example_blocks_splits_are_recorded_call_by_call():
    """`record_splits` wraps each block that has the example's `_expert_ffn`, keeps its
    result, and appends the host list it was handed."""
    import torch

    from benchmarks.te_example import record_splits

    class Block(torch.nn.Module):
        def _expert_ffn(self, tokens, m_splits):
            return tokens * len(m_splits)

    model = torch.nn.Sequential(Block(), torch.nn.Linear(2, 2), Block())
    calls = record_splits(model)
    tokens = torch.ones(3, 2)
    assert torch.equal(model[0]._expert_ffn(tokens, [1, 2]), tokens * 2)
    model[2]._expert_ffn(tokens, [3, 0, 0])
    assert calls == [[1, 2], [3, 0, 0]]

"""Training checkpoints in one process: round trip, atomicity, corruption, pruning, refusals."""

import dataclasses
import errno
import json
import math
import os
import pickle
import re
from types import SimpleNamespace

import pytest
import torch
from test_config import old_layout

import te_mixtral.files as files
import te_mixtral.saved_config as saved_config
import te_mixtral.training.checkpoint as checkpoint
from te_mixtral.config import load_config
from te_mixtral.data.tokenizer import Tokenizer, train_tokenizer
from te_mixtral.distributed.layout import Layout
from te_mixtral.errors import Diverged, UserError, WriteFailed
from te_mixtral.experts.loop import LoopTier
from te_mixtral.files import require_writable, sha256_of
from te_mixtral.model.layers import TORCH
from te_mixtral.model.lora import add_adapters
from te_mixtral.model.mixtral import MixtralForCausalLM, init_weights
from te_mixtral.training.checkpoint import (
    LATEST,
    Checkpointer,
    TrainState,
    tokenizer_sha256,
)
from te_mixtral.training.optimizer import make_optimizer

SINGLE = Layout(0, 1, 1, None, None)
CPU = torch.device("cpu")
TOKENIZER = "a" * 64  # the run's tokenizer_sha256, as the loop passes it


@pytest.fixture
def setup(tmp_path):
    cfg = load_config(None, {"checkpoint_dir": str(tmp_path / "ckpt"), "vocab_size": "64", "hidden_size": "16",
                             "intermediate_size": "24", "num_hidden_layers": "1", "num_attention_heads": "2",
                             "num_key_value_heads": "1", "head_dim": "8", "num_experts": "2",
                             "tokenizer_vocab_size": "64", "steps": "10", "checkpoint_keep": "2"})

    def fresh(seed=0):
        model = MixtralForCausalLM(cfg.model, TORCH, SINGLE, LoopTier())
        init_weights(model, seed, SINGLE)
        optimizer = make_optimizer(model, cfg)
        for p in model.parameters():  # one step, so the optimizer has state worth saving
            p.grad = torch.ones_like(p)
        optimizer.step()
        return model, optimizer

    return cfg, fresh, Checkpointer(cfg, SINGLE, CPU, TOKENIZER)


def save(ckpt, cfg, model, optimizer, step):
    return ckpt.save(TrainState(step, [float(s) for s in range(step)], [{"step": step, "loss": 1.0}]),
                     model, optimizer, cfg)


def test_round_trip_restores_weights_optimizer_rng_and_history(setup):
    cfg, fresh, ckpt = setup
    model, optimizer = fresh(seed=1)
    torch.manual_seed(7)
    runs = {"wandb": "x1y2z3", "mlflow": "0123abcd" * 4}  # the experiment trackers' runs, to go on in
    exchange = {"capacity": 1.375, "steps_run_again": [2]}  # the padded exchange as the run raised it
    ckpt.save(TrainState(3, [0.0, 1.0, 2.0], [{"step": 3, "loss": 1.0}], tracker_runs=runs, exchange=exchange),
              model, optimizer, cfg)
    expected_draw = torch.rand(3)

    other, other_optimizer = fresh(seed=2)
    state = ckpt.load_latest(other, other_optimizer, dataclasses.replace(cfg, resume=True))
    assert (state.step, state.losses, state.evals) == (3, [0.0, 1.0, 2.0], [{"step": 3, "loss": 1.0}])
    assert state.tracker_runs == runs and state.exchange == exchange
    for (name, a), b in zip(model.state_dict().items(), other.state_dict().values()):
        assert torch.equal(a, b), name
    assert str(optimizer.state_dict()) == str(other_optimizer.state_dict())
    assert torch.equal(torch.rand(3), expected_draw)


def test_a_save_that_dies_half_way_leaves_the_previous_checkpoint(setup, monkeypatch):
    cfg, fresh, ckpt = setup
    model, optimizer = fresh()
    save(ckpt, cfg, model, optimizer, 2)

    def disk_full(obj, f):  # write part of the file, then fail like a full disk
        f.write(b"PK\x03\x04 half a zip file")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(checkpoint.torch, "save", disk_full)
    with pytest.raises(UserError, match="No space left on device; the previous checkpoint"):
        save(ckpt, cfg, model, optimizer, 4)
    monkeypatch.undo()
    assert (ckpt.dir / LATEST).read_text().strip() == "step-000002"
    assert (ckpt.dir / "step-000004.tmp").exists() and not (ckpt.dir / "step-000004").exists()
    assert ckpt.load_latest(*fresh(), cfg).step == 2

    save(ckpt, cfg, model, optimizer, 4)  # the next save clears the leftover
    assert sorted(p.name for p in ckpt.dir.iterdir()) == [LATEST, "step-000002", "step-000004"]


def test_old_checkpoints_are_pruned_and_abandoned_futures_dropped(setup):
    cfg, fresh, ckpt = setup
    model, optimizer = fresh()
    for step in (1, 2, 3, 4):
        save(ckpt, cfg, model, optimizer, step)
    assert sorted(p.name for p in ckpt.dir.iterdir()) == [LATEST, "step-000003", "step-000004"]
    # Resumed from step 3 (as if step 4 was written but `latest` not yet pointed at it), the
    # run saves step 4 again over the stale folder.
    (ckpt.dir / LATEST).write_text("step-000003\n")
    save(ckpt, cfg, model, optimizer, 4)
    assert sorted(p.name for p in ckpt.dir.iterdir()) == [LATEST, "step-000003", "step-000004"]
    # A folder newer than `latest` (written by a run that died before it could point `latest`
    # at it) is never resumed from: the next save drops it.
    (ckpt.dir / LATEST).write_text("step-000003\n")
    ckpt.keep = 1
    save(ckpt, cfg, model, optimizer, 3)
    assert sorted(p.name for p in ckpt.dir.iterdir()) == [LATEST, "step-000003"]


def test_a_save_deletes_only_folders_the_checkpointer_wrote(setup, tmp_path):
    """A user's folder named like a leftover or a checkpoint, a link to a folder, and a
    checkpoint holding the run's output folder (reached through a link) are never deleted."""
    cfg, fresh, ckpt = setup
    model, optimizer = fresh()
    theirs = ckpt.dir / "step-000009.tmp"  # named like an interrupted save's leftover
    theirs.mkdir()
    (theirs / "notes.txt").write_text("mine")
    with pytest.raises(WriteFailed, match=f"{theirs} is in the way of a checkpoint save"):
        save(ckpt, cfg, model, optimizer, 1)
    assert (theirs / "notes.txt").read_text() == "mine"
    theirs.rename(tmp_path / "moved")

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "data.bin").write_text("mine")
    (ckpt.dir / "step-000000").symlink_to(elsewhere)  # a link named like the oldest checkpoint
    (ckpt.dir / "step-000001").mkdir()  # a folder of the user's, named like one
    (ckpt.dir / "step-000001" / "notes.txt").write_text("mine")
    save(ckpt, cfg, model, optimizer, 2)
    out = tmp_path / "out"  # the run's output folder: a link into the checkpoint of step 2
    (ckpt.dir / "step-000002" / "results").mkdir()
    out.symlink_to(ckpt.dir / "step-000002" / "results")
    (out / "steps.jsonl").write_text("{}\n")
    ckpt.output_dir = out.resolve()  # as Checkpointer(cfg) takes it from output_dir
    for step in (3, 4, 5):
        save(ckpt, cfg, model, optimizer, step)
    assert sorted(p.name for p in ckpt.dir.iterdir()) == [
        LATEST, "step-000000", "step-000001", "step-000002", "step-000004", "step-000005"]
    assert (elsewhere / "data.bin").is_file() and (out / "steps.jsonl").is_file()
    assert (ckpt.dir / "step-000001" / "notes.txt").is_file()


@pytest.mark.parametrize("damage, file, message", [
    ("truncate", "rank00000.pt", "truncated or corrupt"),
    ("flip", "rank00000.pt", "SHA-256 differs"),
    ("delete", "rank00000.pt", "is missing"),
    ("truncate", "__0_0.distcp", "truncated or corrupt"),  # the weights and optimizer state
    ("flip", "__0_0.distcp", "SHA-256 differs"),
    ("delete", ".metadata", "is missing"),
    ("meta", None, "unreadable or corrupt"),
    ("latest", None, "not a step-NNNNNN folder"),
])
def test_a_damaged_checkpoint_is_refused(setup, damage, file, message):
    cfg, fresh, ckpt = setup
    folder = save(ckpt, cfg, *fresh(), 2)
    shard = folder / str(file)
    if damage == "truncate":
        os.truncate(shard, shard.stat().st_size // 2)
    elif damage == "flip":
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
    elif damage == "delete":
        shard.unlink()
    elif damage == "meta":
        (folder / "meta.json").write_text('{"step": 2, "form')
    else:
        (ckpt.dir / LATEST).write_text("\x00garbage")
    with pytest.raises(UserError, match=message):
        ckpt.load_latest(*fresh(), cfg)


class _Remove:
    """Unpickled, deletes `path`: what a malicious pickle could do instead."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return os.remove, (self.path,)


def test_a_checkpoint_index_that_would_run_code_is_refused_unread(setup, tmp_path):
    """DCP's index is a pickle: one replaced, its hash in meta.json replaced too, must build
    nothing but an index, and the refusal must not suggest loading it less safely."""
    cfg, fresh, ckpt = setup
    folder = save(ckpt, cfg, *fresh(), 2)
    canary = tmp_path / "canary"
    canary.write_text("still here")
    (folder / ".metadata").write_bytes(pickle.dumps(_Remove(canary)))
    meta = json.loads((folder / "meta.json").read_text())
    meta["files"][".metadata"] = {"bytes": (folder / ".metadata").stat().st_size,
                                  "sha256": sha256_of(folder / ".metadata")}
    (folder / "meta.json").write_text(json.dumps(meta))
    refusal = r"\.metadata is not a checkpoint index \(it would build posix\.remove\)"
    with pytest.raises(UserError, match=refusal) as info:
        ckpt.load_latest(*fresh(), cfg)
    assert canary.exists() and "weights_only" not in str(info.value)


@pytest.mark.parametrize("edit, message", [
    (lambda meta: meta.pop("step"), "lacks 'step' (int expected)"),
    (lambda meta: meta.pop("files"), "lacks 'files'"),
    (lambda meta: meta.pop("config"), "lacks 'config'"),
    (lambda meta: meta.update(step="2"), "has a str for 'step'"),
    (lambda meta: meta.update(losses=None), "has a NoneType for 'losses'"),
    (lambda meta: meta.update(losses=[1.0, "x"]), "'losses' are not all numbers"),
    (lambda meta: meta["files"]["rank00000.pt"].pop("sha256"), "entry for rank00000.pt lacks 'bytes' or 'sha256'"),
    (lambda meta: meta["config"].pop("model"), "its 'config' has no 'model' section"),
    (lambda meta: meta.update(tracker_runs=["x"]), "its 'tracker_runs' is not a mapping of tracker names to run ids"),
    (lambda meta: meta.update(tracker_runs={"wandb": 3}), "its 'tracker_runs' is not a mapping"),
    (lambda meta: meta.update(exchange={"capacity": "1.5", "steps_run_again": []}), "its 'exchange' is not the padded"),
    (lambda meta: meta.clear(), "has format None, this version reads 2"),
    (lambda meta: meta.update(format=1, step=None), "has format 1, this version reads 2: each rank's own shards"),
])
def test_checkpoint_metadata_without_what_resume_reads_is_refused(setup, edit, message):
    cfg, fresh, ckpt = setup
    folder = save(ckpt, cfg, *fresh(), 2)
    meta = json.loads((folder / "meta.json").read_text())
    edit(meta)
    (folder / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(UserError, match=re.escape(message)) as info:
        ckpt.load_latest(*fresh(), cfg)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("target, content, message", [
    ("meta.json", "[1, 2]", "holds a list, not a mapping"),
    ("meta.json", b"\xff\xfe binary", "unreadable or corrupt"),
    ("latest", b"\xff\xfe binary", "not a step-NNNNNN folder"),
])
def test_a_binary_or_non_mapping_metadata_file_is_refused(setup, target, content, message):
    cfg, fresh, ckpt = setup
    folder = save(ckpt, cfg, *fresh(), 2)
    path = ckpt.dir / LATEST if target == "latest" else folder / target
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(UserError, match=message):
        ckpt.load_latest(*fresh(), cfg)


def test_resume_refuses_what_cannot_continue(setup, tmp_path):
    cfg, fresh, ckpt = setup
    with pytest.raises(UserError, match="no checkpoint to resume from"):
        ckpt.load_latest(*fresh(), cfg)
    save(ckpt, cfg, *fresh(), 10)
    with pytest.raises(UserError, match="nothing left to do"):
        ckpt.load_latest(*fresh(), cfg)
    bigger = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, hidden_size=32))
    with pytest.raises(UserError, match="different model"):
        ckpt.load_latest(*fresh(), bigger)
    master = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, optimizer="master_adamw", dtype="bf16"))
    with pytest.raises(UserError, match="written with train.optimizer adamw.*resume it with --optimizer adamw"):
        ckpt.load_latest(*fresh(), master)


def test_a_model_with_a_parameter_the_checkpoint_lacks_is_refused_in_one_line(setup):
    """Say, an adapter added since: the checkpoint has nothing to load into it."""
    cfg, fresh, ckpt = setup
    save(ckpt, cfg, *fresh(), 3)
    model, _ = fresh()
    model.model.layers[0].self_attn.register_parameter("adapter", torch.nn.Parameter(torch.zeros(4, 16)))
    optimizer = make_optimizer(model, cfg)
    refusal = r"does not fit this run's model: .*model\.model\.layers\.0\.self_attn\.adapter"
    with pytest.raises(UserError, match=refusal) as info:
        ckpt.load_latest(model, optimizer, cfg)
    assert "\n" not in str(info.value)


def test_resume_reads_an_older_checkpoints_config_through_its_upgrade(setup, capsys, monkeypatch):
    cfg, fresh, ckpt = setup
    folder = save(ckpt, cfg, *fresh(), 3)
    # As a checkpoint written before `checkpoint_every` and `save_every` moved into `train`,
    # and (a made-up move) when `train.log_every` was a top-level `log_interval`.
    monkeypatch.setitem(saved_config.MOVED_KEYS, "log_interval", "train.log_every")
    meta = json.loads((folder / "meta.json").read_text())
    meta["config"] = old_layout(meta["config"])
    meta["config"]["log_interval"] = meta["config"]["train"].pop("log_every")
    (folder / "meta.json").write_text(json.dumps(meta))

    def notes(train, **changes):
        ckpt.load_latest(*fresh(), dataclasses.replace(cfg, train=train, resume=True, **changes))
        return [line for line in capsys.readouterr().out.splitlines() if "changed since the checkpoint" in line]

    # checkpoint_every, resume and generate may change on resume; log_every is noted, once changed.
    assert notes(dataclasses.replace(cfg.train, checkpoint_every=5), generate="Hi") == []
    assert notes(dataclasses.replace(cfg.train, log_every=1)) == [
        "te_mixtral: note: changed since the checkpoint: train.log_every 5 -> 1"]


def test_resume_reads_a_checkpoint_saved_with_the_old_expert_count_key(setup):
    cfg, fresh, ckpt = setup
    model, optimizer = fresh(seed=1)
    folder = save(ckpt, cfg, model, optimizer, 3)
    meta = json.loads((folder / "meta.json").read_text())
    saved_model = meta["config"]["model"]
    meta["config"]["model"] = {("num_local_experts" if k == "num_experts" else k): v for k, v in saved_model.items()}
    (folder / "meta.json").write_text(json.dumps(meta))

    other, other_optimizer = fresh(seed=2)
    assert ckpt.load_latest(other, other_optimizer, cfg).step == 3
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), other.state_dict().values()))
    more_experts = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, num_experts=4))
    with pytest.raises(UserError, match="different model"):
        ckpt.load_latest(*fresh(), more_experts)


def test_meta_records_sizes_and_hashes(setup):
    cfg, fresh, ckpt = setup
    folder = save(ckpt, cfg, *fresh(), 1)
    meta = json.loads((folder / "meta.json").read_text())
    written = {p.name for p in folder.iterdir()} - {"meta.json"}
    assert set(meta["files"]) == written and {".metadata", "rank00000.pt"} <= written  # DCP's index and data too
    for name, entry in meta["files"].items():
        assert entry == {"bytes": (folder / name).stat().st_size, "sha256": sha256_of(folder / name)}, name
    assert meta["world_size"] == 1 and meta["config"]["model"]["hidden_size"] == 16


def test_space_and_writability_are_checked_up_front(setup, tmp_path, monkeypatch):
    cfg, fresh, ckpt = setup
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(UserError, match="is not writable"):
        require_writable(blocker / "ckpt", "checkpoint directory")
    monkeypatch.setattr(files.shutil, "disk_usage", lambda path: SimpleNamespace(free=1000))
    with pytest.raises(UserError, match="not enough free space .* training checkpoints"):
        ckpt.check_free_space(fresh()[0])


def test_a_full_disk_in_torch_save_is_one_line_and_keeps_the_previous_checkpoint(setup, monkeypatch):
    # What torch.save raises when a real disk fills up (measured on a 1 MiB tmpfs): a
    # RuntimeError from its zip writer, not an OSError.
    cfg, fresh, ckpt = setup
    model, optimizer = fresh()
    save(ckpt, cfg, model, optimizer, 2)

    def disk_full(obj, f):
        f.write(b"PK\x03\x04")
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")

    monkeypatch.setattr(checkpoint.torch, "save", disk_full)
    with pytest.raises(WriteFailed, match="unexpected pos 704 vs 598 .is the disk full.*previous checkpoint"):
        save(ckpt, cfg, model, optimizer, 4)
    assert (ckpt.dir / LATEST).read_text().strip() == "step-000002"


def test_non_finite_weights_are_never_saved(setup):
    cfg, fresh, ckpt = setup
    model, optimizer = fresh()
    save(ckpt, cfg, model, optimizer, 2)
    before = sorted(p.name for p in ckpt.dir.iterdir())
    for bad in (math.nan, math.inf):
        with torch.no_grad():
            model.lm_head.weight[3, 5] = bad
        with pytest.raises(Diverged, match="weights are not finite"):
            save(ckpt, cfg, model, optimizer, 4)
        assert sorted(p.name for p in ckpt.dir.iterdir()) == before  # `latest` still on step 2
    assert (ckpt.dir / LATEST).read_text().strip() == "step-000002"


def test_resume_refuses_a_different_tokenizer(setup, tmp_path):
    cfg, fresh, ckpt = setup
    documents = [f"document {i} about {word}" for i, word in enumerate(["cats", "dogs", "ships"] * 20)]
    first = tokenizer_sha256(Tokenizer.wrap(train_tokenizer(documents, 300), "test"))
    other = tokenizer_sha256(Tokenizer.wrap(train_tokenizer(documents[::-1][:30], 300), "test"))
    assert first != other and first == tokenizer_sha256(Tokenizer.wrap(train_tokenizer(documents, 300), "test"))
    saver = Checkpointer(cfg, SINGLE, CPU, first)
    folder = save(saver, cfg, *fresh(), 3)
    with pytest.raises(UserError, match="different tokenizer"):
        Checkpointer(cfg, SINGLE, CPU, other).load_latest(*fresh(), cfg)
    assert Checkpointer(cfg, SINGLE, CPU, first).load_latest(*fresh(), cfg).step == 3
    meta = json.loads((folder / "meta.json").read_text())  # a checkpoint older than the fingerprint loads
    del meta["tokenizer_sha256"], meta["grad_norms"]
    (folder / "meta.json").write_text(json.dumps(meta))
    assert Checkpointer(cfg, SINGLE, CPU, other).load_latest(*fresh(), cfg).grad_norms == [None] * 3


def test_free_space_counts_every_kept_checkpoint_and_frees_leftovers(setup, monkeypatch):
    cfg, fresh, ckpt = setup
    model, optimizer = fresh()
    one = sum(p.numel() * p.element_size() for p in model.parameters()) * 3  # weights and two moments

    def free(nbytes):
        monkeypatch.setattr(files.shutil, "disk_usage", lambda path: SimpleNamespace(free=nbytes))

    free(3 * one)  # checkpoint_keep 2: two kept while the third is written
    ckpt.check_free_space(model)
    free(3 * one - 1)
    with pytest.raises(UserError, match="not enough free space .* checkpoints .2 kept and the one being written"):
        ckpt.check_free_space(model)
    monkeypatch.undo()
    save(ckpt, cfg, model, optimizer, 1)
    save(ckpt, cfg, model, optimizer, 2)
    # A save that died on a full disk left 'step-000003.tmp': the next save deletes it first,
    # so it counts as free, and the two checkpoints already here as written.
    leftover = ckpt.dir / "step-000003.tmp"
    files.make_scratch(leftover)  # as the save made it
    (leftover / "rank00000.pt").write_bytes(bytes(one // 2))
    reclaimable = files.folder_bytes(leftover)  # the file, and the marker
    free(one - reclaimable)
    ckpt.check_free_space(model)
    free(one - reclaimable - 1)
    with pytest.raises(UserError, match="not enough free space"):
        ckpt.check_free_space(model)
    monkeypatch.undo()
    save(ckpt, cfg, model, optimizer, 4)
    assert sorted(p.name for p in ckpt.dir.iterdir()) == [LATEST, "step-000002", "step-000004"]


def _lora_run(setup, tmp_path, **lora):
    """A LoRA model and optimizer over a base saved as an HF folder, under the setup's config
    with `lora` (lora.* keys), `model_path` and `tier` overridden."""
    cfg, _, ckpt = setup
    cfg = dataclasses.replace(cfg, model_path=lora.pop("model_path", str(tmp_path / "base")),
                              tier=lora.pop("tier", cfg.tier),
                              lora=dataclasses.replace(cfg.lora, **{"rank": 2, **lora}), resume=True)
    model = MixtralForCausalLM(cfg.model, TORCH, SINGLE, LoopTier(), frozen_base=True)
    init_weights(model, 0, SINGLE)
    add_adapters(model, cfg.lora, 0, SINGLE)
    return cfg, model, make_optimizer(model, cfg)


def test_a_lora_resume_under_other_adapter_settings_is_refused_naming_the_difference(setup, tmp_path):
    (tmp_path / "base").mkdir()
    cfg, model, optimizer = _lora_run(setup, tmp_path, targets="q_proj,v_proj,down_proj")
    ckpt = setup[2]
    save(ckpt, cfg, model, optimizer, 2)
    for lora, message in [
        ({"targets": "q_proj,down_proj"}, "lora.targets leaves out v_proj, whose trained adapters would be dropped"),
        ({"alpha": 32.0}, "lora.alpha is 32.0, not the checkpoint's 16.0"),
        ({"rslora": True}, "lora.rslora is True, not the checkpoint's False"),
        ({"rank": 4}, "was written with lora.rank 2, not 4 (its weights have other shapes): resume with --lora.rank 2"),
        ({"targets": "q_proj,v_proj,k_proj,down_proj"}, "holds no trained adapters for lora.targets k_proj"),
    ]:
        cfg, model, optimizer = _lora_run(setup, tmp_path, **{"targets": "q_proj,v_proj,down_proj", **lora})
        with pytest.raises(UserError, match=re.escape(message)):
            ckpt.load_latest(model, optimizer, cfg)
    # Asked for: the adapters left out are dropped, the others load.
    cfg, model, optimizer = _lora_run(setup, tmp_path, targets="q_proj,down_proj", change_on_resume=True)
    assert ckpt.load_latest(model, optimizer, cfg).step == 2


def test_a_lora_resume_notes_what_moves_its_dropout_masks_as_it_notes_the_layout(setup, tmp_path, capsys):
    """LoRA's dropout draws its masks over a step's rows as the run cuts them: by the EP layout
    (noted on resume, as every setting not declared resumable), and as well by the settings
    that may otherwise change freely on resume (the same gradients to rounding, without
    dropout): the chunks of the exchange and the micro-batches. With dropout, a change of one
    is noted the same way; without, it is not."""
    (tmp_path / "base").mkdir()

    def notes(dropout, step):
        cfg, model, optimizer = _lora_run(setup, tmp_path, dropout=dropout)
        save(setup[2], cfg, model, optimizer, step)
        capsys.readouterr()
        cfg = dataclasses.replace(cfg, ep_size=2, ep_chunks=2, train=dataclasses.replace(cfg.train, grad_accum_steps=2))
        setup[2].load_latest(model, optimizer, cfg)
        return [line for line in capsys.readouterr().out.splitlines() if "changed since the checkpoint" in line]

    assert notes(0.1, 2) == [f"te_mixtral: note: changed since the checkpoint: {change}" for change in
                             ("train.grad_accum_steps 1 -> 2", "ep_size 1 -> 2", "ep_chunks 1 -> 2")]
    assert notes(0.0, 4) == ["te_mixtral: note: changed since the checkpoint: ep_size 1 -> 2"]


def test_a_lora_base_folder_is_one_however_it_is_spelled(setup, tmp_path, monkeypatch):
    (tmp_path / "base").mkdir()
    cfg, model, optimizer = _lora_run(setup, tmp_path, model_path=str(tmp_path / "base"))
    ckpt = setup[2]
    save(ckpt, cfg, model, optimizer, 2)
    monkeypatch.chdir(tmp_path)
    for spelling in (f"{tmp_path}/base/", "base", "./base/"):
        cfg, model, optimizer = _lora_run(setup, tmp_path, model_path=spelling)
        assert ckpt.load_latest(model, optimizer, cfg).step == 2
    (tmp_path / "other").mkdir()  # another folder is still another base
    cfg, model, optimizer = _lora_run(setup, tmp_path, model_path="other")
    with pytest.raises(UserError, match="holds LoRA adapters trained over the base model"):
        ckpt.load_latest(model, optimizer, cfg)
    # The base made from the seed has no folder: the line names it so, and how to get it back.
    cfg, model, optimizer = _lora_run(setup, tmp_path, model_path=None)
    with pytest.raises(UserError, match=re.escape(
            f"trained over the base model {tmp_path}/base, not the base made from seed 1234: resume with --model "
            f"{tmp_path}/base")):
        ckpt.load_latest(model, optimizer, cfg)
    save(ckpt, cfg, model, optimizer, 4)
    cfg, model, optimizer = _lora_run(setup, tmp_path, model_path="other")
    with pytest.raises(UserError, match=re.escape("trained over the base made from seed 1234, not the base model "
                                                  "other: resume without --model")):
        ckpt.load_latest(model, optimizer, cfg)


def test_a_lora_resume_over_a_base_a_tier_holds_otherwise_is_refused(setup, tmp_path):
    """device_mxfp8 holds a LoRA run's frozen experts in FP8 (lora.base default): its adapters
    were trained over that base, not the BF16 one another tier holds, and the other way round,
    as over an NF4 base (test_resume.py); the same tier resumes."""
    (tmp_path / "base").mkdir()
    ckpt = setup[2]
    cfg, model, optimizer = _lora_run(setup, tmp_path, tier="device_mxfp8")
    save(ckpt, cfg, model, optimizer, 2)
    assert ckpt.load_latest(model, optimizer, cfg).step == 2
    cfg, model, optimizer = _lora_run(setup, tmp_path, tier="custom_grouped")
    with pytest.raises(UserError, match=re.escape(
            "holds LoRA adapters trained over the base held in fp8 by tier device_mxfp8, not lora.base default by "
            "tier custom_grouped: resume with --tier device_mxfp8")):
        ckpt.load_latest(model, optimizer, cfg)
    save(ckpt, cfg, model, optimizer, 4)
    cfg, model, optimizer = _lora_run(setup, tmp_path, tier="device_mxfp8")
    with pytest.raises(UserError, match=re.escape(
            "held in lora.base default by tier custom_grouped, not fp8 by tier device_mxfp8: resume with --tier "
            "custom_grouped")):
        ckpt.load_latest(model, optimizer, cfg)


def test_a_full_fine_tune_and_a_lora_checkpoint_are_not_resumed_as_each_other(setup, tmp_path):
    """One holds every weight, the other adapters alone: the line says which it holds, and
    the way from one to the other (its export as the next run's --model)."""
    cfg, fresh, ckpt = setup
    model, optimizer = fresh()
    save(ckpt, cfg, model, optimizer, 2)
    (tmp_path / "base").mkdir()
    lora_cfg, lora_model, lora_optimizer = _lora_run(setup, tmp_path)
    with pytest.raises(UserError, match=re.escape(
            "holds a full fine-tune's weights (lora.rank 0), not LoRA adapters: resume with --lora.rank 0, or train "
            "adapters over its weights with its --save-hf export as --model")):
        ckpt.load_latest(lora_model, lora_optimizer, lora_cfg)
    save(ckpt, lora_cfg, lora_model, lora_optimizer, 4)
    with pytest.raises(UserError, match=re.escape(
            "holds LoRA adapters of lora.rank 2, not a full fine-tune's weights: resume with --lora.rank 2, or "
            "fine-tune every weight from its --save-hf export as --model")):
        ckpt.load_latest(model, optimizer, dataclasses.replace(cfg, resume=True))

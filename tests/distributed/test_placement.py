"""Experts placed by load (te_mixtral/distributed/placement.py, `ep_placement`): the placement
itself against every placement there is (and in order where moving gains nothing), the one-line
refusals (a file without this model's load, a resume given a file that no longer places as its
checkpoint, ranks that place otherwise), a placement a saved config's run turns off, every read
and write of an expert by its id on a rank of a placed model (HF weights in, the seed-made init,
adapters made and read), and runs on two gloo ranks placed by `recorded_load.json` against the
same runs in order: the same losses bit for bit, each expert's weights and adapters where its id
says, the HF exports by expert id, and a placed checkpoint resumed on two ranks and on one.

`recorded_load.json` holds what a one-process run of `EP_ARGS` recorded as its tokens per
layer and expert (`expert_load.tokens_per_expert`) on torch 2.13: its placement at EP=2 moves
experts of both layers from one rank to the other. Whether it lowers these runs' busiest rank
is not asserted: another torch draws other weights and routes otherwise (on 2.11 it raised it),
and what a placement does to the rows of a given load is checked above, in process."""

import itertools
import json
from pathlib import Path

import pytest
import torch
from host_syncs import SYNCHRONISING_OPS, OpRecorder
from launch import EP_ARGS, RUN_DIR, STOPPED_AT, run_cli, train_and_save, train_ep
from model.test_lora import ALL_TARGETS, hf_checkpoint, run_config, small_tokenizer
from safetensors.torch import load_file

from te_mixtral.cli import parse_args
from te_mixtral.config import LoRAConfig, load_config, save_config
from te_mixtral.data.packing import PackedData
from te_mixtral.distributed.dispatch import AllToAllDispatcher
from te_mixtral.distributed.layout import Layout, is_expert_param
from te_mixtral.distributed.placement import ExpertPlacement
from te_mixtral.errors import UserError
from te_mixtral.experts.loop import LoopTier
from te_mixtral.measure.expert_load import placement_by_recorded_load
from te_mixtral.model.hf_config import model_config_from_hf
from te_mixtral.model.layers import TORCH
from te_mixtral.model.lora import add_adapters, is_adapter_param
from te_mixtral.model.mixtral import MixtralForCausalLM, init_weights
from te_mixtral.training.expert_placement import run_placement
from te_mixtral.training.hf_checkpoint import load_hf_weights
from te_mixtral.training.peft_adapters import load_adapter, save_adapter
from te_mixtral.training.same_job import first_difference, job_summary

LOAD = str(Path(__file__).parents[1] / "recorded_load.json")
LORA = ("--lora.rank", "4", "--lora.alpha", "8")
PLACED = [*EP_ARGS, "--ep-size", "2", "--ep-placement", LOAD, "--save-hf", f"{RUN_DIR}/hf"]
# Stopped after its step-2 checkpoint and resumed (launch.STOPPED_AT), exporting its adapters.
PLACED_LORA = [STOPPED_AT, "2", *EP_ARGS, "--ep-size", "2", *LORA, "--ep-placement", LOAD, "--checkpoint-every", "2",
               "--checkpoint-keep", "3", "--save-hf", f"{RUN_DIR}/hf"]
# The in-order runs are tests/distributed/test_expert_parallel.py's and test_lora_ep.py's.
PLANNED_RUNS = {2: [[*EP_ARGS, "--ep-size", "2"], PLACED, [*EP_ARGS, "--ep-size", "2", *LORA], PLACED_LORA]}
SINGLE = Layout(0, 1, 1, None, None)


def best_over_every_placement(tokens_E: list[float], ranks: int) -> float:
    room, best = len(tokens_E) // ranks, float("inf")
    for order in itertools.permutations(range(len(tokens_E))):
        best = min(best, max(sum(tokens_E[e] for e in order[r * room:(r + 1) * room]) for r in range(ranks)))
    return best


def test_two_experts_a_rank_is_the_best_placement_and_every_expert_has_one_slot():
    tokens_YE = torch.randint(0, 5000, (6, 8), generator=torch.Generator().manual_seed(torch.seed())).double()
    placement = ExpertPlacement.by_load(tokens_YE, 4)
    rows_YP = placement.rows(tokens_YE)
    for layer in range(6):
        assert sorted(placement.experts_YS[layer]) == list(range(8))
        assert rows_YP[layer].max().item() == best_over_every_placement(tokens_YE[layer].tolist(), 4)
        slots = placement.slot_of_expert(layer)
        assert [placement.experts_YS[layer][s] for s in slots] == list(range(8))
        assert placement.in_expert_order(layer, list(placement.experts_YS[layer])) == list(range(8))
        assert [e for r in range(4) for e in placement.held(layer, r, 8)] == list(placement.experts_YS[layer])
    in_order = ExpertPlacement(4)
    assert in_order.held(0, 3, 8) == [6, 7] and in_order.slot_of_expert(0) is None and in_order.record() is None
    assert torch.equal(in_order.rows(tokens_YE), tokens_YE.view(6, 4, 2).sum(-1))


@pytest.mark.parametrize("tokens_E", [[0, 0, 0, 0], [7, 7, 7, 7], [4, 1, 3, 2], [2, 3, 1, 4]],
                         ids=["no-load", "ties", "in-order-best", "in-order-as-good"])
def test_experts_move_only_where_that_lowers_the_busiest_rank(tokens_E):
    """A layer whose busiest rank in order has no more rows stays in order; a load that
    moves no expert is the in-order placement (else a checkpoint it wrote would be refused
    to a run in order, and one in order to it, each said to hold its experts otherwise)."""
    placement = ExpertPlacement.by_load(torch.tensor([tokens_E, tokens_E]), 2)
    assert placement == ExpertPlacement(2) and not placement.placed and placement.record() is None
    placement = ExpertPlacement.by_load(torch.tensor([tokens_E, [9, 8, 1, 1]]), 2)
    assert placement.experts_YS == ((0, 1, 2, 3), (0, 3, 1, 2))


def test_a_placed_dispatcher_sends_each_copy_to_its_experts_slot_without_a_host_wait():
    """One rank (a resumed placed checkpoint at EP=1): the experts held in slot order give the
    in-order dispatcher's output, and mapping ids to slots adds no op that waits for the GPU."""
    gen = torch.Generator().manual_seed(torch.seed())
    tokens, dim, experts = 37, 5, 4
    x_TD, scale_E = torch.randn(tokens, dim, generator=gen), torch.randn(experts, generator=gen)
    experts_TK = torch.stack([torch.randperm(experts, generator=gen)[:2] for _ in range(tokens)])
    weights_TK = torch.rand(tokens, 2, generator=gen)
    experts_S = [2, 0, 3, 1]

    def scaled_by(scale_L):  # the experts, each scaling its rows by its own factor
        return lambda x_RD, rows_L: x_RD * torch.repeat_interleave(scale_L, rows_L)[:, None]

    want = AllToAllDispatcher(experts, 1, None).run(x_TD, experts_TK, weights_TK, scaled_by(scale_E))
    placed = AllToAllDispatcher(experts, 1, None, slot_of_expert=ExpertPlacement(1, (tuple(experts_S),))
                                .slot_of_expert(0))
    held_in_slots = scaled_by(scale_E[experts_S])
    with OpRecorder() as recorder:
        got = placed.run(x_TD, experts_TK, weights_TK, held_in_slots)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    # repeat_interleave: the test's experts', not the dispatcher's (it runs none at one rank)
    assert not (recorder.ops & SYNCHRONISING_OPS - {"aten.repeat_interleave"}), recorder.ops & SYNCHRONISING_OPS


@pytest.mark.parametrize("content, problem", [
    (None, "cannot read"),
    ("{", "holds no expert_load.tokens_per_expert"),
    ('{"losses": [1.0]}', "holds no expert_load.tokens_per_expert"),
    ('{"expert_load": {"tokens_per_expert": [1, 2]}}', "is not a table of token counts"),
    ('{"expert_load": {"tokens_per_expert": [[1, -2], [3, 4]]}}', "is not a table of token counts"),
    ('{"expert_load": {"tokens_per_expert": [[1, 2, 3, 4], [5, 6]]}}', "is not a table of token counts"),
    ('{"expert_load": {"tokens_per_expert": [["1", "2"], ["3", "4"]]}}', "is not a table of token counts"),
    ('{"expert_load": {"tokens_per_expert": [[1, 2, 3, 4]]}}', "recorded the load of 1 layers of 4 experts; this "
                                                                "model has 2 layers of 4"),
], ids=["missing", "not-json", "no-load", "one-row", "negative", "ragged", "text", "other-model"])
def test_a_file_without_this_models_load_is_refused_in_one_line(tmp_path, content, problem):
    file = tmp_path / "results.json"
    if content is not None:
        file.write_text(content)
    with pytest.raises(UserError, match=problem) as refused:
        placement_by_recorded_load(file, 2, 4, 2)
    assert f"ep_placement {file}" in str(refused.value)  # the key named, as other files' refusals name theirs


def test_a_saved_placement_the_command_line_turns_off_reads_no_file(tmp_path):
    """A placed run's config.yaml run again where the placement changes nothing (config_checks
    leaves the file's key alone): its file, gone since, is not read, nor is the run said placed."""
    saved = tmp_path / "config.yaml"
    save_config(load_config(str(Path(__file__).parents[2] / "configs" / "tiny.yaml"),
                            {"ep_size": "2", "ep_placement": str(tmp_path / "gone.json")}, world_size=2), saved)
    proc = run_cli(["--config", str(saved), "--ep-size", "1", "--steps", "2", "--timing_warmup_steps", "1",
                    "--output-dir", str(tmp_path / "run")])
    assert proc.returncode == 0, proc.stderr
    assert "placement" not in json.loads((tmp_path / "run" / "results.json").read_text()).get("expert_load", {})


def test_a_new_run_says_how_its_file_placed_the_experts(tmp_path, capsys, monkeypatch):
    """Rank 0 says what `--ep-placement` did, moved or not: a file whose load places every layer
    as well in order leaves the run in order, which nothing else the run prints would tell."""
    monkeypatch.delenv("RANK", raising=False)
    tiny = str(Path(__file__).parents[2] / "configs" / "tiny.yaml")
    balanced = tmp_path / "balanced.json"
    balanced.write_text(json.dumps({"expert_load": {"tokens_per_expert": [[5, 5, 5, 5], [5, 5, 5, 5]]}}))
    for file, said in ((LOAD, f"te_mixtral: the experts are placed by the load ep_placement {LOAD} recorded: "
                              f"2 of 2 layers otherwise than in order\n"),
                       (balanced, f"te_mixtral: note: ep_placement {balanced}'s load places no layer's experts "
                                  f"better than in order: they stay in order\n")):
        run_placement(load_config(tiny, {"ep_size": "2", "ep_placement": str(file)}, world_size=2))
        assert capsys.readouterr().out == said


def test_ranks_that_place_the_experts_otherwise_are_told_which_file_made_it():
    """Each rank reads ep_placement's file for itself (on several machines, each its own copy)."""
    cfg = load_config(str(Path(__file__).parents[2] / "configs" / "tiny.yaml"), {"ep_size": "2", "ep_placement": LOAD},
                      world_size=2)
    data = PackedData(cfg.data, 4, 0, 2, 0, 1)
    summaries = [job_summary(cfg, data, None, placement)
                 for placement in (placement_by_recorded_load(LOAD, 2, 4, 2), ExpertPlacement(2))]
    assert first_difference(summaries) == ("the experts' placement by ep_placement's file is [[1, 3, 0, 2], "
                                           "[1, 2, 0, 3]] on rank 0 and in order on rank 1")


def test_each_rank_reads_and_makes_the_experts_its_placement_gives_it(tmp_path):
    """HF weights in, the seed-made init, adapters drawn and read from an adapter folder: on
    each rank of a placed model at EP=2, local expert i is the whole model's expert `held[i]`."""
    hf_checkpoint(tmp_path / "base", torch.float32)
    m = model_config_from_hf(tmp_path / "base")
    lora = LoRAConfig(rank=2, alpha=4.0, targets=ALL_TARGETS)
    whole = MixtralForCausalLM(m, TORCH, SINGLE, LoopTier())  # its weights read, its adapters random
    load_hf_weights(whole, tmp_path / "base", SINGLE)
    add_adapters(whole, lora, 0, SINGLE)
    with torch.no_grad():
        for name, p in whole.named_parameters():
            if is_adapter_param(name):
                p.copy_(torch.randn_like(p))
    save_adapter(whole, tmp_path / "adapter", run_config(lora), SINGLE, small_tokenizer())
    seeded = MixtralForCausalLM(m, TORCH, SINGLE, LoopTier())  # its weights and adapters drawn from seeds
    init_weights(seeded, 5, SINGLE)
    add_adapters(seeded, lora, 11, SINGLE)
    # Each layer its own, each rank holding some of the other's experts, a local order not the ids'.
    placement = ExpertPlacement(2, ((5, 0, 3, 1, 4, 2), (2, 4, 1, 0, 3, 5)))
    for ep_rank in range(2):
        layout = Layout(ep_rank, 2, 2, None, None)
        read = MixtralForCausalLM(m, TORCH, layout, LoopTier(), placement=placement)
        load_hf_weights(read, tmp_path / "base", layout)
        add_adapters(read, lora, 0, layout)
        load_adapter(read, tmp_path / "adapter", run_config(lora), layout)
        made = MixtralForCausalLM(m, TORCH, layout, LoopTier(), placement=placement)
        init_weights(made, 5, layout)
        add_adapters(made, lora, 11, layout)
        for rank_model, whole_model in ((read, whole), (made, seeded)):
            wholes = dict(whole_model.named_parameters())
            for name, p in rank_model.named_parameters():
                if is_expert_param(name):
                    held = placement.held(int(name.split(".")[2]), ep_rank, m.num_experts)
                    assert torch.equal(p, wholes[name][held]), f"rank {ep_rank}: {name}"


def test_placed_runs_train_as_in_order_and_export_by_expert_id(tmp_path, launch_planned):
    launch_planned(2)
    in_order_losses, in_order = train_ep(tmp_path, "in_order", 2, 2)
    results, placed, _ = train_and_save(tmp_path / "placed", PLACED, 2)
    placement = placement_by_recorded_load(LOAD, 2, 4, 2)
    assert results["losses"] == in_order_losses  # bit for bit: each expert met the same rows
    load, in_order_load = (json.loads((tmp_path / run / "results.json").read_text())["expert_load"]
                           for run in ("placed", "in_order"))
    assert load["placement"] == placement.record() and "placement" not in in_order_load
    assert load["tokens_per_expert"] == in_order_load["tokens_per_expert"]  # logged by expert id

    export = hf_export(tmp_path / "placed" / "hf")
    for name in in_order[0]:
        if not is_expert_param(name):
            assert all(torch.equal(rank[name], in_order[0][name]) for rank in placed), name
            continue
        whole = torch.cat([rank[name] for rank in in_order])
        layer = int(name.split(".")[2])
        for ep_rank, rank in enumerate(placed):
            assert torch.equal(rank[name], whole[placement.held(layer, ep_rank, 4)]), f"rank {ep_rank}: {name}"
        stem = f"model.layers.{layer}.block_sparse_moe.experts"
        for expert in range(4):
            parts = ("w1", "w3") if name.endswith("gate_up_proj") else ("w2",)
            got = torch.cat([export[f"{stem}.{expert}.{part}.weight"] for part in parts])
            assert torch.equal(got, whole[expert]), f"export of expert {expert}: {name}"


def hf_export(folder: Path) -> dict[str, torch.Tensor]:
    return {key: t for file in folder.glob("*.safetensors") for key, t in load_file(file).items()}


def test_a_placed_lora_run_resumes_exactly_and_exports_by_expert_id(tmp_path, launch_planned):
    """Its checkpoint holds the adapters in slot order, its export the merged weights by id."""
    launch_planned(2)
    in_order_losses, in_order = train_ep(tmp_path, "in_order", 2, 2, *LORA)
    results, resumed, _ = train_and_save(tmp_path / "placed", PLACED_LORA, 2)
    whole_results = json.loads((tmp_path / "placed" / "whole" / "results.json").read_text())
    assert results["losses"] == whole_results["losses"] == in_order_losses
    placement = placement_by_recorded_load(LOAD, 2, 4, 2)
    export, whole_export = (hf_export(tmp_path / "placed" / run) for run in ("hf", "whole/hf"))
    assert export.keys() == whole_export.keys() and all(torch.equal(export[k], whole_export[k]) for k in export)
    expert_adapters = [name for name in in_order[0] if is_adapter_param(name) and is_expert_param(name)]
    assert expert_adapters
    for name in expert_adapters:
        whole = torch.cat([rank[name] for rank in in_order])
        layer = int(name.split(".")[2])
        for ep_rank, rank in enumerate(resumed):
            assert torch.equal(rank[name], whole[placement.held(layer, ep_rank, 4)]), f"rank {ep_rank}: {name}"
    for layer, stack in itertools.product(range(2), ("gate_up_proj", "down_proj")):
        stem = f"model.layers.{layer}.mlp.experts"
        base, a, b = (torch.cat([rank[f"{stem}.{what}"] for rank in in_order])
                      for what in (stack, f"adapters.{stack}.A", f"adapters.{stack}.B"))
        want = base + 2.0 * b @ a  # alpha 8 / rank 4
        for expert in range(4):
            parts = ("w1", "w3") if stack == "gate_up_proj" else ("w2",)
            got = torch.cat([export[f"model.layers.{layer}.block_sparse_moe.experts.{expert}.{p}.weight"] for p in parts])
            torch.testing.assert_close(got, want[expert], rtol=1e-6, atol=1e-7, msg=f"layer {layer} {stack} {expert}")


def test_a_resume_keeps_its_checkpoints_placement_at_any_ep_size(tmp_path, launch_planned, capsys):
    """The placed EP=2 checkpoint resumed by one process, with no --ep-placement: its experts are
    read as they were stacked, and the run ends where the in-order one-process run does."""
    launch_planned(1)
    launch_planned(2)
    one_losses, _ = train_ep(tmp_path, "one", 1, 1, *LORA)
    train_and_save(tmp_path / "placed", PLACED_LORA, 2)
    checkpoints = tmp_path / "placed" / "ckpt"
    (checkpoints / "latest").write_text("step-000002")  # as if killed after its step-2 checkpoint
    proc = run_cli([*EP_ARGS, "--ep-size", "1", *LORA, "--checkpoint-dir", str(checkpoints), "--resume",
                    "--output-dir", str(tmp_path / "resumed"), "--plots", "false"])
    assert proc.returncode == 0, proc.stderr
    assert (f"one rank holds every expert, in the order in which checkpoint {checkpoints / 'step-000002'} placed them "
            f"(by the load of {LOAD})") in proc.stdout
    results = json.loads((tmp_path / "resumed" / "results.json").read_text())
    assert "placement" not in results["expert_load"]  # not a placed run's: one rank has no balance to place for
    losses = results["losses"]
    assert losses[2:] == pytest.approx(one_losses[2:], rel=1e-5)  # another layout: the same to rounding


def test_a_resume_refuses_a_placement_file_that_no_longer_places_as_its_checkpoint(tmp_path, launch_planned):
    launch_planned(2)
    train_and_save(tmp_path / "placed", PLACED_LORA, 2)
    checkpoints = tmp_path / "placed" / "ckpt"
    resume = [*EP_ARGS, "--ep-size", "2", *LORA, "--checkpoint-dir", str(checkpoints), "--resume", "--steps", "9"]

    def placement_of(*extra: str) -> ExpertPlacement:
        args, overrides = parse_args([*resume, *extra])
        return run_placement(load_config(args.config, overrides, world_size=2))

    saved = placement_by_recorded_load(LOAD, 2, 4, 2)
    assert placement_of() == saved and placement_of("--ep-placement", LOAD) == saved
    edited = tmp_path / "edited.json"
    edited.write_text(json.dumps({"expert_load": {"tokens_per_expert": [[1, 1, 9, 9], [9, 1, 9, 1]]}}))
    with pytest.raises(UserError, match=(
            f"^checkpoint {checkpoints / 'step-000005'} holds its experts placed by the load ep_placement {LOAD} "
            f"recorded then, not as ep_placement {edited} places them at its EP=2: resume without --ep-placement "
            r"\(a resume keeps its checkpoint's placement\)$")):
        placement_of("--ep-placement", str(edited))

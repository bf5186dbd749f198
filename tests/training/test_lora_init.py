"""LoRA from an exported adapter (`lora.init`), as PEFT's users go on training from one: a run
started from another's `--save-adapter` export takes its settings and starts exactly where that
run ended (the adapters, and so the first step's loss, bit for bit in fp32), at EP=1 and at
EP=2 over gloo ranks, each rank reading its own experts' adapters; and what no run can start
from is refused in one line: a folder that is no adapter, settings given otherwise than the
adapter's, an adapter over another base or another commit of it, of targets or kinds ours
cannot hold, a file that does not fit (a PeftModel's own state_dict, its keys named by its
default adapter, fits, as PEFT loads it). (A PEFT-made adapter gives our model PEFT's logits:
tests/model/test_lora.py; a resume reads its checkpoint instead: tests/training/test_lora_run.py.)"""

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from conftest import REPO
from launch import RUN_DIR, WORKER, assert_one_line_error, run_cli, run_worker
from model.test_lora import small_tokenizer
from safetensors.torch import load_file, save_file

from te_mixtral.config import load_config
from te_mixtral.distributed.layout import Layout
from te_mixtral.errors import UserError
from te_mixtral.lora_config import peft_config, require_adapter_revision
from te_mixtral.training.loop import build_model
from te_mixtral.training.outputs import check_outputs
from te_mixtral.training.peft_adapters import PREFIX, save_adapter

SCRIPT = "tests/workers/lora_init.py"
# The base both runs train over (tests/workers/lora_init.py writes it), and their data.
BASE = dict(vocab_size=512, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
ARGS = [RUN_DIR, json.dumps(BASE), "--timing_warmup_steps", "0", "--batch_size", "2", "--seq_len", "64",
        "--max_documents", "50"]
PLANNED_RUNS = {nproc: [[WORKER, SCRIPT, *ARGS, "--ep-size", str(nproc)]] for nproc in (1, 2)}
SINGLE = Layout(0, 1, 1, None, None)
# The adapter config tests/lora_adapter holds (r 2, lora_alpha 4, q_proj, v_proj and the experts' down_proj).
ADAPTER = REPO / "tests" / "lora_adapter"
HUB_BASE = "mistralai/Mixtral-8x7B-v0.1"  # a name only: nothing is downloaded


@pytest.mark.parametrize("nproc", [1, 2], ids=["ep1", "ep2"])
def test_a_run_from_an_exported_adapter_starts_where_the_exporting_run_ended(tmp_path, launch_planned, nproc):
    launch_planned(nproc)
    proc = run_worker(tmp_path, SCRIPT, [*ARGS, "--ep-size", str(nproc)], nproc)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "te_mixtral: LoRA adapters from " in proc.stdout and "the optimizer starts afresh" in proc.stdout
    # It took the adapter's settings, each away from its default, none given.
    saved = json.loads((tmp_path / "b" / "results.json").read_text())["header"]["config"]
    assert {key: saved["lora"][key] for key in ("rank", "alpha", "rslora", "targets")} == {
        "rank": 2, "alpha": 5.0, "rslora": True, "targets": "q_proj,o_proj,gate_up_proj,down_proj"}
    assert Path(saved["data"]["tokenizer"]).name == "adapter"  # the exporting run's BPE, from its export
    for rank in range(nproc):
        ran = torch.load(tmp_path / f"rank{rank}.pt")
        assert ran["first_loss"] == ran["last_loss"], rank  # the same bits: the same adapters, scale and base
        last, started = ran["last"], ran["started"]
        assert last.keys() == started.keys()
        assert {".self_attn.", ".experts."} <= {part for name in last for part in (".self_attn.", ".experts.")
                                               if part in name}
        # Each B starts at zero: one that moved trained, so equal adapters say something.
        assert all(last[name].abs().max() > 0 for name in last if name.endswith(".B"))
        for name, weight in last.items():  # an EP rank's experts are its own, as in the exporting run
            assert torch.equal(started[name], weight), f"rank {rank} {name}"


def write_adapter(folder: Path, **changes) -> Path:
    """tests/lora_adapter's config with `changes` (None: the field left out), in `folder`."""
    config = {**json.loads((ADAPTER / "adapter_config.json").read_text()), **changes}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None}))
    return folder


TINY = str(REPO / "configs" / "tiny.yaml")


def test_the_adapters_settings_are_taken_where_none_are_given(tmp_path):
    cfg = load_config(TINY, {"lora.init": str(ADAPTER)})
    assert (cfg.lora.rank, cfg.lora.alpha, cfg.lora.rslora, cfg.lora.targets) == (2, 4.0, False,
                                                                                   "q_proj,v_proj,down_proj")
    # Given as the adapter has them, in another order or spelling, they are the same.
    same = {"lora.rank": "2", "lora.alpha": "4", "lora.targets": "down_proj,q_proj,v_proj"}
    assert load_config(TINY, {"lora.init": str(ADAPTER), **same}).lora.target_list() == ("down_proj", "q_proj",
                                                                                         "v_proj")
    spelled = write_adapter(tmp_path / "spelled", target_modules=["self_attn.q_proj", "v_proj", "q_proj"],
                            target_parameters=["experts.down_proj"], lora_alpha=4.5, use_rslora=True)
    assert load_config(TINY, {"lora.init": str(spelled)}).lora.targets == "q_proj,v_proj,down_proj"
    # Dropout acts only while training, so it does not change what the adapters compute: the adapter's is
    # taken where the run gives none, and a run may train on with another (PEFT's from_pretrained takes a config).
    dropped = write_adapter(tmp_path / "dropped", lora_dropout=0.125)
    assert load_config(TINY, {"lora.init": str(dropped)}).lora.dropout == 0.125
    assert load_config(TINY, {"lora.init": str(dropped), "lora.dropout": "0.25"}).lora.dropout == 0.25
    # A config file's lora.init with LoRA turned off on the command line: off, as the file's other lora keys.
    config = tmp_path / "lora.yaml"
    config.write_text((REPO / "configs" / "tiny.yaml").read_text() + f"lora:\n  rank: 2\n  init: {ADAPTER}\n")
    assert not load_config(str(config), {"lora.rank": "0"}).lora.enabled


def test_the_adapters_tokenizer_is_the_runs_unless_one_is_given(tmp_path):
    # The adapters learnt its token ids (an export writes the run's beside them), which need not be the base's.
    folder = write_adapter(tmp_path / "adapter")
    shutil.copyfile(REPO / "examples" / "chat-tokenizer" / "tokenizer.json", folder / "tokenizer.json")
    assert load_config(TINY, {"lora.init": str(folder)}).data.tokenizer == str(folder)
    other = str(REPO / "examples" / "chat-tokenizer")
    assert load_config(TINY, {"lora.init": str(folder), "data.tokenizer": other}).data.tokenizer == other
    assert load_config(TINY, {"lora.init": str(ADAPTER)}).data.tokenizer is None  # it has none


@pytest.mark.parametrize("changes, overrides, fragment", [
    (None, {}, "is not an adapter folder: it has no adapter_config.json"),
    ({"peft_type": "IA3"}, {}, "holds a IA3 adapter, not LoRA"),
    ({}, {"lora.rank": "4"}, "holds adapters of r 2, and lora.rank is 4: drop lora.rank (the adapter's is taken)"),
    ({}, {"lora.alpha": "8"}, "holds adapters of lora_alpha 4.0, and lora.alpha is 8.0: drop lora.alpha"),
    ({}, {"lora.rslora": "true"}, "holds adapters of use_rslora False, and lora.rslora is True"),
    ({}, {"lora.targets": "q_proj,v_proj"},
     "holds adapters of targets q_proj,v_proj,down_proj, and lora.targets is q_proj,v_proj"),
    ({}, {"lora.rank": "0"}, "lora.init starts LoRA adapters from an exported one: drop lora.rank 0"),
    ({"base_model_name_or_path": "/elsewhere/base"}, {"model_path": HUB_BASE},
     f"holds adapters trained over /elsewhere/base, and this run's base is --model {HUB_BASE}: pass --model "
     "/elsewhere/base"),
    ({"base_model_name_or_path": HUB_BASE}, {},
     f"holds adapters trained over {HUB_BASE}, and this run's base is made from the seed: pass --model {HUB_BASE}"),
    ({"target_modules": ["q_proj", "gate"]}, {}, "adapts 'gate', which te_mixtral's LoRA cannot hold"),
    ({"target_modules": ["layers.0.self_attn.q_proj"]}, {}, "adapts 'layers.0.self_attn.q_proj', which"),
    ({"target_parameters": ["mlp.experts.w1"]}, {}, "adapts 'mlp.experts.w1', which"),
    ({"target_modules": "all-linear"}, {}, "names its targets by a pattern ('all-linear')"),
    ({"target_modules": [], "target_parameters": []}, {}, "adapts no projection"),
    ({"use_dora": True}, {}, "holds DoRA's magnitude vectors (use_dora)"),
    ({"alpha_pattern": {"q_proj": 8}}, {}, "holds alphas of their own on some projections (alpha_pattern)"),
    ({"layers_to_transform": [0]}, {}, "holds adapters on some layers only (layers_to_transform)"),
    ({"bias": "lora_only"}, {}, "trains biases (bias lora_only)"),
    # Settings that change what the adapters compute, which the loaded weights alone do not say.
    ({"alora_invocation_tokens": [5, 6]}, {}, "(alora_invocation_tokens)"),
    ({"use_qalora": True}, {}, "(use_qalora)"),
    ({"arrow_config": {"top_k": 3}}, {}, "(arrow_config)"),
    ({"a_later_peft_setting": 1}, {}, "holds a_later_peft_setting 1, a PEFT setting te_mixtral's LoRA does not have"),
    ({"r": 0}, {}, "r must be a positive whole number, got 0"),
    ({"lora_dropout": 1.5}, {}, "lora_dropout must be a number in [0, 1), got 1.5"),
    ({"lora_dropout": True}, {}, "lora_dropout must be a number in [0, 1), got True"),
])
def test_what_no_run_can_start_from_is_refused_in_one_line(tmp_path, changes, overrides, fragment):
    folder = tmp_path / "adapter" if changes is None else write_adapter(tmp_path / "adapter", **changes)
    with pytest.raises(UserError) as raised:
        load_config(TINY, {"lora.init": str(folder), **overrides})
    assert fragment in str(raised.value) and "\n" not in str(raised.value)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """Adapters exported from a model made from tiny.yaml, with tests/lora_adapter's settings."""
    folder = tmp_path_factory.mktemp("exported")
    cfg = load_config(TINY, {"lora.rank": "2", "lora.alpha": "4", "lora.targets": "q_proj,v_proj,down_proj"})
    model, _ = build_model(cfg, SINGLE, torch.device("cpu"))
    save_adapter(model, folder, cfg, SINGLE, small_tokenizer())
    return folder, load_file(folder / "adapter_model.safetensors")


@pytest.mark.parametrize("damage, fragment", [
    (lambda t: t.pop(f"{PREFIX}model.layers.1.self_attn.v_proj.lora_B.weight"),
     "lacks 'base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight', which this run's adapters need"),
    (lambda t: t.update({f"{PREFIX}model.layers.0.self_attn.k_proj.lora_A.weight": torch.zeros(2, 64)}),
     "holds 'base_model.model.model.layers.0.self_attn.k_proj.lora_A.weight', which none of this run's adapters"),
    (lambda t: t.update({f"{PREFIX}model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(3, 64)}),
     "tensor 'base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight' has shape [3, 64], the model needs "
     "[2, 64]"),
    (lambda t: t[f"{PREFIX}model.layers.0.mlp.experts.lora_B.weight"].fill_(float("nan")), "not finite"),
    (lambda t: t.update({f"{PREFIX}model.layers.1.self_attn.q_proj.lora_B.default.weight": torch.zeros(64, 2)}),
     "holds 'base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight' twice, as "),
    (lambda t: t.clear(), None),
], ids=["missing", "extra", "shape", "nan", "twice", "no-file"])
def test_adapter_weights_that_do_not_fit_are_refused_in_one_line(tmp_path, exported, damage, fragment):
    source, tensors = exported
    folder = write_adapter(tmp_path / "adapter", **json.loads((source / "adapter_config.json").read_text()))
    tensors = {key: t.clone() for key, t in tensors.items()}
    damage(tensors)
    if tensors:
        save_file(tensors, folder / "adapter_model.safetensors")
    cfg = load_config(TINY, {"lora.init": str(folder)})
    with pytest.raises(UserError) as raised:
        build_model(cfg, SINGLE, torch.device("cpu"))
    assert (fragment or "has no adapter_model.safetensors") in str(raised.value) and "\n" not in str(raised.value)
    # The untouched file loads.
    save_file(exported[1], folder / "adapter_model.safetensors")
    build_model(cfg, SINGLE, torch.device("cpu"))


def test_keys_that_carry_pefts_default_adapter_name_load_as_peft_loads_them(tmp_path, exported):
    # A file of the PeftModel's own state_dict (`...lora_A.default.weight`, not save_pretrained's
    # `...lora_A.weight`): PeftModel.from_pretrained loads it into its default adapter, so it is read alike;
    # under another adapter name PEFT loads nothing of it (the adapters stay as they started), so it is refused.
    source, tensors = exported
    cfg = load_config(TINY, {"lora.init": str(source)})
    want = {name: p.detach().clone() for name, p in build_model(cfg, SINGLE, torch.device("cpu"))[0].named_parameters()
            if name.endswith((".A", ".B"))}
    for name, fragment in (("default", None), ("other", "'base_model.model.model.layers.0.mlp.experts.lora_A.other."
                                                          "weight' carries the adapter name 'other'")):
        folder = write_adapter(tmp_path / name, **json.loads((source / "adapter_config.json").read_text()))
        save_file({re.sub(r"\.(lora_[AB])\.", rf".\1.{name}.", key): t for key, t in tensors.items()},
                  folder / "adapter_model.safetensors")
        cfg = load_config(TINY, {"lora.init": str(folder)})
        if fragment is None:
            got = dict(build_model(cfg, SINGLE, torch.device("cpu"))[0].named_parameters())
            assert all(torch.equal(got[key], weight) for key, weight in want.items())
            continue
        with pytest.raises(UserError) as raised:
            build_model(cfg, SINGLE, torch.device("cpu"))
        assert fragment in str(raised.value) and "lora_A.weight" in str(raised.value)
        assert "\n" not in str(raised.value)


@pytest.mark.parametrize("made_on, refused", [("1" * 40, False), ("2" * 40, True), ("main", False), (None, False)],
                         ids=["same-commit", "other-commit", "branch", "none"])
def test_an_adapter_made_on_another_revision_of_the_hub_base_is_refused(tmp_path, monkeypatch, made_on, refused):
    # adapter_config.json's revision: the base's revision the adapter was made on (get_peft_model's revision).
    # A commit is compared with the one the run's hub cache holds; a branch, which moves, cannot be.
    import huggingface_hub.constants
    from test_cli_errors import hub_cache

    from te_mixtral.model.hf_config import hub_revision, resolve_model_path
    from te_mixtral.training.hf_checkpoint import adopt_checkpoint

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    hub_cache(tmp_path / "hub", "1" * 40)
    folder = write_adapter(tmp_path / "adapter", base_model_name_or_path="owner/tiny", revision=made_on)
    if refused:  # as a run meets it
        assert_one_line_error(run_cli(["--model", "owner/tiny", "--lora.init", str(folder)]),
                              f"lora.init {folder} holds adapters made on revision {made_on} of owner/tiny, and this "
                              f"run's --model owner/tiny is its revision {'1' * 40}")
        return
    model_dir = resolve_model_path("owner/tiny")
    cfg = adopt_checkpoint(load_config(None, {"model_path": "owner/tiny", "lora.init": str(folder)}), model_dir, 1)
    require_adapter_revision(cfg, hub_revision(model_dir))  # the run's check, as train makes it


def test_an_export_names_its_base_as_peft_loads_it_from_anywhere(tmp_path, monkeypatch):
    # A hub id as given (a path of the trainer's machine would mean nothing on the hub); a local folder by its
    # whole path, which loads from any folder (PEFT writes a relative one as given: from that folder alone).
    assert peft_config(load_config(TINY, {"lora.rank": "2", "model_path": HUB_BASE}))["base_model_name_or_path"] == (
        HUB_BASE)
    (tmp_path / "base").mkdir()
    monkeypatch.chdir(tmp_path)
    assert peft_config(load_config(TINY, {"lora.rank": "2", "model_path": "base"}))["base_model_name_or_path"] == str(
        (tmp_path / "base").resolve())


def test_an_export_into_the_adapter_the_run_starts_from_is_refused(tmp_path):
    cfg = load_config(TINY, {"lora.init": str(ADAPTER), "model_path": HUB_BASE, "save_adapter": str(ADAPTER),
                             "output_dir": str(tmp_path / "out")})
    with pytest.raises(UserError, match=re.escape(f"save_adapter {ADAPTER} would write into the lora.init adapter")):
        check_outputs(cfg, None)

"""Settings that would train wrongly or crash later are refused before anything runs, each
with one line naming the key."""

import json
import re
from pathlib import Path
from unittest import mock

import pytest
import yaml
from conftest import REPO
from launch import assert_one_line_error, run_cli

from te_mixtral.config import load_config, load_run_config, save_config, settings, to_dict
from te_mixtral.config_checks import value_of
from te_mixtral.errors import UserError
from te_mixtral.saved_config import saved_yaml


@pytest.mark.parametrize("key, value, fragment", [
    ("grad_clip", "-1", "train.grad_clip must be a finite norm above 0"),  # reversed gradients, exit 0
    ("grad_clip", "0", "train.grad_clip must be a finite norm above 0"),  # never learns
    ("grad_clip", ".inf", "train.grad_clip must be a finite norm above 0"),
    ("batch_size", "0", "train.batch_size must be positive"),
    ("batch_size", "-4", "train.batch_size must be positive"),
    ("beta1", "1", "train.beta1 must be in [0, 1)"),
    ("beta2", "1.5", "train.beta2 must be in [0, 1)"),
    ("beta2", "-0.1", "train.beta2 must be in [0, 1)"),
    ("lr", ".inf", "a finite lr > 0"),
    ("lr", ".nan", "a finite lr > 0"),
    ("lr", "1e300", "train.lr 1e+300 is past the largest float32"),  # before: AdamW's overflow traceback
    ("weight_decay", "-0.1", "train.weight_decay must be finite and >= 0"),
    ("warmup_steps", "-1", "train.warmup_steps must be 0 or positive"),
    ("max_documents", "-3", "data.max_documents must be positive or null"),
    ("max_documents", "0", "data.max_documents must be positive or null"),
    ("rms_norm_eps", "0", "model.rms_norm_eps must be finite and above 0"),
    ("rms_norm_eps", "-1e-5", "model.rms_norm_eps must be finite and above 0"),
    ("rope_theta", "0", "model.rope_theta must be finite and above 0"),
    ("initializer_range", ".nan", "model.initializer_range must be finite and above 0"),
    ("fsdp_reduce", "sometimes", "train.fsdp_reduce must be one of step, micro_batch"),
    ("fsdp_reduce", "micro_batch", "train.fsdp_reduce is FSDP's choice, between the micro-batches of a step: "
                                   "it needs train.sharding fsdp and train.grad_accum_steps above 1"),
    ("seed", "-1", "train.seed must be in [0, 2**32)"),
    ("seed", str(2**64), "train.seed must be in [0, 2**32)"),  # before: torch's overflow traceback
    ("output_dir", "runs/" + "x" * 256, "output_dir has a name of 256 bytes"),  # before: OSError traceback
    ("save_hf", "é" * 126, "save_hf has a name of 252 bytes"),  # 'DIR.tmp' would be 256
    ("dataset", "x" * 300 + ".jsonl", "data.dataset has a name of 306 bytes"),
])
def test_bad_setting_is_refused_in_one_line(key, value, fragment):
    with pytest.raises(UserError) as raised:
        load_config(str(REPO / "configs" / "tiny.yaml"), {key: value, "min_lr": "0"})
    assert fragment in str(raised.value) and "\n" not in str(raised.value)


PATH_KEYS = [key for key, f in settings().items() if f.metadata["path"]]


@pytest.mark.parametrize("key", PATH_KEYS)
def test_every_path_key_refuses_an_empty_path_and_an_overlong_name(key):
    """An empty path would stand for the current folder (a tokenizer read from it, a load file
    that is a folder); a name past the filesystem's, an OSError's traceback later on."""
    given = {key: "", "ep_size": "2", "lora.rank": "4", "min_lr": "0"}
    with pytest.raises(UserError, match=f"^{re.escape(key)} is an empty path: name one, or leave it unset"):
        load_config(str(REPO / "configs" / "tiny.yaml"), given, world_size=2)
    with pytest.raises(UserError, match=f"^{re.escape(key)} has a name of 300 bytes"):
        load_config(str(REPO / "configs" / "tiny.yaml"), {**given, key: "x" * 300}, world_size=2)


def test_good_edges_load():
    load_config(str(REPO / "configs" / "tiny.yaml"), {"beta1": "0", "warmup_steps": "0", "weight_decay": "0",
                                                      "max_documents": "1", "seed": str(2**32 - 1),
                                                      "save_hf": "x" * 251, "output_dir": "x" * 255})


def test_a_config_that_is_not_yaml_text_or_expands_without_bound_is_one_line(tmp_path):
    binary = tmp_path / "model.bin"
    binary.write_bytes(bytes(range(256)) * 4)
    with pytest.raises(UserError, match="is not a text file"):
        load_config(str(binary))
    huge = tmp_path / "huge.yaml"
    huge.write_text("# padding\n" * 200_000)
    with pytest.raises(UserError, match="not a config"):
        load_config(str(huge))
    # A "billion laughs": nine levels of nine aliases, 9**9 values under a real key, whose
    # type error would print them all.
    lines = ["laughs: &l0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    lines += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, 9)]
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text("\n".join(["x:", *("  " + line for line in lines), "train:", "  steps: *l8"]))
    levels = ["&l0 [1, 1, 1, 1, 1, 1, 1, 1, 1]"] + [f"&l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, 5)]
    for path, overrides in ((bomb, {}), (None, {"train.steps": f"[{', '.join(levels)}]"})):
        with pytest.raises(UserError, match="more than 10000 values once its YAML aliases are expanded"):
            load_config(path and str(path), overrides)


def test_a_key_given_twice_in_a_config_is_refused_not_dropped(tmp_path):
    # YAML itself forbids it, but PyYAML keeps the last: a second `train:` section appended to
    # override the learning rate silently dropped every key of the first (steps, batch size).
    config = tmp_path / "twice.yaml"
    tiny = (REPO / "configs" / "tiny.yaml").read_text()
    for text, key in ((tiny + "train:\n  lr: 1.0e-3\n", "'train'"), (tiny.replace("  lr:", "  steps: 2\n  lr:"), "'steps'")):
        config.write_text(text)
        with pytest.raises(UserError, match=f"config {config} is not valid YAML: the key {key} is given twice "
                                            f"\\(lines \\d+ and \\d+\\)") as raised:
            load_config(str(config))
        assert "\n" not in str(raised.value)


def test_a_misspelled_section_is_named_as_a_section(tmp_path):
    config = tmp_path / "typo.yaml"
    config.write_text((REPO / "configs" / "tiny.yaml").read_text().replace("model:", "modle:"))
    with pytest.raises(UserError, match=f"unknown config section 'modle' in {config} \\(did you mean model\\? "):
        load_config(str(config))


def test_an_empty_config_file_is_refused_not_killed(tmp_path):
    # An empty file means every default: the full Mixtral-8x7B, far beyond this machine's
    # memory. The estimate refuses it before building anything (before: killed, no message).
    # In this process (measure/test_memory.py starts one that refuses the full model): a run
    # past the estimate is stopped where it would start to build, by this test, not the kernel.
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    with mock.patch("te_mixtral.training.loop.init_layout", side_effect=AssertionError("got past the estimate")):
        proc = run_cli(["--config", str(empty), "--output-dir", str(tmp_path / "out")])
    assert_one_line_error(proc, "needs about")


@pytest.mark.parametrize("overrides, fragment", [
    ({"lora.rank": "-1"}, "lora.rank must be 0 (off) or positive"),
    ({"lora.rank": "8", "lora.alpha": "0"}, "lora.alpha must be finite and above 0"),
    ({"lora.rank": "8", "lora.dropout": "1"}, "lora.dropout must be in [0, 1)"),
    ({"lora.rank": "8", "lora.targets": "q_proj,gate_proj"}, "lora.targets: unknown projection 'gate_proj'"),
    ({"lora.rank": "8", "lora.targets": ","}, "lora.targets names no projection"),
    ({"lora.rank": "8", "lora.targets": "v_proj,v_proj"}, "lora.targets names a projection twice"),
    ({"lora.rank": "8", "optimizer": "master_adamw", "dtype": "bf16"}, "lora trains small fp32 adapters"),
    ({"lora.rank": "8", "sharding": "fsdp"}, "train.sharding fsdp is for full fine-tuning"),
    ({"save_adapter": "out"}, "save_adapter exports LoRA adapters: set lora.rank"),
    # Before: the adapters were written naming no base (base_model_name_or_path null), and nothing could load them.
    ({"lora.rank": "8", "save_adapter": "out"}, "save_adapter out would hold adapters over a base made from the "
     "seed, which no file holds, so PEFT could not load them: make a base folder (python "
     "scripts/make_tiny_mixtral.py tiny-mixtral) and train over it with --model tiny-mixtral, or export the model "
     "with the adapters merged (--save-hf)"),
    ({"lora.base": "nf4"}, "lora.base holds the base frozen for LoRA: set lora.rank"),
    ({"lora.rank": "8", "lora.base": "int4"}, "lora.base must be one of default, nf4, got 'int4'"),
    # tiny.yaml: hidden 64, 2 KV heads of 16; k_proj's update has rank 32 at most, the experts' 64.
    ({"lora.rank": "65"}, "lora.rank 65 is above every adapted projection's rank (at most 64"),
    ({"lora.rank": "33", "lora.targets": "k_proj,v_proj"}, "use --lora.rank 32 or less"),
])
def test_bad_lora_setting_is_refused_in_one_line(overrides, fragment):
    with pytest.raises(UserError) as raised:
        load_config(str(REPO / "configs" / "tiny.yaml"), overrides)
    assert fragment in str(raised.value) and "\n" not in str(raised.value)


@pytest.mark.parametrize("overrides, fragment", [
    ({"expert_moments": "4bit"}, "train.expert_moments must be one of same, 8bit"),
    ({"expert_moments": "8bit"}, "train.expert_moments is master_adamw's"),
    ({"expert_moments": "8bit", "optimizer": "master_adamw", "dtype": "bf16", "intermediate_size": "90"},
     "model.hidden_size x model.intermediate_size (64 x 90) must be a multiple of 256"),
])
def test_bad_expert_moments_setting_is_refused_in_one_line(overrides, fragment):
    with pytest.raises(UserError) as raised:
        load_config(str(REPO / "configs" / "tiny.yaml"), overrides)
    assert fragment in str(raised.value) and "\n" not in str(raised.value)


@pytest.mark.parametrize("tier", ["hf", "hf_eager"])
def test_a_tier_without_adapters_refuses_lora_in_one_line(tier):
    tiny = str(REPO / "configs" / "tiny.yaml")
    with pytest.raises(UserError, match=f"tier '{tier}' does not run LoRA adapters .*tiers that do: loop, "
                                        f"grouped_linear, custom_grouped, device_mxfp8"):
        load_run_config(tiny, {"lora.rank": "8", "tier": tier}, 1)


@pytest.mark.parametrize("tier", ["loop", "grouped_linear", "device_mxfp8"])
def test_only_custom_grouped_holds_an_nf4_base(tier):
    tiny = str(REPO / "configs" / "tiny.yaml")
    load_run_config(tiny, {"lora.rank": "8", "lora.base": "nf4", "tier": "custom_grouped"}, 1)
    with pytest.raises(UserError, match=f"tier '{tier}' cannot hold a frozen base in lora.base nf4; tiers that can: "
                                        "custom_grouped$"):
        load_run_config(tiny, {"lora.rank": "8", "lora.base": "nf4", "tier": tier}, 1)


@pytest.mark.parametrize("overrides, fragment", [
    ({"fp8.mode": "mxfp8-emulated"}, "runs LoRA over a frozen FP8 base in mode fp8-hopper (auto on Hopper) only, "
                                       "not in mode 'mxfp8-emulated'"),
])
def test_device_mxfp8_takes_lora_over_its_hopper_fp8_base_only(overrides, fragment):
    base = {"lora.rank": "8", "tier": "device_mxfp8"}
    load_run_config(str(REPO / "configs" / "tiny.yaml"), base, 1)  # auto: Hopper's FP8 on a GPU
    with pytest.raises(UserError, match=re.escape(fragment)):
        load_run_config(str(REPO / "configs" / "tiny.yaml"), {**base, **overrides}, 1)


@pytest.mark.parametrize("overrides, fragment", [
    ({"ep_capacity": "-1"}, "ep_capacity must be 0 or a finite share above 0"),
    ({"ep_capacity": "1.5"}, "ep_capacity shapes the exchange between expert-parallel ranks: it needs ep_size above 1"),
    ({"ep_capacity": "1.5", "ep_size": "2", "ep_chunks": "2"}, "ep_capacity pads one exchange per layer"),
    ({"ep_capacity": "1.5", "ep_size": "2", "tier": "loop"}, "tier 'loop' needs its split sizes on the host"),
])
def test_padded_exchange_settings_it_cannot_honour_are_refused(overrides, fragment):
    with pytest.raises(UserError) as raised:
        load_run_config(str(REPO / "configs" / "tiny.yaml"), {"tier": "custom_grouped", **overrides}, 2)
    assert fragment in str(raised.value) and "\n" not in str(raised.value)
    load_run_config(str(REPO / "configs" / "tiny.yaml"), {"tier": "custom_grouped", "ep_size": "2",
                                                         "ep_capacity": "1.5"}, 2)


TINY = str(REPO / "configs" / "tiny.yaml")
CHAT_TOKENIZER = str(REPO / "examples" / "chat-tokenizer")
# (a key given where it changes nothing, what turns it on, the refusal, the processes): each
# key that declares what it needs (`setting(needs=...)`) once, and the tiers' own refusals.
IGNORED = [
    ({"lora.alpha": "32"}, {"lora.rank": "4"}, "lora.alpha applies to LoRA adapters: set lora.rank (LoRA is off)", 1),
    ({"lora.dropout": "0.1"}, {"lora.rank": "4"}, "lora.dropout applies to LoRA adapters: set lora.rank", 1),
    ({"lora.rslora": "true"}, {"lora.rank": "4"}, "lora.rslora applies to LoRA adapters: set lora.rank", 1),
    ({"lora.targets": "q_proj,v_proj"}, {"lora.rank": "4"}, "lora.targets applies to LoRA adapters: set lora.rank", 1),
    ({"lora.base": "nf4", "tier": "custom_grouped"}, {"lora.rank": "4"},
     "lora.base holds the base frozen for LoRA: set lora.rank", 1),
    ({"save_adapter": "adapter"}, {"lora.rank": "4", "model_path": "mistralai/Mixtral-8x7B-v0.1"},
     "save_adapter exports LoRA adapters: set lora.rank", 1),
    # With LoRA turned off: lora.init starts adapters, which take the adapter's rank where none is given.
    ({"lora.init": str(REPO / "tests" / "lora_adapter"), "lora.rank": "0"}, {"lora.rank": "2"},
     "lora.init starts LoRA adapters from an exported one: drop lora.rank 0", 1),
    ({"lora.rank": "4", "lora.change_on_resume": "true"}, {"resume": "true", "checkpoint_dir": "ckpt"},
     "lora.change_on_resume lets a LoRA run's resume change its adapters: it needs resume and lora.rank", 1),
    ({"generate_tokens": "10"}, {"generate": "The meaning of"},
     "generate_tokens is the length of generate's continuation: set generate (the prompt)", 1),
    ({"checkpoint_keep": "3"}, {"checkpoint_dir": "ckpt"}, "checkpoint_keep needs checkpoint_dir", 1),
    ({"checkpoint_every": "2"}, {"checkpoint_dir": "ckpt"}, "train.checkpoint_every needs checkpoint_dir", 1),
    ({"resume": "true"}, {"checkpoint_dir": "ckpt"}, "resume needs checkpoint_dir", 1),
    ({"save_every": "2"}, {"save_hf": "hf"}, "train.save_every needs save_hf or save_adapter", 1),
    ({"eval_every": "2"}, {"eval_fraction": "0.1"}, "train.eval_every needs held-out data: set data.eval_fraction", 1),
    # The embedded text and local files (one that exists, has a data file's suffix, or is plainly a path) have none.
    *[({"subset": "wikitext-2-raw-v1", **dataset}, {"dataset": "someone/corpus"},
       "data.subset names a subset of a hub data set, and data.dataset is not one", 1)
      for dataset in ({}, {"dataset": "my_data.jsonl"}, {"dataset": "./corpus"}, {"dataset": str(REPO / "examples")})],
    ({"data.text_field": "body", "format": "chat", "tokenizer": CHAT_TOKENIZER}, {"format": "text"},
     "data.text_field names the field of data.format text", 1),
    ({"data.messages_field": "conversations"}, {"format": "chat", "tokenizer": CHAT_TOKENIZER},
     "data.messages_field maps the messages of data.format chat", 1),
    ({"role_key": "from"}, {"format": "chat", "tokenizer": CHAT_TOKENIZER}, "data.role_key maps the messages", 1),
    ({"content_key": "value"}, {"format": "chat", "tokenizer": CHAT_TOKENIZER},
     "data.content_key maps the messages", 1),
    ({"roles": "human:user"}, {"format": "chat", "tokenizer": CHAT_TOKENIZER}, "data.roles maps the messages", 1),
    ({"moment_dtype": "fp32", "dtype": "bf16"}, {"optimizer": "master_adamw"},
     "train.moment_dtype is master_adamw's choice", 1),
    ({"expert_moments": "8bit", "dtype": "bf16"}, {"optimizer": "master_adamw"},
     "train.expert_moments is master_adamw's", 1),
    ({"recompute_layers": "1"}, {"recompute": "full"}, "train.recompute_layers counts the layers that recompute", 1),
    ({"fsdp_reduce": "micro_batch", "sharding": "fsdp"}, {"grad_accum_steps": "2"},
     "train.fsdp_reduce is FSDP's choice, between the micro-batches of a step: it needs train.sharding fsdp "
     "and train.grad_accum_steps above 1", 2),
    ({"fp8.mode": "mxfp8-emulated"}, {"tier": "device_mxfp8"},
     "fp8.mode is tier device_mxfp8's option: it needs tier device_mxfp8", 1),
    ({"fp8.min_rows_per_expert": "0"}, {"tier": "device_mxfp8"},
     "fp8.min_rows_per_expert is tier device_mxfp8's threshold on Hopper", 1),
    ({"fp8.min_rows_per_expert": "0", "tier": "device_mxfp8", "fp8.mode": "mxfp8-emulated"},
     {"fp8.mode": "fp8-hopper"}, "it needs tier device_mxfp8 in fp8.mode auto or fp8-hopper", 1),
    ({"ep_chunks": "2"}, {"ep_size": "2"},
     "ep_chunks shapes the exchange between expert-parallel ranks: it needs ep_size above 1", 2),
    ({"ep_capacity": "1.5", "tier": "custom_grouped"}, {"ep_size": "2"},
     "ep_capacity shapes the exchange between expert-parallel ranks: it needs ep_size above 1", 2),
    ({"ep_placement": "tests/recorded_load.json"}, {"ep_size": "2"},
     "ep_placement places te_mixtral's experts on the expert-parallel ranks: it needs ep_size above 1", 2),
    ({"te_fusions": "false", "backend": "torch"}, {"backend": "te"},
     "te_fusions switches the te backend's fusions: it needs backend te (or auto on a CUDA device)", 1),
    ({"te_fusions": "false", "device": "cpu"}, {"device": "auto"}, "te_fusions switches the te backend's fusions", 1),
    ({"te_fusions": "false", "tier": "hf"}, {"tier": "loop"},
     "te_fusions switches the te backend's fusions: it needs backend te (or auto on a CUDA device) in one of "
     "te_mixtral's tiers (hf and hf_eager run transformers' model)", 1),
    ({"backend": "torch", "tier": "hf_eager"}, {"tier": "loop"},
     "backend picks the layers of te_mixtral's own model; tiers hf and hf_eager run transformers' model", 1),
    ({"profile_phases": "true", "tier": "hf"}, {"tier": "grouped_linear"},
     "profile_phases times the phases of te_mixtral's own model; tiers hf and hf_eager run transformers' model", 1),
    ({"recompute": "full", "tier": "hf_eager"}, {"tier": "loop"},
     "train.recompute applies to te_mixtral's own model; tiers hf and hf_eager run transformers' model", 1),
    ({"fp8.weight_cache": "false", "tier": "device_mxfp8", "lora.rank": "4"}, {"lora.rank": "0"},
     "fp8.weight_cache is for tier device_mxfp8 in mode fp8-hopper (auto on Hopper)", 1),
    ({"fp8.min_rows_per_expert": "0", "tier": "device_mxfp8", "lora.rank": "4"}, {"lora.rank": "0"},
     "fp8.min_rows_per_expert is tier device_mxfp8's threshold on Hopper", 1),
    ({"fp8.weight_cache": "false"}, {"tier": "device_mxfp8"},
     "fp8.weight_cache is for tier device_mxfp8 in mode fp8-hopper (auto on Hopper)", 1),
    ({"tokenizer_vocab_size": "300", "tokenizer": CHAT_TOKENIZER}, {"tokenizer": "null"},
     "data.tokenizer_vocab_size sizes the BPE trained on text data that brings no tokenizer", 1),
    ({"tokenizer_vocab_size": "300", "model_path": CHAT_TOKENIZER},  # a folder with a tokenizer.json, as a checkpoint's
     {"model_path": "null"}, "data.tokenizer_vocab_size sizes the BPE trained on text data", 1),
    # A hub id's tokenizer.json comes with it (downloaded when the run starts).
    ({"tokenizer_vocab_size": "300", "model_path": "mistralai/Mixtral-8x7B-v0.1"},
     {"model_path": "null"}, "data.tokenizer_vocab_size sizes the BPE trained on text data", 1),
    # model_path's config.json is the model: each key of the model section given beside it
    # (but the router losses' weights, training choices that apply) was replaced, unsaid.
    *[({"model_path": "mistralai/Mixtral-8x7B-v0.1", key: value}, {"model_path": "null"},
       f"model.{key} comes from model_path's config.json", 1) for key, value in (
        ("vocab_size", "4096"), ("hidden_size", "128"), ("intermediate_size", "128"), ("num_hidden_layers", "1"),
        ("num_attention_heads", "8"), ("num_key_value_heads", "1"), ("head_dim", "8"), ("num_experts", "2"),
        ("num_experts_per_tok", "1"), ("rms_norm_eps", "1e-6"), ("rope_theta", "10000"),
        ("max_position_embeddings", "512"), ("initializer_range", "0.01"), ("tie_word_embeddings", "true"))],
]


@pytest.mark.parametrize("ignored, enabler, fragment, world", IGNORED)
def test_a_key_that_would_change_nothing_is_refused_naming_what_it_needs(ignored, enabler, fragment, world):
    # Before, each of the first kind loaded, and the run ignored the key (exit 0).
    with pytest.raises(UserError) as raised:
        load_run_config(TINY, ignored, world)
    assert fragment in str(raised.value) and "\n" not in str(raised.value)
    load_run_config(TINY, {**ignored, **enabler}, world)


def _needs_keys():
    """(full key, others, enabled, world) for every key that declares what it needs, once,
    from its IGNORED case: the other keys of the case make a run where it changes nothing,
    `enabled` one where it changes something at a value other than its default."""
    keys, seen = settings(), set()
    for ignored, enabler, fragment, world in IGNORED:
        key = re.match(r"\S+", fragment)[0]
        if key not in keys or keys[key].metadata["needs"] is None or key in seen:  # a tier's refusal, or done
            continue
        seen.add(key)
        others = {k: v for k, v in ignored.items() if k.rpartition(".")[2] != key.rpartition(".")[2]}
        yield key, others, {**ignored, **enabler}, world


def _with_key(config: dict, key: str, value) -> dict:
    """`config` (a `to_dict`) with the full `key` set to `value`."""
    section, _, name = key.rpartition(".")
    return {**config, section: {**config[section], name: value}} if section else {**config, key: value}


def _typed(value) -> str:
    """A value as a user types it after `--key`."""
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def test_a_key_typed_on_the_command_line_at_its_default_is_refused_too():
    # Before, each loaded (exit 0): check_needs left a key at its default alone, a saved config's
    # leniency, and the run ignored it. Beside --model, the checkpoint's config.json is the model
    # whatever --num_experts says; over tiny.yaml, 8 is the default and 4 the file's.
    hub = "mistralai/Mixtral-8x7B-v0.1"
    for config, typed in [(TINY, {"num_experts": "8"}), (TINY, {"num_experts": "4"}), (None, {"hidden_size": "4096"})]:
        with pytest.raises(UserError, match=r"^model\.\w+ comes from model_path's config.json[^\n]*$"):
            load_config(config, {"model_path": hub, **typed})
    # Every key that declares what it needs, typed at its default where that does not hold.
    keys, seen = settings(), set()
    for key, others, _, world in _needs_keys():
        seen.add(key)
        with pytest.raises(UserError, match=rf"^{re.escape(key)} [^\n]*$"):
            load_run_config(TINY, {**others, key: _typed(keys[key].default)}, world)
    assert seen == {key for key, f in keys.items() if f.metadata["needs"] is not None}


def test_a_saved_config_loads_every_key_as_saved_where_a_hand_written_one_is_refused(tmp_path):
    """A run saves every key, not only those asked for, each at its value of the day: a key
    that changes nothing in its run loads back at its saved value, even where that is no
    longer the default. The same file written by hand (no mark) is refused, as the command
    line is."""
    # Before, a saved config was refused for any such key away from today's default (as the
    # committed runs that saved fp8.min_rows_per_expert 3072, the default of their day, were).
    fields, keys = settings(), set()
    for key, others, enabled, world in _needs_keys():
        keys.add(key)
        value = value_of(load_run_config(TINY, enabled, world), key)
        config = _with_key(to_dict(load_run_config(TINY, others, world)), key, value)
        saved, by_hand = tmp_path / f"{key}.yaml", tmp_path / f"{key}-by-hand.yaml"
        saved.write_text(saved_yaml(config))
        by_hand.write_text(saved_yaml(config).partition("\n")[2])
        assert to_dict(load_run_config(str(saved), world_size=world)) == config, key
        with pytest.raises(UserError) as refused:
            load_run_config(str(by_hand), world_size=world)
        # This key, or one before it that changes nothing either (beside model_path, tiny.yaml's model keys).
        named = str(refused.value).split()[0]
        assert str(refused.value) == f"{named} {fields[named].metadata['needs'].text}", key
    assert keys == {key for key, f in fields.items() if f.metadata["needs"] is not None}


def test_a_saved_config_edited_by_hand_is_checked_as_written_by_hand(tmp_path):
    # A run's config.yaml copied and edited keeps its first line: before, the mark alone made it
    # saved, so an fp8 threshold edited into a loop run's config was taken and ignored, silently.
    saved = tmp_path / "config.yaml"
    save_config(load_config(TINY, {"tier": "loop"}), saved)
    mark, body = saved.read_text().split("\n", 1)
    saved.write_text(f"{mark}\n# a comment and the keys in another order change nothing\n"
                     + yaml.safe_dump(yaml.safe_load(body), sort_keys=True))
    assert load_config(str(saved)).tier == "loop"
    config = yaml.safe_load(body)
    config["fp8"]["min_rows_per_expert"] = 1000
    saved.write_text(f"{mark}\n" + yaml.safe_dump(config, sort_keys=False))
    with pytest.raises(UserError, match=f"^fp8.min_rows_per_expert is tier device_mxfp8's threshold.* \\(config "
                                        f"{saved} was edited since its run saved it, so it is checked as one "
                                        f"written by hand\\)$"):
        load_config(str(saved))


def test_a_config_saved_before_the_mark_is_known_by_the_results_its_run_wrote_beside_it(tmp_path):
    config = _with_key(to_dict(load_config(TINY, {"tier": "loop"})), "fp8.min_rows_per_expert", 3072)
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(saved_yaml(config).partition("\n")[2])
    refusal = "^fp8.min_rows_per_expert is tier device_mxfp8's threshold"
    for results in ("not json", '["a list"]', json.dumps({"header": {"config": {**config, "tier": "custom_grouped"}}})):
        (run / "results.json").write_text(results)  # not this config's run: a file written by hand
        with pytest.raises(UserError, match=refusal):
            load_config(str(run / "config.yaml"))
    (run / "results.json").write_text(json.dumps({"header": {"config": config}, "losses": [1.0]}))
    assert load_config(str(run / "config.yaml")).fp8.min_rows_per_expert == 3072
    with pytest.raises(UserError, match=refusal):  # typed: asked for in this run
        load_config(str(run / "config.yaml"), {"fp8.min_rows_per_expert": "3072"})


# A tier's own key typed with a tier that never reads it, at its default: transformers' model
# (hf, hf_eager) has none of te_mixtral's layers, and a LoRA run's frozen FP8 base has no
# weight copies to cache and runs FP8 at every size.
TIER_IGNORES = [
    ({"tier": "hf", "backend": "auto"}, "backend picks the layers of te_mixtral's own model"),
    ({"tier": "hf", "te_fusions": "true"}, "te_fusions switches the te backend's fusions"),
    ({"tier": "hf_eager", "profile_phases": "false"}, "profile_phases times the phases of te_mixtral's own model"),
    ({"tier": "hf", "recompute": "none"}, "train.recompute applies to te_mixtral's own model"),
    ({"tier": "device_mxfp8", "lora.rank": "4", "fp8.weight_cache": "true"}, "fp8.weight_cache is for tier "),
    ({"tier": "device_mxfp8", "lora.rank": "4", "fp8.min_rows_per_expert": "1024"},
     "fp8.min_rows_per_expert is tier device_mxfp8's threshold on Hopper"),
]


@pytest.mark.parametrize("typed, fragment", TIER_IGNORES)
def test_a_tier_key_typed_for_a_tier_that_never_reads_it_is_refused_at_its_default(typed, fragment):
    # Before, each loaded (exit 0): the tier's own checks refused other values only, and the run
    # ignored the key.
    with pytest.raises(UserError) as raised:
        load_run_config(TINY, typed, 1)
    assert str(raised.value).startswith(fragment) and "\n" not in str(raised.value)
    # The same key and value over a tier that reads it loads.
    reads = {"tier": "loop"} if typed["tier"].startswith("hf") else {"lora.rank": "0"}
    load_run_config(TINY, {**typed, **reads}, 1)


def test_every_needs_declaration_names_keys_that_exist_and_is_tested():
    keys = settings()
    declared = {key: f.metadata["needs"] for key, f in keys.items() if f.metadata["needs"] is not None}
    for key, needs in declared.items():
        assert needs.keys and all(k in keys and k != key for k in needs.keys), (key, needs.keys)
        assert needs.holds(*(keys[k].default for k in needs.keys)) in (True, False), key  # takes those keys' values
    refused = {re.match(r"\S+", fragment)[0] for _, _, fragment, _ in IGNORED}
    assert set(declared) <= refused, set(declared) - refused


def test_only_what_the_user_gave_is_refused(tmp_path):
    # A config file that sets a key its run ignores is refused as the command line is.
    config = tmp_path / "lora.yaml"
    config.write_text((REPO / "configs" / "tiny.yaml").read_text() + "lora:\n  alpha: 32\n")
    with pytest.raises(UserError, match=re.escape("lora.alpha applies to LoRA adapters: set lora.rank")):
        load_config(str(config))
    assert load_config(str(config), {"lora.rank": "4"}).lora.scale == 8
    # A run's saved config holds every key, the ones its run ignored at their defaults: it loads again.
    saved = tmp_path / "config.yaml"
    save_config(load_config(TINY, {"generate": "Hi", "lora.rank": "4", "eval_fraction": "0.1"}), saved)
    load_config(str(saved))
    # What a launcher sets (accelerate launch: te_mixtral/accelerate_launch.py) is given too,
    # and turns on what needs it.
    launch = {"train.grad_accum_steps": (2, "ACCELERATE_GRADIENT_ACCUMULATION_STEPS=2"),
              "train.dtype": ("fp32", "accelerate launch --mixed_precision no"),
              "device": ("cpu", "accelerate launch --cpu")}
    cfg = load_config(TINY, {"sharding": "fsdp", "fsdp_reduce": "micro_batch"}, 2, launch)
    assert cfg.train.grad_accum_steps == 2
    with pytest.raises(UserError, match="te_fusions switches the te backend's fusions"):
        load_config(TINY, {"te_fusions": "false"}, 1, launch)


def test_the_command_line_overrides_what_the_config_file_enabled(tmp_path):
    """A config file serves more runs than one: a key it sets, which its own settings enable, is
    left alone where the command line turns off what the key needs (`--model` replaces the
    file's model section, as documented; `--lora.rank 0` turns its LoRA off). What the file
    sets against itself, or the command line against the file, is refused."""
    hub = "mistralai/Mixtral-8x7B-v0.1"
    load_config(TINY, {"model_path": hub})  # tiny.yaml's model section, replaced by the checkpoint's
    lora = tmp_path / "lora.yaml"
    lora.write_text(Path(TINY).read_text() + "lora:\n  rank: 4\n  alpha: 32\n")
    assert load_config(str(lora), {"lora.rank": "0"}).lora.alpha == 32  # before: refused
    with pytest.raises(UserError, match="model.num_hidden_layers comes from model_path's config.json"):
        load_config(str(lora), {"model_path": hub, "num_hidden_layers": "1"})  # before: loaded, then replaced
    # A file that names a checkpoint and a model of its own: the section was replaced, unsaid (before).
    both = tmp_path / "both.yaml"
    both.write_text(Path(TINY).read_text() + f"model_path: {hub}\n")
    with pytest.raises(UserError, match=r"^model.vocab_size comes from model_path's config.json[^\n]*$"):
        load_config(str(both))
    # A file's BPE size, where the command line names a tokenizer (the README's LoRA command), and
    # where the file names one itself.
    load_config(str(REPO / "configs" / "mixtral-8x7b-lora.yaml"), {"format": "chat", "model_path": hub})
    with pytest.raises(UserError, match="data.tokenizer_vocab_size sizes the BPE trained on text data"):
        load_config(str(REPO / "configs" / "mixtral-8x7b-lora.yaml"), {"tokenizer_vocab_size": "300",
                                                                       "tokenizer": CHAT_TOKENIZER})


def test_a_checkpoint_without_a_tokenizer_takes_the_bpe_size(tmp_path):
    # Its run trains a BPE on the data (training/hf_checkpoint.py): the size applies.
    load_config(TINY, {"model_path": str(tmp_path), "tokenizer_vocab_size": "300"})
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(UserError, match="data.tokenizer_vocab_size sizes the BPE trained on text data"):
        load_config(TINY, {"model_path": str(tmp_path), "tokenizer_vocab_size": "300"})


def test_sharding_in_one_process_is_refused():
    with pytest.raises(UserError, match="train.sharding fsdp shards over the ranks, and this is one process"):
        load_config(TINY, {"sharding": "fsdp"})
    load_config(TINY, {"sharding": "fsdp"}, 2)

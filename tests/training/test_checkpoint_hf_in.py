"""HF checkpoints in: both on-disk expert layouts load into EP=1 and EP=2 shards, give HF's
logits, and each rank reads (and holds) its share of the model, not the whole model."""

import json
import time

import pytest
import torch
from conftest import REPO
from hf_reference import random_hf_mixtral
from launch import assert_one_line_error, run_app, run_cli
from safetensors.torch import load_file, save_file
from transformers import MixtralConfig, MixtralForCausalLM

from te_mixtral.config import load_run_config
from te_mixtral.distributed.layout import Layout
from te_mixtral.errors import UserError
from te_mixtral.experts.loop import LoopTier
from te_mixtral.model.hf_config import model_config_from_hf, resolve_model_path
from te_mixtral.model.layers import TORCH
from te_mixtral.model.mixtral import MixtralForCausalLM as Ours
from te_mixtral.training.hf_checkpoint import adopt_checkpoint, load_hf_weights

SINGLE = Layout(0, 1, 1, None, None)

# Experts are ~98% of this model (2 layers x 8 experts x 3 x 128 x 2048 fp32 = 50 MB), so a
# rank that holds half the experts should need about half the memory to load.
TINY = dict(vocab_size=256, hidden_size=128, intermediate_size=2048, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, num_local_experts=8, num_experts_per_tok=2,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0})


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """The same random model twice: as transformers saves it (per-expert w1/w2/w3), and in
    the stacked layout (v5's in-memory names) split over two files with an index."""
    root = tmp_path_factory.mktemp("hf_in")
    torch.manual_seed(0)
    hf = random_hf_mixtral(**TINY)
    per_expert, stacked = root / "per_expert", root / "stacked"
    hf.save_pretrained(per_expert)
    stacked.mkdir()
    (stacked / "config.json").write_text((per_expert / "config.json").read_text())
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in state  # v5 names are the stacked layout
    files = {"model-00001-of-00002.safetensors": [k for k in state if "layers.1." not in k],
             "model-00002-of-00002.safetensors": [k for k in state if "layers.1." in k]}
    for name, keys in files.items():
        save_file({k: state[k] for k in keys}, stacked / name)
    (stacked / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: name for name, keys in files.items() for k in keys}}))
    return hf, per_expert, stacked


def load_with(tmp_path, nproc, dirs):
    out = tmp_path / f"ep{nproc}"
    proc = run_app([str(out), *map(str, dirs)], nproc=nproc, script="tests/workers/load_hf.py")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(out / "logits.pt"), [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]


@pytest.mark.slow
def test_both_layouts_load_into_ep1_and_ep2_with_a_share_of_the_memory(checkpoints, tmp_path):
    hf, per_expert, stacked = checkpoints
    dirs = [str(per_expert), str(stacked)]
    ep1_logits, (ep1,) = load_with(tmp_path, 1, dirs)
    ep2_logits, ep2 = load_with(tmp_path, 2, dirs)
    model_bytes = sum(p.nbytes for p in hf.parameters())

    for d in dirs:
        for logits in (ep1_logits[d], ep2_logits[d]):
            with torch.no_grad():
                want = hf(input_ids=logits["ids"], position_ids=torch.arange(16).expand(2, 16)).logits
            torch.testing.assert_close(logits["logits"], want, rtol=1e-4, atol=1e-5, msg=d)

        # Read exactly what the rank keeps: its shard, not the model.
        assert ep1[d]["bytes_read"] == ep1[d]["shard_bytes"] == model_bytes
        for rank in ep2:
            assert rank[d]["bytes_read"] == rank[d]["shard_bytes"] < 0.55 * model_bytes

        # Peak resident memory while loading: the shard written plus the file pages mapped,
        # so about twice the share; an EP=2 rank must need about half of what EP=1 does.
        if ep1[d]["peak_rss_growth"] is None:
            continue  # no /proc/self/clear_refs (not Linux): the byte counts above still hold
        growth_ep1 = ep1[d]["peak_rss_growth"]
        print(f"{d}: peak RSS growth EP=1 {growth_ep1 / 2**20:.1f} MiB, EP=2 "
              f"{[round(r[d]['peak_rss_growth'] / 2**20, 1) for r in ep2]} MiB, model {model_bytes / 2**20:.1f} MiB")
        assert growth_ep1 < 2.5 * model_bytes
        for rank in ep2:
            assert rank[d]["peak_rss_growth"] < 0.65 * growth_ep1


def test_a_missing_local_checkpoint_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        resolve_model_path(str(tmp_path / "nowhere"))
    with pytest.raises(UserError, match="no config.json"):
        resolve_model_path(str(tmp_path))


def test_a_hub_id_offline_is_a_user_error(monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # fail at once, network or not
    with pytest.raises(UserError, match=r"'no-such-owner/no-such-model' is not a local folder.*offline, pass a local"):
        resolve_model_path("no-such-owner/no-such-model")


@pytest.fixture
def unreachable_hub(tmp_path, monkeypatch):
    """A hub at a port nothing listens on (refused at once, as on a machine without a network),
    and an empty hub cache; huggingface_hub's own offline switch off."""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    for proxy in ("https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(proxy, raising=False)
    return tmp_path / "hub"


def test_a_hub_id_where_the_hub_cannot_be_reached_is_one_line(unreachable_hub):
    # Before: "... downloading it from the Hugging Face hub failed (Got: ConnectError: [Errno 111]
    # Connection refused); ...", the client's words, after its own tries.
    start = time.perf_counter()
    with pytest.raises(UserError) as info:
        resolve_model_path("no_such/model")
    assert str(info.value) == (
        f"model 'no_such/model' is no local folder, and the Hugging Face hub (127.0.0.1:9) cannot be reached "
        f"(Connection refused) nor does its cache ({unreachable_hub}) hold it: pass a local checkpoint folder "
        f"(scripts/make_tiny_mixtral.py writes a tiny one), or download it where the hub can be reached")
    assert time.perf_counter() - start < 10


def test_a_hub_id_in_the_cache_loads_where_the_hub_cannot_be_reached(unreachable_hub):
    # As the hub client does after its own tries: the cached snapshot of the revision `main` names.
    snapshot = unreachable_hub / "models--owner--tiny" / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    MixtralConfig(**SMALL).to_json_file(snapshot / "config.json")
    (unreachable_hub / "models--owner--tiny" / "refs").mkdir()
    (unreachable_hub / "models--owner--tiny" / "refs" / "main").write_text("0" * 40)
    assert resolve_model_path("owner/tiny") == snapshot


# --- bad checkpoints: refused in one line, never broadcast or half read ------------------

SMALL = dict(vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=1, num_attention_heads=2,
             num_key_value_heads=1, head_dim=8, num_local_experts=4, num_experts_per_tok=2)


@pytest.fixture
def small_checkpoint(tmp_path):
    """A one-layer checkpoint as transformers saves it, and its tensors to edit."""
    torch.manual_seed(0)
    MixtralForCausalLM(MixtralConfig(**SMALL)).save_pretrained(tmp_path / "ckpt")
    return tmp_path / "ckpt", load_file(tmp_path / "ckpt" / "model.safetensors")


def load_small(folder, layout=SINGLE):
    model = Ours(model_config_from_hf(folder), TORCH, layout, LoopTier())
    load_hf_weights(model, folder, layout)
    return model


def refused(folder, *fragments, layout=SINGLE):
    with pytest.raises(UserError) as info:
        load_small(folder, layout)
    message = str(info.value)
    assert "\n" not in message and all(fragment in message for fragment in fragments), message
    return message


def rewrite(folder, tensors, name="model.safetensors"):
    save_file({k: v.contiguous() for k, v in tensors.items()}, folder / name)


def test_the_untouched_small_checkpoint_loads(small_checkpoint):
    folder, tensors = small_checkpoint
    model = load_small(folder)
    torch.testing.assert_close(model.state_dict()["model.norm.weight"], tensors["model.norm.weight"])


@pytest.mark.parametrize("key, shape", [
    ("model.layers.0.input_layernorm.weight", [1]),  # copy_ would broadcast it into every entry
    ("model.norm.weight", [1, 16]),
    ("model.layers.0.self_attn.q_proj.weight", [1, 16]),
    ("model.layers.0.block_sparse_moe.experts.2.w2.weight", [24, 16]),  # transposed
    ("model.layers.0.block_sparse_moe.experts.3.w1.weight", [1, 16]),
    ("model.layers.0.block_sparse_moe.gate.weight", [4, 1]),
])
def test_a_wrong_shaped_tensor_is_refused_naming_tensor_file_and_shapes(small_checkpoint, key, shape):
    folder, tensors = small_checkpoint
    expected = list(tensors[key].shape)
    tensors[key] = torch.ones(shape)
    rewrite(folder, tensors)
    refused(folder, f"'{key}'", "model.safetensors", f"has shape {shape}", f"needs {expected}")


def stacked_layout(tensors: dict) -> dict:
    """The small checkpoint's tensors with its experts in the stacked layout."""
    stacked = {k: v for k, v in tensors.items() if ".experts." not in k}
    w1, w3, w2 = ([tensors[f"model.layers.0.block_sparse_moe.experts.{e}.{p}.weight"] for e in range(4)]
                  for p in ("w1", "w3", "w2"))
    stacked["model.layers.0.mlp.experts.down_proj"] = torch.stack(list(w2))
    stacked["model.layers.0.mlp.experts.gate_up_proj"] = torch.stack([torch.cat([a, b]) for a, b in zip(w1, w3)])
    return stacked


def test_a_stacked_tensor_with_other_experts_than_the_config_is_refused_on_every_rank(small_checkpoint):
    folder, tensors = small_checkpoint
    stacked = stacked_layout(tensors)
    rewrite(folder, stacked)
    load_small(folder)
    # Eight experts where the config says four: rank 1 of EP=2 would read experts 2-3 of 8.
    gate_up = stacked["model.layers.0.mlp.experts.gate_up_proj"]
    stacked["model.layers.0.mlp.experts.gate_up_proj"] = torch.cat([gate_up, gate_up])
    rewrite(folder, stacked)
    for rank in (0, 1):
        refused(folder, "'model.layers.0.mlp.experts.gate_up_proj'", "has shape [8, 48, 16]", "needs [4, 48, 16]",
                layout=Layout(rank, 2, 2, None, None))


EVERY_RANK = [SINGLE, Layout(0, 2, 2, None, None), Layout(1, 2, 2, None, None)]


@pytest.mark.parametrize("missing, stacked", [
    ("model.layers.0.block_sparse_moe.experts.0.w1.weight", False),
    ("model.layers.0.block_sparse_moe.experts.2.w3.weight", False),  # EP=2: rank 1's, rank 0 refuses too
    ("model.layers.0.block_sparse_moe.experts.3.w2.weight", False),
    ("model.layers.0.mlp.experts.down_proj", True),
    ("model.layers.0.mlp.experts.gate_up_proj", True),
])
def test_a_missing_expert_projection_is_refused_naming_it_on_every_rank(small_checkpoint, missing, stacked):
    """Without the check, the experts the tensor was to fill keep the memory they were built
    on; every rank refuses, not only the one whose experts are missing."""
    folder, tensors = small_checkpoint
    tensors = stacked_layout(tensors) if stacked else tensors
    rewrite(folder, {k: v for k, v in tensors.items() if k != missing})
    for layout in EVERY_RANK:
        refused(folder, f"the checkpoint has no weights for '{missing}'", layout=layout)


def test_a_missing_dense_tensor_is_refused_naming_it(small_checkpoint):
    folder, tensors = small_checkpoint
    rewrite(folder, {k: v for k, v in tensors.items() if k != "model.layers.0.self_attn.k_proj.weight"})
    refused(folder, "the checkpoint has no weights for 'model.layers.0.self_attn.k_proj.weight'")


def test_experts_and_layers_beyond_the_config_are_refused(small_checkpoint):
    folder, tensors = small_checkpoint
    extra = {**tensors, "model.layers.0.block_sparse_moe.experts.4.w2.weight": torch.ones(16, 24)}
    rewrite(folder, extra)
    refused(folder, "names expert 4, but the config has 4 experts")
    extra = {**tensors, "model.layers.1.block_sparse_moe.experts.0.w2.weight": torch.ones(16, 24)}
    rewrite(folder, extra)
    refused(folder, "'model.layers.1.block_sparse_moe.experts.0.w2.weight' has no place")


def test_a_tensor_in_two_files_is_refused(small_checkpoint):
    folder, tensors = small_checkpoint
    # Files without an index, none of them model.safetensors (which would be read alone).
    (folder / "model.safetensors").rename(folder / "part.safetensors")
    rewrite(folder, {"model.norm.weight": torch.ones(16)}, "extra.safetensors")
    refused(folder, "'model.norm.weight' is in both")


def test_non_float_weights_are_refused(small_checkpoint):
    folder, tensors = small_checkpoint
    tensors["model.norm.weight"] = torch.ones(16, dtype=torch.int32)
    rewrite(folder, tensors)
    refused(folder, "'model.norm.weight' holds I32")


def test_a_corrupt_safetensors_file_is_refused_naming_it(small_checkpoint):
    folder, _ = small_checkpoint
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) // 2])
    refused(folder, f"cannot read {folder / 'model.safetensors'}")
    (folder / "model.safetensors").write_bytes(b"not a safetensors file at all")
    refused(folder, f"cannot read {folder / 'model.safetensors'}")


@pytest.mark.parametrize("index, fragment", [
    ('{"weight_map": {"model.norm.weight": "model.saf', "cannot read"),
    ("[]", "has no 'weight_map'"),
    ('{"weight_map": {"model.norm.weight": 3}}', "has no 'weight_map'"),
    ('{"weight_map": {"model.norm.weight": "../outside.safetensors"}}', "names '../outside.safetensors', which is not a file in"),
    ('{"weight_map": {"model.norm.weight": "/etc/outside.safetensors"}}', "which is not a file in"),
    ('{"weight_map": {"model.norm.weight": "sub/model.safetensors"}}', "which is not a file in"),
    ('{"weight_map": {"model.norm.weight": "gone.safetensors"}}', "names gone.safetensors, which is missing"),
])
def test_a_bad_index_is_refused(small_checkpoint, index, fragment):
    folder, tensors = small_checkpoint
    (folder / "model.safetensors").rename(folder / "model-00001-of-00001.safetensors")  # else read before the index
    # A valid file outside the folder, which an index must not reach.
    rewrite(folder.parent, tensors, "outside.safetensors")
    (folder / "sub").mkdir()
    rewrite(folder / "sub", tensors)
    (folder / "model.safetensors.index.json").write_text(index)
    refused(folder, "model.safetensors.index.json", fragment)


def test_the_app_refuses_a_bad_checkpoint_in_one_line(tmp_path):
    torch.manual_seed(0)
    folder = tmp_path / "ckpt"
    MixtralForCausalLM(MixtralConfig(**{**SMALL, "vocab_size": 512}, sliding_window=64)).save_pretrained(folder)
    args = ["--model", str(folder), "--steps", "2", "--timing_warmup_steps", "0", "--batch_size", "2",
            "--tokenizer_vocab_size", "300", "--max_documents", "50", "--output-dir", str(tmp_path / "run")]
    assert_one_line_error(run_cli([*args, "--seq_len", "65"]), "'sliding_window' 64 is shorter", "(65 tokens")

    tensors = load_file(folder / "model.safetensors")
    tensors["model.norm.weight"] = torch.ones(1)
    rewrite(folder, tensors)
    assert_one_line_error(run_cli([*args, "--seq_len", "64"]), "'model.norm.weight'", "has shape [1]", "needs [16]")


def test_the_tiers_checks_read_the_model_of_the_checkpoint(tmp_path):
    """With model_path the checkpoint's config.json is the model: the tier's checks of the
    model's sizes read it, not the config's model section, which it replaces."""
    for name, width in (("odd", 18), ("even", 16)):  # tier hf's fp32 grouped_mm rows: 4 elements
        MixtralConfig(**{**SMALL, "vocab_size": 2048, "hidden_size": width}).save_pretrained(tmp_path / name)
    cfg = load_run_config(str(REPO / "configs" / "tiny.yaml"), {"tier": "hf", "model_path": str(tmp_path / "odd")})
    with pytest.raises(UserError, match="tier 'hf' runs transformers' grouped_mm experts, whose weight rows must be "
                                        "whole 16-byte units: model.hidden_size 18 not a multiple of 4"):
        adopt_checkpoint(cfg, tmp_path / "odd", 1)  # before: adopted, to fail inside torch's grouped_mm
    # A config file whose own model the tier could not run, replaced by the checkpoint's.
    config = tmp_path / "odd.yaml"
    config.write_text((REPO / "configs" / "tiny.yaml").read_text().replace("hidden_size: 64", "hidden_size: 66"))
    cfg = load_run_config(str(config), {"tier": "hf", "model_path": str(tmp_path / "even")})  # before: refused
    assert adopt_checkpoint(cfg, tmp_path / "even", 1).model.hidden_size == 16


def test_a_folder_with_model_safetensors_beside_an_index_loads_what_transformers_loads(small_checkpoint):
    """transformers reads a folder's model.safetensors before its sharded index (and before any
    other .safetensors file): so must the run, or it fine-tunes other weights than the ones
    the folder gives everyone else."""
    folder, tensors = small_checkpoint
    other = {k: torch.randn_like(v) for k, v in tensors.items()}
    rewrite(folder, other, "model-00001-of-00001.safetensors")
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": dict.fromkeys(other, "model-00001-of-00001.safetensors")}))
    want = MixtralForCausalLM.from_pretrained(folder).state_dict()
    got = load_small(folder).state_dict()
    assert torch.equal(got["model.embed_tokens.weight"], want["model.embed_tokens.weight"])
    assert torch.equal(got["model.layers.0.mlp.experts.down_proj"], want["model.layers.0.mlp.experts.down_proj"])

"""HF checkpoints in: both on-disk expert layouts load into EP=1 and EP=2 shards, give HF's
logits, and each rank reads (and holds) its share of the model, not the whole model."""

import json

import pytest
import torch
from launch import run_app
from safetensors.torch import save_file
from transformers import MixtralConfig, MixtralForCausalLM

from te_mixtral.errors import UserError
from te_mixtral.training.hf_checkpoint import resolve_model_path

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
    hf = MixtralForCausalLM(MixtralConfig(**TINY, attn_implementation="eager")).eval()
    with torch.no_grad():  # HF's init leaves norms at one: perturb them so a swapped norm would show
        for p in hf.parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5)
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

"""A checkpoint's config.json is read strictly: required fields, types, and the fields that
would make our model compute a different function from transformers' are refused."""

import json

import pytest
import torch
from transformers import MixtralConfig, MixtralForCausalLM

from te_mixtral.config import ModelConfig
from te_mixtral.distributed.layout import Layout
from te_mixtral.errors import UserError
from te_mixtral.experts.loop import LoopTier
from te_mixtral.model.hf_config import model_config_from_hf
from te_mixtral.model.layers import TORCH, PackedSequences
from te_mixtral.model.mixtral import MixtralForCausalLM as Ours
from te_mixtral.training.hf_checkpoint import load_hf_weights

SINGLE = Layout(0, 1, 1, None, None)

# mistralai/Mixtral-8x7B-v0.1's config.json as published (transformers 4.36 wrote it).
MIXTRAL_8X7B = {
    "architectures": ["MixtralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2,
    "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
    "max_position_embeddings": 32768, "model_type": "mixtral", "num_attention_heads": 32, "num_experts_per_tok": 2,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "num_local_experts": 8, "output_router_logits": False,
    "rms_norm_eps": 1e-05, "rope_theta": 1e6, "router_aux_loss_coef": 0.02, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.36.0.dev0",
    "use_cache": True, "vocab_size": 32000,
}


def config_dir(tmp_path, raw) -> str:
    (tmp_path / "config.json").write_text(json.dumps(raw) if not isinstance(raw, str) else raw)
    return tmp_path


def test_the_published_mixtral_config_reads_as_our_defaults(tmp_path):
    # Our defaults are Mixtral-8x7B's shapes; the router coefficient is the checkpoint's own
    # (our default, null, means "take the checkpoint's").
    assert model_config_from_hf(config_dir(tmp_path, MIXTRAL_8X7B), 4096) == ModelConfig(router_aux_loss_coef=0.02)


@pytest.mark.parametrize("change, message", [
    ({"hidden_size": None}, "lacks 'hidden_size'"),
    ({"num_local_experts": None, "vocab_size": None}, "lacks 'vocab_size', 'num_local_experts'"),
    ({"hidden_size": "4096"}, "'hidden_size' must be int, got '4096'"),
    ({"num_hidden_layers": 2.0}, "'num_hidden_layers' must be int, got 2.0"),
    ({"num_experts_per_tok": True}, "'num_experts_per_tok' must be int, got True"),
    ({"rms_norm_eps": "1e-5"}, "'rms_norm_eps' must be a number, got '1e-5'"),
    ({"tie_word_embeddings": "false"}, "'tie_word_embeddings' must be bool"),
    ({"head_dim": 64.5}, "'head_dim' must be int"),
    ({"num_attention_heads": 0}, "'num_attention_heads' must be positive, got 0"),
    ({"rope_theta": [1]}, "'rope_theta' must be a number"),
    # Fields whose value changes the function, which our model does not implement:
    ({"rope_theta": None, "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}},
     "rotary scaling 'linear' is not implemented"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rotary scaling 'linear' is not implemented"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rotary scaling 'yarn' is not implemented"),
    ({"sliding_window": 4095}, "'sliding_window' 4095 is shorter than the longest sequence this run may feed "
                               "the model (4096 tokens"),
    ({"sliding_window": "4096"}, "'sliding_window' must be int"),
    ({"hidden_act": "gelu"}, "'hidden_act' 'gelu' is not implemented"),
    ({"router_jitter_noise": 0.01}, "'router_jitter_noise' 0.01 is not implemented"),
    ({"attention_dropout": 0.1}, "'attention_dropout' 0.1 is not implemented"),
    ({"attention_bias": True}, "'attention_bias' is true"),
    ({"quantization_config": {"quant_method": "gptq", "bits": 4}}, "the checkpoint is quantized"),
])
def test_a_bad_or_unimplemented_field_is_refused_in_one_line(tmp_path, change, message):
    raw = {k: v for k, v in {**MIXTRAL_8X7B, **change}.items() if v is not None or k == "sliding_window"}
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace("[", r"\[")) as info:
        model_config_from_hf(config_dir(tmp_path, raw), 4096)
    assert "\n" not in str(info.value) and str(tmp_path / "config.json") in str(info.value)


@pytest.mark.parametrize("text, message", [("[1, 2]", "holds a list, not a mapping"), ("{", "cannot read")])
def test_a_config_that_is_not_a_mapping_is_refused(tmp_path, text, message):
    with pytest.raises(UserError, match=message):
        model_config_from_hf(config_dir(tmp_path, text))


def test_absent_optional_fields_take_transformers_defaults(tmp_path):
    required = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "num_local_experts", "num_experts_per_tok")
    ours = model_config_from_hf(config_dir(tmp_path, {k: MIXTRAL_8X7B[k] for k in required}))
    theirs = MixtralConfig(**{k: MIXTRAL_8X7B[k] for k in required if k != "model_type"})
    assert (ours.rms_norm_eps, ours.max_position_embeddings, ours.initializer_range, ours.tie_word_embeddings,
            ours.rope_theta, ours.head_dim) == (
        theirs.rms_norm_eps, theirs.max_position_embeddings, theirs.initializer_range, theirs.tie_word_embeddings,
        theirs.rope_parameters["rope_theta"], theirs.hidden_size // theirs.num_attention_heads)


def test_a_sliding_window_as_long_as_the_sequence_changes_nothing_and_one_token_shorter_does(tmp_path):
    """Where the refusal starts is where transformers' function starts to differ from ours."""
    seq = 24
    torch.manual_seed(0)
    cfg = dict(vocab_size=64, hidden_size=32, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, attn_implementation="eager",
               rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    hf = MixtralForCausalLM(MixtralConfig(**cfg, sliding_window=seq)).eval()
    hf.save_pretrained(tmp_path)
    ours = Ours(model_config_from_hf(tmp_path, seq), TORCH, SINGLE, LoopTier())
    load_hf_weights(ours, tmp_path, SINGLE)
    ids = torch.randint(0, 64, (1, seq))
    packed = PackedSequences(torch.arange(seq)[None], torch.tensor([0, seq], dtype=torch.int32), seq)
    with torch.no_grad():
        logits = ours(ids, packed)
        torch.testing.assert_close(logits, hf(input_ids=ids).logits, rtol=1e-4, atol=1e-5)
        hf.config.sliding_window = seq - 1
        assert not torch.allclose(logits, hf(input_ids=ids).logits, rtol=1e-3, atol=1e-3)
    with pytest.raises(UserError, match="'sliding_window' 24 is shorter than .* \\(25 tokens"):
        model_config_from_hf(tmp_path, seq + 1)
    with pytest.raises(UserError, match="'sliding_window' 24 is shorter than .* \\(131072 tokens"):
        model_config_from_hf(tmp_path)  # the length unknown: the most any run may feed

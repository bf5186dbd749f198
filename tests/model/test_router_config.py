"""The router-loss coefficients between HF configs and ours: read, written, and which wins."""

import json

import pytest

from te_mixtral.config import load_config
from te_mixtral.errors import UserError
from te_mixtral.model.hf_config import (
    HF_DEFAULT_AUX_LOSS_COEF,
    hf_config,
    model_config_from_hf,
)
from te_mixtral.training.hf_checkpoint import adopt_checkpoint


def write_hf_config(folder, **keys):
    cfg = load_config("configs/tiny.yaml").model
    raw = {**hf_config(cfg).to_dict(), "model_type": "mixtral", **keys}
    raw = {k: v for k, v in raw.items() if v is not None}
    (folder / "config.json").write_text(json.dumps(raw))
    return folder


def test_coefficient_round_trips(tmp_path):
    ours = load_config("configs/tiny.yaml", {"router_aux_loss_coef": "0.02"}).model
    assert hf_config(ours).router_aux_loss_coef == 0.02
    (tmp_path / "config.json").write_text(hf_config(ours).to_json_string())
    assert model_config_from_hf(tmp_path).router_aux_loss_coef == 0.02
    # Our own config's default (null) exports as off: the model was trained without it.
    assert hf_config(load_config("configs/tiny.yaml").model).router_aux_loss_coef == 0.0


def test_missing_key_reads_as_transformers_default(tmp_path):
    raw = write_hf_config(tmp_path)
    data = json.loads((raw / "config.json").read_text())
    del data["router_aux_loss_coef"]
    (raw / "config.json").write_text(json.dumps(data))
    assert model_config_from_hf(tmp_path).router_aux_loss_coef == HF_DEFAULT_AUX_LOSS_COEF
    from transformers import MixtralConfig
    assert MixtralConfig().router_aux_loss_coef == HF_DEFAULT_AUX_LOSS_COEF


@pytest.mark.parametrize("configured, want", [(None, 0.02), ("0.0", 0.0), ("0.1", 0.1)])
def test_checkpoint_value_fills_only_an_unset_coefficient(tmp_path, configured, want):
    write_hf_config(tmp_path, router_aux_loss_coef=0.02)
    overrides = {"router_z_loss_coef": "0.001", **({"router_aux_loss_coef": configured} if configured else {})}
    adopted = adopt_checkpoint(load_config("configs/tiny.yaml", overrides), tmp_path, 1)
    assert adopted.model.aux_loss_coef == want
    assert adopted.model.router_z_loss_coef == 0.001  # not in an HF config: the run's own


@pytest.mark.parametrize("key, value", [("router_aux_loss_coef", "-0.1"), ("router_z_loss_coef", "nan")])
def test_negative_or_nan_coefficients_are_refused(key, value):
    with pytest.raises(UserError, match=key):
        load_config("configs/tiny.yaml", {key: value})

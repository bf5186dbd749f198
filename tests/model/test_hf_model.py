"""The `hf` baselines (te_mixtral/model/hf_model.py): `hf` runs transformers' default experts
implementation, `grouped_mm` (its kernel really runs), `hf_eager` its per-expert loop; both
give our `loop` model's logits, loss and gradients on the same weights."""

import pytest
import torch
import torch.nn.functional as F

from te_mixtral.config import load_config, load_run_config
from te_mixtral.data.packing import batch_from_windows
from te_mixtral.distributed.layout import Layout
from te_mixtral.experts.registry import BASELINES
from te_mixtral.model.hf_model import HFMixtral
from te_mixtral.model.mixtral import causal_lm_loss
from te_mixtral.training.loop import build_model

SINGLE = Layout(0, 1, 1, None, None)
SMALL = {"num_experts": "5", "num_experts_per_tok": "2", "num_hidden_layers": "2", "device": "cpu"}


def rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("tier,experts", [("hf", "grouped_mm"), ("hf_eager", "eager")])
def test_baseline_runs_its_experts_implementation_and_matches_loop(tier, experts, monkeypatch):
    cfg = load_run_config("configs/tiny.yaml", {**SMALL, "tier": tier}, world_size=1)
    hf, ran = build_model(cfg, SINGLE, torch.device("cpu"))
    assert isinstance(hf, HFMixtral) and ran == {"backend": "transformers", "experts": experts}
    assert hf.hf.config._experts_implementation == experts
    ours, _ = build_model(load_config("configs/tiny.yaml", SMALL), SINGLE, torch.device("cpu"))  # the loop tier

    calls = []
    real = F.grouped_mm
    monkeypatch.setattr(F, "grouped_mm", lambda *a, **k: calls.append(1) or real(*a, **k))
    windows = torch.randint(1, cfg.model.vocab_size, (2, 33))
    windows[torch.rand(windows.shape) < 0.1] = 0
    batch = batch_from_windows(windows, eos_id=0)
    targets = (batch.labels != -100).sum()
    losses = []
    for model in (hf, ours):
        logits = model(batch.input_ids, batch.packed)
        loss = causal_lm_loss(logits, batch.labels, targets)
        loss.backward()
        losses.append((logits, loss))
    assert bool(calls) == (experts == "grouped_mm")  # the kernel runs, not transformers' fallback loop
    (hf_logits, hf_loss), (our_logits, our_loss) = losses
    assert rel_err(hf_logits, our_logits) < 1e-5
    assert abs(hf_loss.item() - our_loss.item()) < 1e-5 * our_loss.item()
    hf_params = dict(hf.hf.named_parameters())
    for name, param in ours.named_parameters():
        assert rel_err(hf_params[name].grad, param.grad) < 1e-4, name


def test_every_baseline_names_a_transformers_implementation():
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    assert list(BASELINES) == ["hf", "hf_eager"]
    for ran in BASELINES.values():
        assert ran["experts"] == "eager" or ran["experts"] in ALL_EXPERTS_FUNCTIONS

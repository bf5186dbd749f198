"""The loss a run reports is the mean cross-entropy over the *targets*: every token whose
label is not -100, and no other.

Packed samples hold several documents; the label after each end-of-sequence token is -100
(data/packing.py), so a batch has fewer targets than tokens. A loss divided by the token
count instead would be a few per cent low, smooth and plausible, and every comparison
between two runs of the same code would still agree. Here the first step's reported loss is
recomputed from scratch: the same batch, the model with the same initial weights, and the
cross-entropy written out in float64.
"""

import pytest
import torch
from conftest import REPO

from te_mixtral.config import load_config
from te_mixtral.data.packing import PackedData
from te_mixtral.distributed.layout import Layout
from te_mixtral.model.mixtral import causal_lm_loss
from te_mixtral.training import loop

OVERRIDES = {"steps": "1", "timing_warmup_steps": "0", "batch_size": "4", "seq_len": "64", "dtype": "fp32"}


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    """A run on short documents (lines of pydoc's help text, one document each), so that every
    sample holds several document boundaries."""
    from pydoc_data.topics import topics

    lines = [line.strip() for name in sorted(topics) for line in topics[name].splitlines() if line.strip()]
    data = tmp_path_factory.mktemp("short_docs") / "docs.txt"
    data.write_text("\n".join(lines[:3000]) + "\n")
    return lambda **extra: load_config(str(REPO / "configs" / "tiny.yaml"),
                                       {**OVERRIDES, "dataset": str(data), **extra})


def reference_loss(logits_BSV: torch.Tensor, labels_BS: torch.Tensor) -> float:
    """Mean over the labelled positions of -log softmax(logits)[label], in float64."""
    log_probs = logits_BSV.double().log_softmax(-1)
    picked = [-log_probs[b, s, labels_BS[b, s]] for b, s in (labels_BS != -100).nonzero().tolist()]
    return (torch.stack(picked).sum() / len(picked)).item()


def test_causal_lm_loss_ignores_unlabelled_positions():
    torch.manual_seed(0)
    logits = torch.randn(3, 10, 50) * 3
    labels = torch.randint(0, 50, (3, 10))
    labels[0, 4] = labels[1, 9] = labels[2, 0] = -100
    targets = (labels != -100).sum()
    assert causal_lm_loss(logits, labels, targets.double()).item() == pytest.approx(
        reference_loss(logits, labels), rel=1e-6)


def test_labels_at_document_boundaries(config):
    """The next token is the label, except after an eos: the next document is not predictable."""
    cfg = config()
    data = PackedData(cfg.data, cfg.train.batch_size, 0, 1, cfg.train.seed)
    (batch,) = data.micro_batches(0)
    eos = data.tokenizer.eos_id
    is_eos = batch.input_ids == eos
    assert is_eos.any(), "the batch must hold a document boundary"
    assert torch.equal(batch.labels == -100, is_eos)
    inner = ~is_eos[:, :-1]
    assert torch.equal(batch.labels[:, :-1][inner], batch.input_ids[:, 1:][inner])
    # Documents restart their positions after each eos.
    assert (batch.packed.position_ids_BS[:, 1:][is_eos[:, :-1]] == 0).all()


def test_reported_loss_is_the_mean_over_targets(config, tmp_path):
    cfg = config(output_dir=str(tmp_path))
    reported = loop.train(cfg).losses[0]

    data = PackedData(cfg.data, cfg.train.batch_size, 0, 1, cfg.train.seed)
    (batch,) = data.micro_batches(0)
    labels = batch.labels
    # Enough boundaries that dividing by every token instead moves the loss far past the tolerance.
    assert (labels == -100).sum() >= 8
    model, _ = loop.build_model(cfg, Layout(0, 1, 1, None, None), torch.device("cpu"))
    with torch.no_grad():
        logits = model(batch.input_ids, batch.packed)
    assert reported == pytest.approx(reference_loss(logits, labels), rel=1e-5)

"""Evaluation: loss and perplexity on held-out samples the run never trains on.

Which samples: `data.eval_fraction` of the documents or conversations, a fixed draw that
depends on the data alone (`data.packing.held_out_records`), packed apart into whole global
micro-batches, sharded over the ranks like training batches. Training batches are drawn from
the other records only.

What is measured is the training loss itself, on other tokens: the token cross-entropy
summed over every rank's held-out targets, divided by the global number of targets (see
`te_mixtral.distributed.layout` for why the normalisation is global). Perplexity is exp(loss): the
number of equally likely next tokens the model is as unsure as. Both are global over ranks
and come out identical on every rank, so any rank may report them; rank 0 does.

Pitfall: with expert parallelism each rank's experts serve the tokens of every rank in its
EP group, so every rank must run every forward, even one with no data of its own. Sharding
whole global batches gives every rank the same number of batches, so none waits alone in
an all-to-all.
"""

import contextlib
import math
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch

from te_mixtral.data.packing import Batch
from te_mixtral.distributed.layout import Layout, all_reduce_sum
from te_mixtral.measure.report import format_table
from te_mixtral.model.mixtral import causal_lm_loss


@dataclass
class Evaluation:
    step: int  # completed training steps when it was measured
    loss: float
    perplexity: float
    targets: int  # held-out target tokens, over all ranks

    def line(self, total_steps: int) -> str:
        return f"eval  step {self.step:>4}/{total_steps}  loss {self.loss:.4f}  perplexity {self.perplexity:.2f}"


@contextlib.contextmanager
def evaluating(model: torch.nn.Module):
    """`model` in eval mode inside (LoRA's dropout off), back in the mode it had after."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches: list[Batch], step: int, layout: Layout, device: torch.device,
             autocast: AbstractContextManager) -> Evaluation:
    """The model's loss over this rank's held-out `batches` and every other rank's."""
    totals = torch.zeros(2, dtype=torch.float64, device=device)  # summed loss, target count
    one = torch.ones((), device=device)
    for batch in batches:
        batch = batch.to(device)
        with autocast, evaluating(model):
            logits = model(batch.input_ids, batch.packed)
        totals[0] += causal_lm_loss(logits, batch.labels, one).double()  # divided by one: the summed loss
        totals[1] += (batch.labels != -100).sum()
    all_reduce_sum(totals, layout)
    loss = (totals[0] / totals[1]).item()
    return Evaluation(step, loss, math.exp(min(loss, 700.0)), int(totals[1].item()))  # exp overflows past ~709


def evaluations_table(evals: list[dict]) -> str:
    """The held-out losses of a run, printed under its timing table."""
    rows = [(str(e["step"]), f"{e['loss']:.4f}", f"{e['perplexity']:.2f}") for e in evals]
    return format_table(rows, header=("eval at step", "loss", "perplexity"))

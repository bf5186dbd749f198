"""q, k and v by one GEMM (te_mixtral/model/packed_projection.py), as the TE backend projects
them: the same outputs and gradients as one `F.linear` per weight, in float64 on the CPU, alone
and wired into the model (with LoRA's adapters over a frozen base too), under the parameter
names a Hugging Face checkpoint gives. The TE backend's own run of it: tests/gpu/test_fusions_gpu.py."""

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from model.test_hf_parity import random_packed_batch, rel_err
from model.test_lora import ALL_TARGETS, SINGLE, VOCAB, adapted, hf_checkpoint

from te_mixtral.config import LoRAConfig
from te_mixtral.experts.loop import LoopTier
from te_mixtral.model.hf_config import model_config_from_hf
from te_mixtral.model.layers import TORCH
from te_mixtral.model.mixtral import MixtralForCausalLM as Ours
from te_mixtral.model.packed_projection import packed_linear
from te_mixtral.training.hf_checkpoint import load_hf_weights

# The PyTorch backend with the TE backend's packed projection: the wiring, without TE.
PACKED = replace(TORCH, packed_qkv=True)


@pytest.mark.parametrize("trained", [(True, True, True), (True, False, True), (False, False, False)],
                         ids=["all-trained", "k-frozen", "all-frozen"])
def test_packed_linear_equals_one_linear_per_weight_in_float64(trained):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 7, 16, dtype=torch.float64, generator=gen, requires_grad=True)
    weights = [torch.randn(out, 16, dtype=torch.float64, generator=gen).requires_grad_(needs)
               for out, needs in zip((12, 4, 4), trained, strict=True)]
    grads_out = [torch.randn(2, 7, w.shape[0], dtype=torch.float64, generator=gen) for w in weights]

    def run(project):
        ys = project()
        wanted = [x, *(w for w in weights if w.requires_grad)]
        return ys, torch.autograd.grad(ys, wanted, grads_out)

    packed, packed_grads = run(lambda: packed_linear(x, *weights))
    alone, alone_grads = run(lambda: [F.linear(x, w) for w in weights])
    for got, want in zip([*packed, *packed_grads], [*alone, *alone_grads], strict=True):
        assert got.shape == want.shape
        assert rel_err(got, want) < 1e-12


def test_a_model_projecting_qkv_packed_equals_one_linear_each_in_float64(tmp_path):
    """Logits and every parameter's gradient, under the same parameter names. Float64 leaves
    only the summation order apart; q, k or v swapped, misplaced or missing a gradient is off
    by order one."""
    hf_checkpoint(tmp_path)
    batch = random_packed_batch(VOCAB)
    targets = (batch.labels != -100).sum()
    runs = {}
    for backend in (TORCH, PACKED):
        model = Ours(model_config_from_hf(tmp_path), backend, SINGLE, LoopTier())
        load_hf_weights(model, tmp_path, SINGLE)
        model.to(torch.float64)
        logits = model(batch.input_ids, batch.packed)
        model.lm_loss(logits, batch.labels, targets).backward()
        runs[backend.packed_qkv] = logits, {name: p.grad for name, p in model.named_parameters()}
    (packed_logits, packed_grads), (logits, grads) = runs[True], runs[False]
    assert rel_err(packed_logits, logits) < 1e-12
    assert packed_grads.keys() == grads.keys()
    for name, grad in grads.items():
        assert rel_err(packed_grads[name], grad) < 1e-10, name


def test_lora_adapters_on_packed_qkv_learn_as_on_three_projections(tmp_path):
    """Over a frozen base the packed GEMM computes no weight gradient, and each adapter's
    delta joins its own projection's output."""
    hf_checkpoint(tmp_path)
    lora = LoRAConfig(rank=3, alpha=6.0, targets=ALL_TARGETS)
    batch = random_packed_batch(VOCAB)
    targets = (batch.labels != -100).sum()
    runs = {}
    for backend in (TORCH, PACKED):
        model = adapted(tmp_path, lora, backend=backend)
        model.lm_loss(model(batch.input_ids, batch.packed), batch.labels, targets).backward()
        runs[backend.packed_qkv] = {name: p.grad for name, p in model.named_parameters()}
    for name, grad in runs[False].items():
        got = runs[True][name]
        assert (got is None) == (grad is None), name
        if grad is not None:
            assert rel_err(got, grad) < 1e-10, name

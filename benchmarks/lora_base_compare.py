"""What lora_fp8_base.py and nf4_accuracy.py share: one LoRA forward and backward on one
fixed batch, built as a run builds its model, and the errors of one base against another.

Shape suffixes: see te_mixtral/__init__.py.

Every model comes from one seed (`training.loop.build_model`, LoRA r=16 on every target of
`configs/mixtral-8x7b-lora.yaml` unless another config is given), so the bases differ only in
how their expert weights are held; the adapters' B is drawn at random (zero, as training
starts, would leave A without a gradient). `refusal` checks, before anything is built, the
runs a script will compare: its --layers and --tokens, and each run's config as the app reads it.
"""

import torch

from te_mixtral.config import RunConfig, load_config
from te_mixtral.distributed.layout import Layout
from te_mixtral.errors import UserError, require
from te_mixtral.model.layers import PackedSequences
from te_mixtral.model.mixtral import causal_lm_loss
from te_mixtral.training.loop import build_model

SINGLE = Layout(0, 1, 1, None, None)
CONFIG = "configs/mixtral-8x7b-lora.yaml"


def batch_ids(vocab: int, tokens: int, device: torch.device) -> torch.Tensor:
    return torch.randint(0, vocab, (1, tokens), device=device, generator=torch.Generator(device).manual_seed(0))


def run_config(config: str, overrides: dict, layers: int, tokens: int, device: str) -> RunConfig:
    """The config of one compared run: `config` with `overrides`, `layers` layers, and one
    sequence of `tokens` tokens on `device` (a type: cuda, cpu)."""
    return load_config(config, {**overrides, "model.num_hidden_layers": str(layers), "seq_len": str(tokens),
                                "device": device})


def refusal(config: str, runs: list[dict], layers: list[int], tokens: int, device: str) -> str | None:
    """Why the `runs` (each the overrides of one) at each of `layers` and `tokens` cannot be
    compared, in one line; None where they can."""
    try:
        require(min(layers) >= 1, f"--layers takes 1 or more, got {min(layers)}")
        require(tokens >= 2, f"--tokens takes 2 or more (a token and the next it predicts), got {tokens}")
        for overrides in runs:
            for n in layers:
                run_config(config, overrides, n, tokens, device)
    except UserError as error:
        return str(error)
    return None


def run(overrides: dict, layers: int, ids: torch.Tensor, config: str = CONFIG, prepare=None):
    """(logits, loss, adapter gradients by name, peak GiB) of one LoRA step on `ids` with the
    config's `overrides`; `prepare(model)` may change the built model's base first. On CUDA
    under bf16 autocast, as a run computes; on the CPU in fp32."""
    device, tokens = ids.device, ids.shape[1]
    cfg = run_config(config, overrides, layers, tokens, device.type)
    cuda = device.type == "cuda"
    if cuda:  # this run's own peak: what an earlier run left (kept for the comparison) is not counted
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    model, _ = build_model(cfg, SINGLE, device)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".B"):
                p.normal_(0.0, 0.02, generator=torch.Generator(device).manual_seed(len(name)))
        if prepare is not None:
            prepare(model)
    packed = PackedSequences(torch.arange(tokens, device=device)[None],
                             torch.tensor([0, tokens], dtype=torch.int32, device=device), tokens)
    with torch.autocast(device.type, torch.bfloat16, enabled=cuda):
        logits = model(ids, packed)
    loss = causal_lm_loss(logits, ids.roll(-1, 1), torch.tensor(float(tokens), device=device))
    loss.backward()
    grads = {name: p.grad.float() for name, p in model.named_parameters() if p.grad is not None}
    peak = (torch.cuda.max_memory_allocated() - before) / 2**30 if cuda else float("nan")
    del model
    if cuda:
        torch.cuda.empty_cache()
    return logits.float(), loss.item(), grads, peak


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def error_rows(other, base) -> list[tuple[str, str]]:
    """(quantity, value) of `other`'s run against `base`'s: relative Frobenius errors of the
    logits and of the adapters' gradients (attention's, the experts'), the losses, the peaks."""
    rows = [("logits", f"{rel(other[0], base[0]):.3e}"), ("loss", f"{base[1]:.5f} -> {other[1]:.5f}")]
    for kind in ("self_attn", "experts"):
        names = [n for n in base[2] if kind in n]
        num = sum((other[2][n] - base[2][n]).square().sum() for n in names).sqrt()
        den = sum(base[2][n].square().sum() for n in names).sqrt()
        rows.append((f"adapter gradients ({kind}, {len(names)} tensors)", f"{(num / den).item():.3e}"))
    rows.append(("peak GiB (base -> this)", f"{base[3]:.2f} -> {other[3]:.2f}"))
    return rows

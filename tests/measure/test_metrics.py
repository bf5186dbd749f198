"""FLOP counts against independent hand counts, timing statistics on synthetic steps, peak lookup."""

import time

import pytest
import torch
from torch import nn

from te_mixtral.config import ModelConfig
from te_mixtral.measure.metrics import (
    StepTimer,
    active_params_per_token,
    peak_flops,
    peak_memory_bytes,
    summarize,
    train_flops,
)

TINY = ModelConfig(
    vocab_size=50,
    hidden_size=16,
    intermediate_size=24,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    num_experts=4,
    num_experts_per_tok=2,
)


def tiny_token_path(m: ModelConfig) -> nn.Module:
    """The modules one token's matmuls go through, built as real layers: the router scores
    all experts, but only top-k experts' weights are on the path."""
    D, F, hd = m.hidden_size, m.intermediate_size, m.head_dim

    def expert() -> nn.Module:
        return nn.ModuleDict({
            "gate": nn.Linear(D, F, bias=False),
            "up": nn.Linear(D, F, bias=False),
            "down": nn.Linear(F, D, bias=False),
        })

    def layer() -> nn.Module:
        return nn.ModuleDict({
            "input_norm": nn.RMSNorm(D),
            "q": nn.Linear(D, m.num_attention_heads * hd, bias=False),
            "k": nn.Linear(D, m.num_key_value_heads * hd, bias=False),
            "v": nn.Linear(D, m.num_key_value_heads * hd, bias=False),
            "o": nn.Linear(m.num_attention_heads * hd, D, bias=False),
            "post_norm": nn.RMSNorm(D),
            "router": nn.Linear(D, m.num_experts, bias=False),
            "chosen_experts": nn.ModuleList(expert() for _ in range(m.num_experts_per_tok)),
        })

    return nn.ModuleDict({
        "layers": nn.ModuleList(layer() for _ in range(m.num_hidden_layers)),
        "final_norm": nn.RMSNorm(D),
        "lm_head": nn.Linear(D, m.vocab_size, bias=False),
    })


def count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def causal_pairs_by_mask(lengths: list[int]) -> int:
    """Count the true entries of a packed block-diagonal causal mask."""
    doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    pos = torch.arange(len(doc))
    mask = (doc[:, None] == doc[None, :]) & (pos[None, :] <= pos[:, None])
    return int(mask.sum())


def cu(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


# --- FLOPs -------------------------------------------------------------------------------


def test_active_params_match_built_modules():
    assert active_params_per_token(TINY) == count(tiny_token_path(TINY))


def test_active_params_count_top_k_experts_not_all():
    more_experts = ModelConfig(**{**TINY.__dict__, "num_experts": 8})
    # Only the router grows with the number of experts: D more weights per layer per expert.
    extra = active_params_per_token(more_experts) - active_params_per_token(TINY)
    assert extra == TINY.num_hidden_layers * TINY.hidden_size * 4
    assert active_params_per_token(more_experts) == count(tiny_token_path(more_experts))


def test_tied_head_still_counts_its_matmul():
    tied = ModelConfig(**{**TINY.__dict__, "tie_word_embeddings": True})
    assert active_params_per_token(tied) == active_params_per_token(TINY)


def test_attention_pairs_two_documents():
    assert causal_pairs_by_mask([3, 5]) == 6 + 15  # the hand count the mask must agree with
    lengths = [3, 5]
    tokens = sum(lengths)
    matmuls = 6 * count(tiny_token_path(TINY)) * tokens
    # QK^T and AV, 2*H*hd FLOPs per pair each, per layer; backward is twice forward.
    attention = 3 * TINY.num_hidden_layers * 2 * (2 * TINY.num_attention_heads * TINY.head_dim) * 21
    assert train_flops(TINY, cu(lengths), tokens) == matmuls + attention


@pytest.mark.parametrize("lengths", [[8], [1] * 8, [2, 1, 4, 1], [7, 9, 1]])
def test_attention_term_matches_mask(lengths):
    tokens = sum(lengths)
    linear = 6 * count(tiny_token_path(TINY)) * tokens
    per_pair = 3 * TINY.num_hidden_layers * 4 * TINY.num_attention_heads * TINY.head_dim
    expected = linear + per_pair * causal_pairs_by_mask(lengths)
    assert train_flops(TINY, cu(lengths), tokens) == expected


def test_long_document_does_not_overflow_int32():
    length = 100_000  # L*(L+1)/2 = 5,000,050,000 > 2**31
    flops = train_flops(TINY, cu([length]), length)
    per_pair = 3 * TINY.num_hidden_layers * 4 * TINY.num_attention_heads * TINY.head_dim
    attention = flops - 6 * active_params_per_token(TINY) * length
    assert attention == per_pair * 5_000_050_000


# --- peak FLOPs ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, expected",
    [
        ("NVIDIA H100 80GB HBM3", 989.4e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA H100 NVL", None),
        ("NVIDIA H200", 989.4e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA A100 80GB PCIe", 312e12),
        ("NVIDIA B200", 2.25e15),
        ("NVIDIA GB200", 2.5e15),
        ("NVIDIA L40S", 362e12),
        ("cpu", None),
        ("NVIDIA GeForce RTX 4090", None),
    ],
)
def test_peak_flops_by_name(name, expected):
    assert peak_flops(name) == expected


# --- summarize -----------------------------------------------------------------------------


def synthetic_run():
    """Three absurdly slow warm-up steps, then ten steps of 10, 20, ..., 100 ms, shuffled."""
    warmup = [100.0, 50.0, 80.0]
    timed = [0.01 * i for i in (7, 2, 10, 1, 5, 9, 3, 8, 4, 6)]
    return warmup + timed


def test_summarize_excludes_warmup_and_reports_median_p90():
    s = summarize(synthetic_run(), 3, tokens_per_step=1100, world_size=2,
                  flops_per_step=2.2e12, peak_flops=None, peak_memory_bytes=3 * 2**30)
    assert s["timed_steps"] == 10
    assert s["median_step_ms"] == pytest.approx(55.0)  # between 50 and 60 ms
    assert s["p90_step_ms"] == pytest.approx(90.0)  # the 9th of 10 sorted steps
    assert s["tokens_per_s"] == pytest.approx(1100 / 0.055)
    assert s["tokens_per_s_per_gpu"] == pytest.approx(1100 / 0.055 / 2)
    assert s["tflops_per_gpu"] == pytest.approx(2.2e12 / 2 / 0.055 / 1e12)
    assert s["mfu"] is None
    assert s["peak_memory_gib"] == pytest.approx(3.0)


def test_summarize_flops_list_ignores_warmup_steps_and_gives_mfu():
    times = synthetic_run()
    flops = [1e30] * 3 + [1e12, 3e12] * 5  # mean of the timed steps: 2e12
    s = summarize(times, 3, tokens_per_step=100, world_size=4, flops_per_step=flops,
                  peak_flops=1e13, peak_memory_bytes=0)
    per_gpu = 2e12 / 4 / 0.055
    assert s["tflops_per_gpu"] == pytest.approx(per_gpu / 1e12)
    assert s["mfu"] == pytest.approx(per_gpu / 1e13)


def test_summarize_rejects_misaligned_flops_and_no_timed_steps():
    with pytest.raises(ValueError):
        summarize([1.0, 1.0], 0, 10, 1, [1.0], None, 0)
    with pytest.raises(ValueError):
        summarize([1.0, 1.0], 2, 10, 1, 1.0, None, 0)


# --- timer and memory ----------------------------------------------------------------------


def test_step_timer_records_each_step():
    timer = StepTimer("cpu")
    with timer.step():
        time.sleep(0.02)
    timer.start()
    seconds = timer.stop()
    assert len(timer.times) == 2
    assert timer.times[0] >= 0.02
    assert timer.times[1] == seconds < 0.02


def test_step_timer_stop_without_start():
    with pytest.raises(RuntimeError):
        StepTimer("cpu").stop()


def test_cpu_peak_memory_is_bytes():
    # A Python process with torch loaded holds well over 50 MiB and far under 1 TiB; a
    # KiB/bytes mix-up lands outside that range.
    assert 50 * 2**20 < peak_memory_bytes(torch.device("cpu")) < 2**40


def test_lora_flops_count_a_frozen_weight_4_and_an_adapter_6_per_parameter_and_token():
    """With every expert on every token's path (top-k = E), the adapters a token passes through
    are all the adapters a single process holds, counted from the built model."""
    from te_mixtral.config import LoRAConfig
    from te_mixtral.distributed.layout import Layout
    from te_mixtral.experts.loop import LoopTier
    from te_mixtral.model.layers import TORCH
    from te_mixtral.model.lora import add_adapters, is_adapter_param
    from te_mixtral.model.mixtral import MixtralForCausalLM

    m = ModelConfig(**{**TINY.__dict__, "num_experts_per_tok": TINY.num_experts})
    lora = LoRAConfig(rank=3, targets="q_proj,o_proj,down_proj")
    model = MixtralForCausalLM(m, TORCH, Layout(0, 1, 1, None, None), LoopTier())
    add_adapters(model, lora, 0, Layout(0, 1, 1, None, None))
    adapters = sum(p.numel() for name, p in model.named_parameters() if is_adapter_param(name))
    lengths = [5, 3]
    attention = train_flops(m, cu(lengths), 8) - 6 * active_params_per_token(m) * 8
    assert train_flops(m, cu(lengths), 8, lora) == 4 * active_params_per_token(m) * 8 + 6 * adapters * 8 + attention


def test_a_run_short_of_gpu_memory_names_its_fullest_rank():
    from te_mixtral.training.run_report import short_of_memory_note

    note = short_of_memory_note([0, 7, 3])
    assert note.startswith("te_mixtral: note: GPU memory ran short 7 times on rank 1:") and "\n" not in note

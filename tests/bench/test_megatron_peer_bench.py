"""benchmarks/megatron_peer.py, the parts that run without a GPU: refusing bad arguments in
one line before importing anything heavy, and refusing a machine without CUDA; its packed
inputs and their micro-batches, with the FLOPs counted for them; and, where megatron-core
0.19.2 imports (Python >= 3.12), the configs it builds from ours pass Megatron's own checks,
and the model they build has our Mixtral's parameters. The Transformer Engine layer spec and
the alltoall dispatcher need CUDA, so the model is built here with Megatron's local spec
and its allgather dispatcher (neither has parameters of its own that the TE ones lack); a
training step needs CUDA (its RoPE and attention)."""

import argparse
import contextlib

import pytest
import torch
from bench.refusals import refusals
from conftest import REPO

from benchmarks.megatron_peer import (
    MEGATRON,
    ddp_config_kwargs,
    device_batches,
    megatron_inputs,
    micro_batches,
    optimizer_config_kwargs,
    parse_args,
    transformer_config_kwargs,
)
from benchmarks.peer_workload import random_rows, thd_row, workload_config
from te_mixtral.measure.metrics import active_params_per_token, train_flops
from te_mixtral.measure.model_state import count_parameters
from te_mixtral.measure.report import package_version

TINY = str(REPO / "configs/tiny.yaml")
HAS_MEGATRON = package_version("megatron-core") == MEGATRON
needs_megatron = pytest.mark.skipif(
    not HAS_MEGATRON,
    reason=f"megatron-core {MEGATRON} is not installed (pip install -e .[megatron-peer]; Python >= 3.12)")
# Fusions that need Transformer Engine to pass Megatron's checks: off where the model is built on a CPU.
TE_ONLY = {"moe_permute_fusion": False, "apply_rope_fusion": False}


def _args(*argv, ep=1):
    args = parse_args(["--config", TINY, *argv])
    args.ep = args.ep or ep  # as run() sets it from the world size
    return args


def test_bad_arguments_are_refused_in_one_line_before_heavy_imports():
    cases = [
        (["--steps", "5", "--warmup", "5"], "--warmup 5 must leave some of the --steps 5 to time"),
        (["--layers", "0"], "--layers must be positive, got 0"),
        (["--batch-size", "0"], "--batch-size must be positive, got 0"),
        (["--ep", "0"], "--ep must be positive, got 0"),
        (["--micro-batches", "0"], "--micro-batches must be positive, got 0"),
        (["--recompute-modules", "moe_act"], "--recompute-modules needs --recompute selective"),
        (["--recompute", "selective", "--recompute-num-layers", "2"],
         "--recompute-num-layers needs --recompute full (Megatron's selective recompute is of every layer)"),
        (["--moe-overlap"], "--moe-overlap overlaps one micro-batch's all-to-all with another's compute: it needs "
                            "--micro-batches 2 or more"),
        (["--delay-wgrad-compute"], "--delay-wgrad-compute needs --moe-overlap"),
        (["--optimizer-cpu-offload", "1.5"], "--optimizer-cpu-offload takes a fraction in (0, 1], got 1.5"),
        (["--optimizer-cpu-offload", "1", "--precision-aware-optimizer"],
         "--optimizer-cpu-offload keeps fp32 optimizer states: leave out --precision-aware-optimizer"),
        (["--grads", "bf16"], "--grads bf16 needs --precision-aware-optimizer or --optimizer-cpu-offload (Megatron's "
                              "optimizer takes bf16 gradients only on its precision-aware path)"),
        (["--config", "configs/missing.yaml"], "cannot read config configs/missing.yaml: No such file or directory"),
        (["--ep", "3"], "--ep 3 must divide the 1 ranks and the 8 experts"),
        (["--layers", "2", "--recompute", "full", "--recompute-num-layers", "3"],
         "--recompute-num-layers 3 is more than the 2 layers"),
        (["--micro-batches", "3"], "--micro-batches 3 does not divide the 8192 tokens of a GPU's step"),
        (["--moe-overlap", "--micro-batches", "2"],
         "--moe-overlap hides the expert-parallel all-to-all: it needs --ep above 1"),
    ]
    answers, imported = refusals("megatron_peer", [args for args, _ in cases], ("torch", "megatron"))
    for (code, stderr), (args, message) in zip(answers, cases):
        assert code == 2 and stderr == f"megatron_peer: error: {message}\n", (args, stderr)
    assert imported == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_a_machine_without_cuda_is_refused_in_one_line(capsys):
    from benchmarks.megatron_peer import main

    assert main(["--config", TINY]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == ("megatron_peer: error: the Megatron-Core peer needs CUDA GPUs (its Transformer Engine "
                                 "layers), and none is visible\n")


def _row(doc_len=50):
    cfg = workload_config(argparse.Namespace(config=TINY, layers=1))
    (row,) = random_rows(cfg, 1, doc_len, torch.Generator().manual_seed(0), "cpu")
    return cfg, row


def test_inputs_are_megatrons_packed_batch():
    _, row = _row()
    batch = megatron_inputs(row)
    tokens, labels, mask = batch["tokens"][0], batch["labels"][0], batch["loss_mask"][0]
    # Token i predicts token i + 1, except the last token of each document and of the row.
    ends = row["cu_seq_lens_q"][1:] - 1
    assert len(ends) > 4 and (mask == 0).nonzero().flatten().tolist() == ends.tolist()
    kept = mask == 1
    assert torch.equal(labels[kept], tokens[1:][kept[:-1]])
    assert (labels[~kept] == 0).all()  # a valid token id where nothing is predicted: the mask drops it
    assert batch["cu_seqlens"].dtype == torch.int32
    assert torch.equal(batch["cu_seqlens"].long(), row["cu_seq_lens_q"].long())


def test_micro_batches_cut_the_row_and_the_documents_that_cross_a_cut():
    cfg = workload_config(argparse.Namespace(config=TINY, layers=1))
    tokens = torch.randint(cfg.model.vocab_size, (1, 512), generator=torch.Generator().manual_seed(0))
    row = thd_row(tokens, torch.tensor([0, 300, 512], dtype=torch.int32), 300)  # documents of 300 and 212 tokens
    batch = megatron_inputs(row)
    pieces = micro_batches(batch, 2)
    assert [p["cu_seqlens"].tolist() for p in pieces] == [[0, 256], [0, 44, 256]]
    for key in ("tokens", "labels", "loss_mask"):
        assert torch.equal(torch.cat([p[key] for p in pieces], dim=1), batch[key])
    (whole,) = micro_batches(batch, 1)
    assert whole["cu_seqlens"].tolist() == [0, 300, 512]
    # The FLOPs counted for the pieces: the same matmuls, causal attention over the documents as cut
    # (forward: 2 GEMMs of 2 FLOPs a multiply-add per query-key pair; backward twice that).
    m = cfg.model
    pairs = sum(n * (n + 1) // 2 for n in (256, 44, 212))
    attention = 3 * m.num_hidden_layers * 4 * m.num_attention_heads * m.head_dim * pairs
    expected = 6 * active_params_per_token(m) * 512 + attention
    (step,) = device_batches([row], 2)
    assert sum(train_flops(m, p["cu_seqlens"], p["tokens"].shape[1]) for p in step) == expected


def test_our_training_settings_reach_its_optimizer_and_ddp():
    cfg = workload_config(argparse.Namespace(config=TINY, layers=1))
    t = cfg.train
    default = optimizer_config_kwargs(t, _args())
    mapped = ("lr", "adam_beta1", "adam_beta2", "weight_decay", "clip_grad")
    assert [default[k] for k in mapped] == [t.lr, t.beta1, t.beta2, t.weight_decay, t.grad_clip]
    assert default["use_distributed_optimizer"] and not default["use_precision_aware_optimizer"]
    assert ddp_config_kwargs(_args()) == {"grad_reduce_in_fp32": True, "overlap_grad_reduce": True,
                                          "use_distributed_optimizer": True, "delay_wgrad_compute": False}
    aware = optimizer_config_kwargs(t, _args("--precision-aware-optimizer", "--grads", "bf16"))
    assert aware["use_precision_aware_optimizer"]
    assert aware["exp_avg_dtype"] == aware["exp_avg_sq_dtype"] == torch.bfloat16
    assert aware["main_grads_dtype"] == torch.bfloat16
    assert not ddp_config_kwargs(_args("--precision-aware-optimizer", "--grads", "bf16"))["grad_reduce_in_fp32"]
    offload = optimizer_config_kwargs(t, _args("--optimizer-cpu-offload", "0.5"))
    assert offload["optimizer_cpu_offload"] and offload["optimizer_offload_fraction"] == 0.5
    assert offload["use_precision_aware_optimizer"] and offload["exp_avg_dtype"] == torch.float32


@needs_megatron
def test_its_configs_pass_megatrons_checks_at_mixtral_8x7b():
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.transformer.transformer_config import TransformerConfig

    argv = ["--config", str(REPO / "configs/mixtral-8x7b.yaml")]
    cfg = workload_config(parse_args(argv))
    for extra, ep in [([], 1), (["--moe-overlap", "--micro-batches", "2", "--delay-wgrad-compute"], 4),
                      (["--recompute", "selective", "--recompute-modules", "moe_act", "layernorm"], 4),
                      (["--recompute", "full", "--recompute-num-layers", "16"], 4),
                      (["--optimizer-cpu-offload", "1"], 4)]:
        args = parse_args(argv + extra)
        args.ep = ep
        c = TransformerConfig(**transformer_config_kwargs(cfg.model, args) | TE_ONLY)
        assert (c.num_layers, c.hidden_size, c.moe_ffn_hidden_size, c.num_attention_heads, c.num_query_groups,
                c.kv_channels, c.num_moe_experts, c.moe_router_topk) == (32, 4096, 14336, 32, 8, 128, 8, 2)
        assert (c.normalization, c.layernorm_epsilon, c.gated_linear_unit, c.add_bias_linear) == ("RMSNorm", 1e-5, True,
                                                                                                  False)
        assert (c.moe_aux_loss_coeff, c.moe_router_pre_softmax, c.moe_router_score_function) == (0.02, False, "softmax")
        assert c.moe_token_dispatcher_type == "alltoall" and c.moe_grouped_gemm and c.expert_model_parallel_size == ep
        DistributedDataParallelConfig(**ddp_config_kwargs(args))
        OptimizerConfig(**optimizer_config_kwargs(cfg.train, args))
    # Megatron's own checks still run on what it is given: overlap with full recompute is refused.
    args = parse_args(argv + ["--moe-overlap", "--micro-batches", "2", "--recompute", "full"])
    args.ep = 4
    with pytest.raises(AssertionError, match="disable full recomputation"):
        TransformerConfig(**transformer_config_kwargs(cfg.model, args) | TE_ONLY)


@contextlib.contextmanager
def _one_rank():
    """A process group of one (gloo) and Megatron's parallel state over it."""
    from megatron.core import parallel_state

    if torch.distributed.is_initialized():
        pytest.skip("a process group is already up in this process")
    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    try:
        parallel_state.initialize_model_parallel(expert_model_parallel_size=1, create_gloo_process_groups=False)
        yield
    finally:
        parallel_state.destroy_model_parallel()
        torch.distributed.destroy_process_group()


@needs_megatron
def test_the_model_holds_our_mixtrals_parameters():
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = workload_config(argparse.Namespace(config=TINY, layers=2))
    m = cfg.model
    cpu = TE_ONLY | {"use_cpu_initialization": True, "moe_token_dispatcher_type": "allgather"}
    with _one_rank():
        config = TransformerConfig(**transformer_config_kwargs(m, _args("--layers", "2")) | cpu)
        model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(m.num_experts, True),
                         vocab_size=m.vocab_size, max_sequence_length=m.max_position_embeddings,
                         position_embedding_type="rope", rotary_base=m.rope_theta,
                         share_embeddings_and_output_weights=m.tie_word_embeddings)
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    assert sum(p.numel() for p in model.parameters()) == count_parameters(m).total
    q, kv = m.num_attention_heads * m.head_dim, m.num_key_value_heads * m.head_dim
    layer = "decoder.layers.1."
    assert shapes[layer + "self_attention.linear_qkv.weight"] == (q + 2 * kv, m.hidden_size)
    assert shapes[layer + "mlp.router.weight"] == (m.num_experts, m.hidden_size)
    assert shapes["output_layer.weight"] == shapes["embedding.word_embeddings.weight"] == (m.vocab_size, m.hidden_size)
    assert model.rotary_pos_emb.inv_freq[1].item() == pytest.approx(m.rope_theta ** (-2 / m.head_dim))

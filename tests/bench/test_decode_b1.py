"""The batch-1 decoding benchmark on the CPU: every column's greedy tokens are transformers' on the
tiny model in fp32, and the floor counts what a decode step reads of the real model's weights."""

import json

from conftest import REPO

from benchmarks import decode_b1
from te_mixtral.config import load_config
from te_mixtral.distributed.layout import is_expert_param
from te_mixtral.experts.loop import LoopTier
from te_mixtral.model.layers import TORCH
from te_mixtral.model.mixtral import MixtralForCausalLM


def test_every_column_decodes_transformers_tokens(tmp_path, capsys):
    out = tmp_path / "decode.json"
    assert decode_b1.main(["--config", str(REPO / "configs" / "tiny.yaml"), "--tokens", "12", "--prompt-tokens", "5",
                           "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    columns = result["columns"]
    assert set(columns) == {"transformers", "ours, no cache", "ours, KV cache"}
    assert result["skipped"] == {"ours, KV cache + CUDA graph": "CUDA graphs need a GPU"}
    for name, column in columns.items():
        assert len(column["tokens"]) == 12 and column["agree_with_transformers"] == 12, name
        assert column["transformers_logit_gap_where_they_part"] is None
    assert "first 12 of 12 tokens as transformers'" in capsys.readouterr().out


def test_the_floor_is_the_dense_weights_and_k_experts_per_layer():
    m = load_config(str(REPO / "configs" / "tiny.yaml"), {}).model
    model = MixtralForCausalLM(m, TORCH, decode_b1.SINGLE, LoopTier())
    params = dict(model.named_parameters())
    experts = sum(p.numel() for name, p in params.items() if is_expert_param(name))
    dense = sum(p.numel() for name, p in params.items() if not is_expert_param(name))
    dense += m.hidden_size - params["model.embed_tokens.weight"].numel()  # one row of the embedding table
    assert decode_b1.floor_bytes(m, 2) == {"dense": 2 * dense,
                                           "experts": 2 * experts * m.num_experts_per_tok // m.num_experts}


def test_bad_arguments_are_refused_in_one_line(capsys):
    assert decode_b1.main(["--tokens", "8", "--config", str(REPO / "configs" / "tiny.yaml")]) == 2
    assert decode_b1.main(["--config", str(REPO / "configs" / "tiny.yaml"), "--tier", "grouped_linear"]) == 2
    errors = capsys.readouterr().err.splitlines()
    assert len(errors) == 2 and errors[0].startswith("decode_b1: error: --tokens must be more than 8")
    assert errors[1].startswith("decode_b1: error: ") and "grouped_linear" in errors[1]


def test_kernels_are_told_apart_by_name():
    experts = decode_b1.expert_kernel_names()
    assert {"_rows_gemm", "_wgrad_gemm"} <= experts
    kinds = {name: decode_b1.kernel_kind(name, experts) for name in (
        "_rows_gemm", "nvjet_tst_128x64_64x4_1x2_h_bz_TNT", "sm90_xmma_gemm_bf16bf16_bf16f32", "gemv2T_kernel_val",
        "void at::native::vectorized_elementwise_kernel<4, ...>", "void at::native::(anonymous)::cunn_SoftMaxForward")}
    assert list(kinds.values()) == ["experts", "cuBLAS GEMMs", "cuBLAS GEMMs", "cuBLAS GEMMs", "other", "other"]

"""benchmarks/kernel_profile.py and kernel_compare.py, the parts that need no GPU: kernels sorted
into kinds by name (names as the profiler gives them, from our step and TE's example), the
idle gaps between kernels on several streams, the per-step summary, and the side-by-side
table read back from two `--json` files."""

import json

import pytest

from benchmarks import kernel_compare
from benchmarks.kernel_profile import idle_gaps, kind_of, summarize

KERNELS = {
    "_rows_gemm": "gemm",
    "nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT": "gemm",
    "_master_adamw_kernel": "optimizer",
    "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::"
    "FusedOptimizerTensorListMetadata<4>, at::native::": "optimizer",
    "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<c10::BFloat16, at::native::NormTwoOps<c10::"
    "BFloat16, float, float, true>, unsigned int, fl": "gradient norm",
    "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26_64x64x128_1x4x1_cga1x1x1_kernel0_0":
        "attention",
    "void cudnn::fusion::compute_dot_do_o_ragged_specialized<true, 128>(void const*, void const*": "attention",
    "void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float, at::native::(anonymous "
    "namespace)::LogSoftMaxForwardEpilogue>(fl": "loss",
    "online_softmax_kernel": "loss",
    "element_mul_kernel": "loss",
    "void at::native::sbtopk::gatherTopK<float, unsigned int, 2, false>(at::cuda::detail::TensorInfo<float const, "
    "unsigned int>": "router",
    "void at::native::bitonicSortKVInPlace<2, -1, 16, 16, float, long, at::native::GTOp<float, true>": "router",
    "void moe_permute_kernel<__nv_bfloat16, __nv_bfloat16, 8, true>(__nv_bfloat16 const*": "permute",
    "void cub::_V_300403_SM_750_800_890_900_1000_1200::detail::radix_sort::DeviceRadixSortOnesweepKernel<cub": "permute",
    "void transformer_engine::normalization::rmsnorm_bwd_tuned_kernel<transformer_engine::normalization::"
    "Kernel_traits<__nv_bfloat16": "norm",
    "void transformer_engine::fused_rope_forward_kernel<__nv_bfloat16>(__nv_bfloat16 const*, int const*": "rope",
    "void transformer_engine::dgated_act_kernel<16, true, float, transformer_engine::Empty, &(float "
    "transformer_engine::silu<float, float>": "swiglu",
    "void at::native::vectorized_elementwise_kernel<8, at::native::CUDAFunctor_add<c10::BFloat16>, "
    "std::array<char*, 3ul> >": "add",
    "void at::native::vectorized_elementwise_kernel<8, at::native::FillFunctor<c10::BFloat16>, std::array<char*, "
    "1ul> >": "copy/cast",
    "Memset (Device)": "copy/cast",
    "void at::native::vectorized_elementwise_kernel<4, at::native::sigmoid_kernel_cuda": "elementwise",
    "some_kernel_nobody_named": "other",
}


@pytest.mark.parametrize("name, kind", KERNELS.items(), ids=list(KERNELS.values()))
def test_kernels_are_sorted_into_kinds_by_name(name, kind):
    assert kind_of(name) == kind


def test_idle_gaps_count_time_when_no_stream_runs_anything():
    # Two streams: b overlaps a, so only [30, 40) and [55, 60) are idle; c ends inside d.
    intervals = [(40.0, 50.0, "d"), (0.0, 20.0, "a"), (10.0, 30.0, "b"), (42.0, 45.0, "c"), (60.0, 61.0, "e"),
                 (50.0, 55.0, "f")]
    span, gaps = idle_gaps(intervals)
    assert span == 61.0
    assert gaps == [{"us": 10.0, "after": "b", "before": "d"}, {"us": 5.0, "after": "f", "before": "e"}]
    assert idle_gaps([]) == (0.0, [])


def test_the_summary_is_per_step_with_the_kinds_summed():
    kernels = [("_rows_gemm", 6000.0, 6), ("_wgrad_gemm", 3000.0, 3), ("Memset (Device)", 300.0, 30),
               ("cudaLaunchKernel", 0.0, 40)]  # host-side: no device time, left out
    summary = summarize(kernels, [(0.0, 4000.0, "_rows_gemm"), (5000.0, 9300.0, "_wgrad_gemm")], steps=3)
    assert summary["kernel_ms"] == pytest.approx(3.1)
    assert summary["kinds"] == {"gemm": {"ms": pytest.approx(3.0), "launches": 3.0},
                                "copy/cast": {"ms": pytest.approx(0.1), "launches": 10.0}}
    assert [k["name"] for k in summary["kernels"]] == ["_rows_gemm", "_wgrad_gemm", "Memset (Device)"]
    assert summary["span_ms"] == pytest.approx(3.1) and summary["idle_ms"] == pytest.approx(1 / 3)
    assert summary["gaps"] == [{"ms": 1.0, "after": "_rows_gemm", "before": "_wgrad_gemm"}]


def profile_json(path, which, kernels, intervals):
    path.write_text(json.dumps({"header": {"which": which, "device": "NVIDIA H200", "date": "2026-11-29"},
                                "label": f"{which} (configs/x.yaml)", "steps": 1,
                                **summarize(kernels, intervals, steps=1)}))
    return path


def test_compare_prints_each_kind_of_both_profiles_with_the_difference(tmp_path, capsys):
    ours = profile_json(tmp_path / "ours.json", "ours", [("_rows_gemm", 250_000.0, 32), ("_master_adamw_kernel",
                        52_000.0, 75)], [(0.0, 302_000.0, "_rows_gemm")])
    te = profile_json(tmp_path / "te.json", "te", [("nvjet_sm90_tst", 230_000.0, 400), ("dgated_act_kernel silu",
                      7_000.0, 8)], [(0.0, 230_000.0, "nvjet"), (246_000.0, 253_000.0, "dgated_act_kernel")])
    assert kernel_compare.main([str(ours), str(te)]) == 0
    out = capsys.readouterr().out
    assert "ours (configs/x.yaml): NVIDIA H200, 2026-11-29" in out
    assert "| gemm | 250.0 | 230.0 | +20.0 | 32 | 400 |" in out
    assert "| optimizer | 52.0 | 0.0 | +52.0 | 75 | 0 |" in out
    assert "| swiglu | 0.0 | 7.0 | -7.0 | 0 | 8 |" in out
    assert "| **all kernels** | 302.0 | 237.0 | +65.0 | 107 | 408 |" in out
    assert "| GPU idle inside the step | 0.0 | 16.0 | -16.0 |  |  |" in out
    # Kinds by the larger side's time, longest first.
    assert out.index("| gemm |") < out.index("| optimizer |") < out.index("| swiglu |")


def test_compare_refuses_a_file_it_cannot_read_in_one_line(tmp_path, capsys):
    (tmp_path / "bad.json").write_text("{")
    assert kernel_compare.main([str(tmp_path / "missing.json"), str(tmp_path / "bad.json")]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"kernel_compare: error: cannot read {tmp_path / 'missing.json'}")

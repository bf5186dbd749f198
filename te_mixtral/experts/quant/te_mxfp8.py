"""MXFP8 expert GEMMs through Transformer Engine on Blackwell (sm_100+).

NOT RUN ON BLACKWELL HARDWARE. This path is written to TE's documented API (TE 2.20.2
read, not executed, with MXFP8): `te.GroupedLinear` under `te.autocast(recipe=
MXFP8BlockScaling())`, with `m_splits` a CUDA tensor. What is tested: the row padding
(`padding.py`, on CPU) and, on an H100, this very plumbing under `Float8CurrentScaling`, a
recipe Hopper has (tests/gpu/test_device_mxfp8_gpu.py; docs/precision.md says what ran where
and how close it came). On Blackwell
the recipe differs, and so does TE's code path for device-side `m_splits` (below), which
Hopper's cuBLASLt 13.1 did not take.

Shape suffixes: see te_mixtral/__init__.py.

How the weights get in. `te.GroupedLinear` owns L weight parameters, but the model's
experts are two stacked parameters shared by every tier. The module here is built on the
meta device (it allocates nothing) and `torch.func.functional_call` hands it the stacked
weights' per-expert views for the duration of one call. That is PyTorch's public way to
run a module with other tensors as its parameters; autograd sees the views, so gradients
reach the stacked parameters (`unbind`'s backward stacks them once). Nothing is assigned
to `.data` and no private attribute is touched, the two ways of doing this that detach
weights from autograd.

Device-side split sizes. With `use_grouped_tensor=True` and a CUDA `m_splits`, TE's
grouped-tensor path reads the split sizes on the GPU only. TE takes that path on
Blackwell for MXFP8 with cuBLASLt 13.3 or newer
(`transformer_engine.pytorch.module.grouped_linear.is_module_grouped_tensor_path_supported`);
where it does not, TE copies `m_splits` to the host itself, and `kernel` says so.
"""

import torch
from torch.func import functional_call

from te_mixtral.experts.base import swiglu
from te_mixtral.experts.quant.padding import PaddedRows

# The release this was written against; its GroupedLinear has `use_grouped_tensor`, the
# device-side m_splits path. Older releases were not checked.
MIN_TE_VERSION = "2.20"

# Every expert's rows are padded to a multiple of 32 for MXFP8. The number comes from TE:
# `transformer_engine.pytorch.quantization.get_align_size_for_quantization(recipe)`
# (TE 2.20.2) returns 32 for `recipe.mxfp8()` ("Built-in recipes use their format
# requirement"), and `te.pytorch.Fp8Padding`'s docstring says "32 for MXFP8, 128 for
# NVFP4, 16 for other built-in recipes". The format is why: the weight-gradient GEMM
# reduces over an expert's rows, so TE also quantises activations and output gradients
# columnwise, in blocks of 32 consecutive rows, and a block must not straddle two
# experts. `TEGroupedExperts.row_align` asks TE at run time; this constant is the value it
# returns for MXFP8, for code and tests that run without TE.
MXFP8_ROW_ALIGN = 32


def _te():
    from te_mixtral.te_support import require_te

    return require_te(MIN_TE_VERSION)


class TEGroupedExperts:
    """The expert MLP as two `te.GroupedLinear` calls under a TE recipe (default MXFP8).

    `recipe` is a TE recipe object; None, what the tier uses, means `MXFP8BlockScaling()`.
    Tests on Hopper pass an FP8 recipe Hopper supports, to run the same plumbing there.
    """

    min_rows = 0

    def __init__(self, recipe=None):
        self._recipe = recipe
        self._modules: dict[tuple, torch.nn.Module] = {}

    @property
    def te_recipe(self):
        if self._recipe is None:
            from transformer_engine.common.recipe import MXFP8BlockScaling

            self._recipe = MXFP8BlockScaling()
        return self._recipe

    @property
    def recipe(self) -> str:
        return "mxfp8-te" if self.te_recipe.mxfp8() else f"te-{type(self.te_recipe).__name__}"

    @property
    def row_align(self) -> int:
        from transformer_engine.pytorch.quantization import (
            get_align_size_for_quantization,
        )

        return get_align_size_for_quantization(self.te_recipe)

    @property
    def kernel(self) -> str:
        from transformer_engine.pytorch.module.grouped_linear import (
            is_module_grouped_tensor_path_supported,
        )

        name = f"te.GroupedLinear under {type(self.te_recipe).__name__} (TE {_te_version()})"
        # bf16: the activation dtype of CUDA training runs (torch.autocast).
        if is_module_grouped_tensor_path_supported(self.te_recipe, torch.bfloat16):
            return f"{name}, grouped-tensor path: m_splits stay on the GPU"
        return f"{name}, split-quantize path: TE copies m_splits to the host (a sync per projection)"

    def _grouped_linear(self, num_experts: int, in_features: int, out_features: int, dtype: torch.dtype):
        key = (num_experts, in_features, out_features, dtype)
        if key not in self._modules:
            self._modules[key] = _te().GroupedLinear(
                num_experts, in_features, out_features, bias=False, params_dtype=dtype,
                device="meta", use_grouped_tensor=True,
            )
        return self._modules[key]

    def _linear(self, x_QI, splits_L, w_LNI):
        module = self._grouped_linear(w_LNI.shape[0], w_LNI.shape[2], w_LNI.shape[1], w_LNI.dtype)
        weights = {f"weight{e}": w_NI for e, w_NI in enumerate(w_LNI.unbind(0))}
        return functional_call(module, weights, (x_QI, splits_L))

    def mlp(self, x_QD: torch.Tensor, padded: PaddedRows, gate_up_L2FD, down_LDF) -> torch.Tensor:
        te = _te()
        # The weights go in as they are (fp32 or bf16 masters): TE quantises them itself.
        with te.autocast(enabled=True, recipe=self.te_recipe):
            h_Q2F = self._linear(x_QD, padded.splits_L, gate_up_L2FD)
            return self._linear(swiglu(h_Q2F), padded.splits_L, down_LDF)


def _te_version() -> str:
    from te_mixtral.te_support import te_version

    return te_version() or "?"


def unavailable_reason() -> str | None:
    """Why TE's MXFP8 recipe cannot run on the current CUDA device, or None if it can."""
    from te_mixtral.te_support import TEUnavailable

    try:
        te = _te()
    except TEUnavailable as error:
        return error.reason
    available, reason = te.is_mxfp8_available(return_reason=True)
    return None if available else reason

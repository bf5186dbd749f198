"""FP8 (E4M3) grouped GEMMs on Hopper tensor cores, rowwise scaled, split sizes on the device.

Shape suffixes: see te_mixtral/__init__.py.

Hopper (sm_90) has FP8 tensor cores but no MXFP8 (block-scaled) instructions; those
arrive with Blackwell. The finest scaling its grouped GEMM offers through PyTorch is
rowwise: `torch._scaled_grouped_mm` multiplies each output element by one float32 scale
of its row of A and one of its column of B, in the epilogue. So every operand row (A) and
every operand column (B) gets its own scale, taken over the GEMM's reduction dim:

    fprop  y = x w^T    x: one scale per row (over I); w: one per expert and output channel
    dgrad  dx = dy w    dy: one per row (over N);       w: one per expert and input channel
    wgrad  dw = dy^T x  dy, x: one per expert and channel, over that expert's rows only

Each scale is amax / 448 (computed as amax * (1 / 448)), so the largest value of its row
lands on E4M3's largest finite value (an all-zero row gets a tiny scale instead of a
division by zero). All operands are E4M3, in backward too: this kernel takes no E5M2, and
per-row scales leave gradients less need of E5M2's range than one scale per tensor would.
Accumulation is float32 in the tensor cores (`use_fast_accum=False`), the output bfloat16.

What `torch._scaled_grouped_mm` (PyTorch 2.11, CUDA) requires, and where we meet it:
- A row-major, B column-major (`w_GNI.transpose(-2, -1)` of a contiguous w is).
- I and N multiples of 16 (Mixtral's 4096 and 14336 are).
- `offs` int32, the running end of each group's rows.
- Scales float32: A's 1-D over its rows; B's [G, N] for a 3-D B. When both operands are
  2-D (wgrad, groups cut along the reduction dim) scales are 1-D, group-major: A's
  [G * M], B's [G * N].
- In the 2-D x 2-D case a group's row count must be a positive multiple of 16 (each group
  starts a new TMA tile, 16-byte aligned in FP8, and CUTLASS rejects an empty group), a
  device-side assert, not a Python error. Hence `row_align = min_rows = 16`.
Everything stays on the device: the kernel reads `offs` on the GPU, so no split size ever
reaches the host. The `device_mxfp8` tier runs these GEMMs on the Triton kernels of
`kernels/scaled_grouped_mm.py`, which take the same arguments and compute the same product
with Hopper's native FP8 accumulation, faster (that module says by how much), for any split:
there it pads nothing.
"""

import weakref
from functools import partial

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

E4M3_MAX = 448.0
# scale = amax * (1 / 448), a product rather than a division: PyTorch's CUDA division by a
# number multiplies by its reciprocal, which rounds unlike a true division, while a product
# rounds the same everywhere, so the Triton quantisers (fp8_cast.py) match these bit for bit.
INV_E4M3_MAX = 1.0 / E4M3_MAX
# Rows whose amax is 0 would get scale 0 and divide by it; any positive scale quantises
# zeros to zeros.
MIN_AMAX = 1e-12
_ROWS_PER_CHUNK = 16


def quantize_rowwise(x: torch.Tensor, dim: int = -1,
                     value_dtype=torch.float8_e4m3fn) -> tuple[torch.Tensor, torch.Tensor]:
    """E4M3 values of `x` (made contiguous) and float32 scales, one per slice along `dim`
    (that dim removed). x may be a transposed view: the copy happens in 8 bits.
    `value_dtype` float32 keeps the scaled values unrounded (the tests' data-flow checks)."""
    x32 = x.float()
    scale = x32.abs().amax(dim, keepdim=True).clamp(min=MIN_AMAX) * INV_E4M3_MAX
    values = (x32 / scale).clamp(-E4M3_MAX, E4M3_MAX).to(value_dtype)
    return values.contiguous(), scale.squeeze(dim)


def quantize_columns_per_group(x_QC: torch.Tensor, offsets_G: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For wgrad: x_CQ, the transpose of x in E4M3, and scales_GC (flattened, group-major):
    one scale per column per group, over that group's rows only.

    Every group's rows are a multiple of 16, so the per-group amax is a max over 16-row
    chunks, each wholly inside one group; a scatter-max (no host sync) folds the chunks
    of a group together.
    """
    rows_Q, cols_C = x_QC.shape
    num_groups = offsets_G.numel()
    chunks = x_QC.float().reshape(rows_Q // _ROWS_PER_CHUNK, _ROWS_PER_CHUNK, cols_C)
    chunk_starts = torch.arange(0, rows_Q, _ROWS_PER_CHUNK, device=x_QC.device, dtype=offsets_G.dtype)
    group_of_chunk = torch.searchsorted(offsets_G, chunk_starts, right=True).clamp(max=num_groups - 1)

    amax_GC = chunks.new_zeros(num_groups, cols_C).scatter_reduce_(
        0, group_of_chunk[:, None].expand(-1, cols_C), chunks.abs().amax(1), reduce="amax"
    )
    scale_GC = amax_GC.clamp(min=MIN_AMAX) * INV_E4M3_MAX
    values = (chunks / scale_GC[group_of_chunk][:, None, :]).clamp(-E4M3_MAX, E4M3_MAX)
    values_CQ = values.to(torch.float8_e4m3fn).reshape(rows_Q, cols_C).t().contiguous()
    return values_CQ, scale_GC.reshape(-1)


class _WeightCache:
    """FP8 copies of the expert weights, made once per optimizer step.

    A weight is read by every micro-batch's forward, again by a recomputed forward, and by
    every backward's dgrad; quantising it each time would cost a pass over every expert
    weight per GEMM. An entry is the weight's FP8 operands, valid while it is the same
    tensor (a weak reference, so a freed tensor whose memory is reused cannot match) at the
    same version (an in-place write through PyTorch bumps it). Kernels that write
    parameters in place without bumping the version exist (our Triton AdamW, FSDP's
    all-gather), so every `torch.optim.Optimizer.step` also empties the cache, through
    torch's global post-step hook. Held: one byte per weight element per orientation.
    """

    def __init__(self):
        self._entries: dict[int, tuple] = {}
        this = weakref.ref(self)
        handle = register_optimizer_step_post_hook(lambda *_: this() and this().clear())
        weakref.finalize(self, handle.remove)

    def clear(self) -> None:
        self._entries.clear()

    def get(self, w: torch.Tensor, make):
        entry = self._entries.get(id(w))
        if entry is not None and entry[0]() is w and entry[1] == w._version:
            return entry[2]
        value = make(w)
        self._entries = {k: e for k, e in self._entries.items() if e[0]() is not None}
        self._entries[id(w)] = (weakref.ref(w), w._version, value)
        return value


class FP8HopperGemms:
    """The three GEMMs of a grouped linear in FP8 E4M3 with rowwise scales, on sm_90.

    `scaled_grouped_mm` is the kernel: a function with `torch._scaled_grouped_mm`'s
    arguments and results (less `use_fast_accum`), `kernel` its description. By default
    `torch._scaled_grouped_mm` with exact accumulation; `fp8_swiglu.FP8SwiGLUExperts` passes
    the faster Triton kernels of `kernels/scaled_grouped_mm.py`, tests a float64 stand-in.
    `quantizers` is three functions with the signatures of `fp8_cast.quantize_rows`,
    `quantize_columns` and `quantize_weight`: those Triton kernels on the GPU
    (`fp8_swiglu.FP8SwiGLUExperts` passes them), this module's PyTorch reference by default.
    `out_dtype` is the GEMMs' output dtype (bf16; float32 lets a test run the data flow
    exactly, with unrounded values in place of FP8 ones). `fuses_add`: the kernel takes an
    `add` tensor into its fprop and dgrad (ours does); otherwise it is added after.
    """

    recipe = "fp8-rowwise"
    row_align = _ROWS_PER_CHUNK
    min_rows = _ROWS_PER_CHUNK

    def __init__(self, scaled_grouped_mm=None, quantizers=None, out_dtype=torch.bfloat16, kernel=None,
                 cache_weights=True, fuses_add=False):
        self._mm = scaled_grouped_mm or partial(torch._scaled_grouped_mm, use_fast_accum=False)
        self.fuses_add = fuses_add
        self.gemm_kernel = kernel or "torch._scaled_grouped_mm (CUTLASS sm90 FP8 rowwise, exact accumulation)"
        self.rows, self.columns, self._quantize_weight = quantizers or (
            quantize_rowwise, quantize_columns_per_group, _reference_quantize_weight)
        self.out_dtype = out_dtype
        self._weights = _WeightCache() if cache_weights else None

    @property
    def kernel(self) -> str:
        weights = "once per optimizer step" if self._weights is not None else "at every use"
        return f"{self.gemm_kernel}; E4M3 in fprop, dgrad and wgrad; weights quantised {weights}"

    def gemm(self, a, b, scale_a, scale_b, offsets_G, add=None, **options):
        """The kernel's product, plus `add` (the product's shape) where given."""
        if add is not None and self.fuses_add:
            options["add"] = add
        out = self._mm(a, b, scale_a, scale_b, offs=offsets_G, out_dtype=self.out_dtype, **options)
        return out + add if add is not None and not self.fuses_add else out

    def weight(self, w_GNI):
        """w's FP8 operands: (w_q, scale_GN) along I for fprop, (wt_q [G, I, N], scale_GI)
        along N for dgrad; cached for the optimizer step unless `cache_weights` is off: then
        made at every call, and held only by their caller (with recompute, only while a
        layer runs)."""
        if self._weights is None:
            return self._quantize_weight(w_GNI)
        return self._weights.get(w_GNI, self._quantize_weight)

    def fprop(self, x_QI, weight, offsets_G, add=None):
        return self.fprop_quantised(*self.rows(x_QI), weight, offsets_G, add)

    def dgrad(self, dy_QN, weight, offsets_G, add=None):
        return self.dgrad_quantised(*self.rows(dy_QN), weight, offsets_G, add)

    def wgrad(self, dy_QN, x_QI, offsets_G):
        return self.wgrad_quantised(*self.columns(dy_QN, offsets_G), *self.columns(x_QI, offsets_G), offsets_G)

    # The same three GEMMs on operands already cast (fp8_swiglu.py casts some of them itself,
    # fused with the SwiGLU): A as `rows` gives it, and for wgrad both as `columns` does.

    def fprop_quantised(self, x_q, x_scale_Q, weight, offsets_G, add=None):
        (w_q, w_scale_GN), _ = weight
        return self.gemm(x_q, w_q.transpose(-2, -1), x_scale_Q, w_scale_GN, offsets_G, add)

    def dgrad_quantised(self, dy_q, dy_scale_Q, weight, offsets_G, add=None):
        _, (wt_q, wt_scale) = weight  # B must be column-major [G, N, I]: w^T [G, I, N] contiguous
        return self.gemm(dy_q, wt_q.transpose(-2, -1), dy_scale_Q, wt_scale, offsets_G, add)

    def wgrad_quantised(self, dy_NQ, dy_scale_GN, x_IQ, x_scale_GI, offsets_G, **options):
        """`options` go to the kernel: `add_into` where it is `kernels/scaled_grouped_mm.py`'s."""
        return self.gemm(dy_NQ, x_IQ.t(), dy_scale_GN, x_scale_GI, offsets_G, **options)


def _reference_quantize_weight(w_GNI):
    """`fp8_cast.quantize_weight` in PyTorch: both orientations of w, each by its own pass."""
    w_GNI = w_GNI.detach()
    return quantize_rowwise(w_GNI), quantize_rowwise(w_GNI.transpose(-2, -1))

"""Low-precision numerics for the expert GEMMs, one recipe per file.

Shape suffixes: see te_mixtral/__init__.py.

- `mxfp8.py`: the MXFP8 format per the OCP MX spec (quantise, dequantise) and MXFP8
  GEMMs emulated on any device.
- `fp8_hopper.py`: FP8 E4M3 GEMMs with rowwise scales on Hopper tensor cores.
- `fp8_cast.py`: the Triton casts to FP8 that `fp8_hopper.py` and `fp8_swiglu.py` use,
  SwiGLU and its gradient fused into them.
- `fp8_swiglu.py`: the expert MLP in FP8 on Hopper with fewer passes over its rows: what
  mode `fp8-hopper` runs.
- `frozen.py`: what a frozen LoRA base held in a quantised format shares: rows filled as
  a checkpoint loads, seeded draws, buffers outside the state dict.
- `frozen_fp8.py`: a frozen LoRA base's expert weights held in FP8 alone, quantised once
  as they load (mode `fp8-hopper` with LoRA).
- `nf4.py`: QLoRA's 4-bit NormalFloat format (quantise, dequantise).
- `frozen_nf4.py`: a frozen LoRA base's expert weights held in NF4 alone (`lora.base nf4`,
  tier `custom_grouped`, whose kernels dequantise it tile by tile, or whole before each GEMM
  with many rows per expert).
- `te_mxfp8.py`: MXFP8 on Blackwell through Transformer Engine.
- `scaled_grouped.py`: the grouped linear autograd Function the emulated and Hopper
  recipes plug into, and the SwiGLU MLP built from two.
- `padding.py`: per-expert row padding to a recipe's alignment, on the device.

The `device_mxfp8` expert tier (`te_mixtral/experts/device_mxfp8.py`) picks one of the 8-bit
recipes; docs/precision.md says what each computes and where it was run.
"""

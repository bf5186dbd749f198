"""Low-precision numerics for the expert GEMMs, one recipe per file.

- `mxfp8.py`: the MXFP8 format per the OCP MX spec (quantise, dequantise) and MXFP8
  GEMMs emulated on any device.
- `fp8_hopper.py`: FP8 E4M3 GEMMs with rowwise scales on Hopper tensor cores.
- `te_mxfp8.py`: MXFP8 on Blackwell through Transformer Engine.
- `scaled_grouped.py`: the grouped linear autograd Function the first two plug into.
- `padding.py`: per-expert row padding to a recipe's alignment, on the device.

The `device_mxfp8` expert tier (`te_mixtral/experts/device_mxfp8.py`) picks one;
docs/precision.md says what each computes and where it was run.
"""

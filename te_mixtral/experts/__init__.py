"""The expert FFN, in tiers behind one interface.

Shape suffixes: see te_mixtral/__init__.py.

Every tier is an `ExpertTier` (`base.py`): rows sorted by local expert and their counts
per expert in, the SwiGLU MLP's output rows out, over one parameter layout (`gate_up_L2FD`,
`down_LDF`), so a checkpoint trained with one tier loads into any other. `registry.py`
names them; a run picks one by `tier`.

    base.py             the ExpertTier interface and swiglu
    registry.py         every name a run's `tier` takes: the expert tiers and the
                        whole-model baselines (hf, hf_eager)
    adapters.py         ExpertAdapters: LoRA's expert adapters as a tier receives them
    options.py          the tiers' own options as the config holds them (the `fp8`
                        section), their choices as Literals; imports no torch
    grouped_mm.py       per-expert GEMMs through torch's F.grouped_mm, aligned
    loop.py             tier `loop`
    grouped_linear.py   tier `grouped_linear`
    custom_grouped.py   tier `custom_grouped`
    device_mxfp8.py     tier `device_mxfp8`
    kernels/            Triton kernels: grouped GEMMs whose split sizes stay on the device
    quant/              8-bit recipes: formats, casts and the scaled grouped GEMMs; the
                        frozen LoRA bases held in FP8 or NF4

Each tier and what it runs:

    loop            one F.linear per expert in a Python loop; the reference every tier is
                    tested against (adapters by the same loop)
    grouped_linear  Transformer Engine's general_grouped_gemm, SwiGLU in PyTorch between
                    the two grouped GEMMs (adapters by the same TE GEMM)
    custom_grouped  on CUDA kernels/grouped_swiglu.py, the whole FFN as one autograd op
                    (kernels/grouped_gemm.py, wgrad_gemm.py, schedule.py, epilogue.py,
                    grad_accumulation.py, tma_host.py); elsewhere grouped_mm.py; adapters
                    fused into the op's epilogues (adapters.with_fused_adapters); with
                    `lora.base nf4` a frozen base held in NF4 (quant/frozen_nf4.py)
    device_mxfp8    rows padded per expert to the mode's alignment (quant/padding.py;
                    fp8-hopper needs none), then by mode:
                    fp8-hopper      quant/fp8_swiglu.py: FP8 E4M3 with row-wise scales
                                    (quant/fp8_hopper.py), SwiGLU fused into the casts
                                    (quant/fp8_cast.py), GEMMs on
                                    kernels/scaled_grouped_mm.py; with LoRA a frozen base
                                    held in FP8 alone (quant/frozen_fp8.py); below
                                    fp8.min_rows_per_expert, custom_grouped's BF16 kernels
                    mxfp8-te        quant/te_mxfp8.py: Transformer Engine's MXFP8 on
                                    Blackwell
                    mxfp8-emulated  quant/scaled_grouped.py over quant/mxfp8.py: MXFP8
                                    numerics on any device

This file imports nothing, so that importing the registry (as the command line's checks
do, before anything heavy) costs only the registry's own imports.
"""

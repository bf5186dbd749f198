"""Hand-written GPU kernels (Triton) used by the faster expert tiers.

Shape suffixes: see te_mixtral/__init__.py.

Split sizes never leave the GPU: every kernel reads `tokens_per_expert_L` itself and
schedules its tiles from it, so no call synchronises with the host. Under
TRITON_INTERPRET=1 the same kernels run on CPU tensors (the tests' way, in fp32).

    grouped_swiglu.py     the expert FFN as one autograd op (six grouped GEMMs, SwiGLU
                          fused into their epilogues), and its tile tables by regime:
                          what tier custom_grouped runs on CUDA
    grouped_gemm.py       `_rows_gemm`: out[rows of e] = A[rows of e] @ B_e, with SwiGLU
                          or scaled epilogues, its last round streamed (stream_k.py); B may
                          be NF4, dequantised tile by tile in the K loop (nf4_decode.py)
    nf4_operand.py        a stacked weight in NF4 as the kernels read it
    nf4_decode.py         NF4 decoded: a B tile in registers (the K loop's), or a whole weight
                          in one bandwidth-bound pass into a transient BF16 copy
    wgrad_gemm.py         `_wgrad_gemm`: the weight gradients, the rows as reduction dim
    scaled_grouped_mm.py  FP8 grouped GEMMs with row-wise scales on the two kernels above,
                          in torch._scaled_grouped_mm's signature (device_mxfp8's fp8-hopper)
    schedule.py           what both kernels share: the tile configuration, the persistent
                          programs' count and the device-side tile schedule
    stream_k.py           the row GEMM's last, part-filled round of tiles dealt out to all
                          its programs, and the sum of a tile's pieces
    epilogue.py           register-tile helpers both kernels' epilogues share
    grad_accumulation.py  adding a weight gradient into `.grad` where micro-batches sum
    tma_host.py           host-built TMA descriptors, when tensors allow them, and the CUDA
                          context the driver needs to build them
    compile_ahead.py      a launch compiled for a GPU that is not here (a CPU test's check
                          of the tiles' shared memory on each GPU a tier claims)
"""

"""Benchmarks: what our parts and runs cost, measured beside the peers they answer.

Every script runs from the repository root as `python3 -m benchmarks.NAME` (`--help` says
how), prints the run header (date, device, versions) once, and writes its numbers with
`--json FILE` where it has a table to keep; benchmarks/README.md says what each measures,
against which peer, and where its results go.

Shared pieces
- common.py          the Mixtral shapes, the one timer (`median_ms`), the run header, `--json`
- custom_grouped_ops.py  the custom_grouped op's inputs, six GEMMs, tile candidates and its
                     two op timers (cold-L2 `bench`, host-ahead `gpu_ms`)
- gemm_floors.py     a profiled step's kernels by which of the op's six GEMMs launched them,
                     each GEMM against its own bytes and FLOPs, and its grid
- peers.py           8-bit expert FFNs of other libraries (TE's FP8 recipes, torchao)
- peer_workload.py   the rows the peer training runs train on, and their one-line report

The expert FFN layer (forward + backward)
- expert_ffn.py      every expert tier and the 8-bit peers at Mixtral shapes, with ceilings
- custom_grouped_bench.py  our BF16 op against grouped_mm, with a tile sweep (--sweep)
- custom_grouped_grid.py   our BF16 op against the best of TE and grouped_mm over a grid
- custom_grouped_gemms.py  each of its six GEMMs tile by tile, checked, against cuBLAS and grouped_mm
- custom_grouped_host_time.py  host time against GPU time at few rows
- op_profile.py      where one call's time goes, op beside op: kernels, each GEMM, idle, host

FP8 (the device_mxfp8 tier's fp8-hopper mode)
- fp8_gemms.py       its grouped GEMMs against torch._scaled_grouped_mm (CUTLASS)
- fp8_casts.py       its casts alone, per tile shape
- fp8_break_even.py  where FP8 starts to beat BF16, by rows per expert
- fp8_accuracy.py    how far each 8-bit FFN lands from float64
- fp8_row_counts.py  whether its kernels compile again as a rank's row count grows
- lora_fp8_base.py   LoRA over an FP8 frozen base against a BF16 one, in accuracy

NF4 (LoRA's 4-bit frozen base, `--lora.base nf4`)
- nf4_accuracy.py    LoRA over an NF4 frozen base against a BF16 one, beside bitsandbytes' NF4
- four_bit_formats.py  NF4 against INT4 and MXFP4: each format's round-trip error (CPU)
- lora_base_compare.py  what the two accuracy scripts share: one LoRA step, errors between bases

Whole steps
- optimizer_step.py  one AdamW step of several optimizers against the bandwidth floor
- training_core.py   the app's bf16-master core against its fp32 one, run by run
- te_example.py      TE's own te_mixtral example trained at our workload
- peft_peer.py       transformers + PEFT LoRA trained at our workload
- axolotl_peer.py    axolotl's ScatterMoE-LoRA (and its QLoRA) trained at our workload
- torchtitan_peer.py torchtitan's MoE at Mixtral's shapes, its EP, trained at our workload
- kernel_profile.py  kernel time per step by kind, for our run or TE's example
"""

#!/usr/bin/env bash
# LoRA on GPUs, in one go: the adapter tests, then Mixtral-8x7B runs named on the command line.
#
# Usage: scripts/lora_gpu.sh OUT_DIR RUN [RUN ...]
#   RUN is one of
#     lora-tests     the GPU tests of the adapters alone (LoRA, its memory estimate, its recompute)
#     fp8-tests      the GPU tests of the device_mxfp8 tier
#     tests          the GPU tests of the adapters and of the kernels they run in
#     full-8layer    8 layers, every weight trained (bf16 parameters, master_adamw)
#     lora-8layer    8 layers, LoRA r=16 on every target
#     lora-32layer   all 32 layers, LoRA r=16, selective recompute (one H200 holds it)
#     lora-32layer-ep2   all 32 layers, LoRA r=16, EP=2 on two GPUs, no recompute (two H200s hold it)
#     lora-32layer-ep2-full   the same with full recompute (two H100s hold it)
#     lora-32layer-ep4   all 32 layers, LoRA r=16, EP=4 on four GPUs, selective recompute (beside
#                        scripts/depth_gpu.sh's full-ep4, full fine-tuning at the same setting)
#     lora-fp8-8layer    8 layers, LoRA r=16 over the FP8 base (beside lora-8layer)
#     lora-fp8-32layer   all 32 layers, LoRA r=16 over the FP8 base (device_mxfp8), selective recompute
#                        (one H100 holds it)
#     lora-fp8-32layer-norecompute   the same without recompute (one H200 holds it)
#     fp8-accuracy   the FP8 base against the BF16 base on one batch (benchmarks/lora_fp8_base.py), 1 and 4 layers
#     nf4-tests      the GPU tests of the NF4 base (tests/gpu/test_nf4_gpu.py; its bitsandbytes test needs
#                    bitsandbytes installed, e.g. pip install --no-deps .whl/bitsandbytes-*.whl, else it skips)
#     nf4-accuracy   the NF4 base against the BF16 base on one batch, 1 and 4 layers, beside bitsandbytes'
#                    NF4 on the same weights (benchmarks/nf4_accuracy.py; without bitsandbytes, ours alone)
#     lora-nf4-32layer       all 32 layers, LoRA r=16 over the NF4 base (--lora.base nf4), selective recompute
#     lora-nf4-32layer-full  the same with full recompute (the estimate's fit for a 48 GB card)
#     lora-nf4-8x22b the whole Mixtral-8x22B (56 layers), LoRA r=16 over the NF4 base, full recompute
#                    (one H200 holds it by the estimate, 102 GiB)
#     nf4            nf4-tests, nf4-accuracy and lora-nf4-32layer in one go
#     profile-8layer CUDA kernel time per step by kind (benchmarks/kernel_profile.py), 8 layers, LoRA r=16,
#                    device_mxfp8 (FP8 base) then custom_grouped (BF16 base)
#     peft-32layer   transformers + PEFT on all 32 layers, the same tokens, gradient checkpointing
#                    (benchmarks/peft_peer.py; one H200 holds it)
#     peft-32layer-ddp   the same on two GPUs under torchrun, DistributedDataParallel (two H200s)
# Every run: custom_grouped (BF16 base) unless named, one packed 8192-token sequence per GPU per
# step, 30 steps; the same seed, so the runs' losses step by step compare the bases.
# Transformer Engine and `datasets` must be importable (see scripts/gpu_check.sh).
USAGE="scripts/lora_gpu.sh OUT_DIR RUN [RUN ...]"
source "$(dirname "${BASH_SOURCE[0]}")/runs_common.sh"

FLAGS=(--tier custom_grouped --steps 30 --timing_warmup_steps 5 --warmup_steps 3 --lr 2e-5 --seq_len 8192
       --dtype bf16 --plots false)
COMMON=(--config configs/mixtral-8x7b.yaml "${FLAGS[@]}")
LORA=(--lora.rank 16)
# The peer's config: all 32 layers, one sequence per GPU, rank 16 and alpha 16 as ours.
PEER=(--config configs/mixtral-8x7b-lora.yaml --alpha 16)
train() {  # name, GPUs, extra arguments
    local name=$1 nproc=$2; shift 2
    step "$name"
    launch "$name" "$nproc" run_finetune_ep.py "${COMMON[@]}" --batch_size "$nproc" "$@" --output-dir "$OUT_DIR/$name"
}

runs=()
for run in "$@"; do  # a name that stands for several runs
    if [ "$run" = nf4 ]; then runs+=(nf4-tests nf4-accuracy lora-nf4-32layer); else runs+=("$run"); fi
done

for run in "${runs[@]}"; do
    case $run in
        lora-tests)
            step "$run"
            launch "$run" 1 -m pytest -q tests/gpu/test_lora_gpu.py tests/gpu/test_memory_lora_gpu.py \
                "tests/gpu/test_recompute_gpu.py::test_lora_gradients_equal_no_recompute_bf16" ;;
        fp8-tests)
            step "$run"
            launch "$run" 1 -m pytest -q tests/gpu/test_device_mxfp8_gpu.py ;;
        nf4-tests)
            step "$run"
            launch "$run" 1 -m pytest -q -rs tests/gpu/test_nf4_gpu.py ;;
        nf4-accuracy)
            step "$run"
            launch "$run" 1 -m benchmarks.nf4_accuracy --layers 1 4 ;;
        tests)
            step "$run"
            launch "$run" 1 -m pytest -q tests/gpu/test_lora_gpu.py tests/gpu/test_memory_lora_gpu.py \
                tests/gpu/test_custom_grouped_gpu.py tests/gpu/test_grouped_linear_gpu.py \
                tests/gpu/test_te_permute_gpu.py tests/gpu/test_device_mxfp8_gpu.py ;;
        full-8layer) train "$run" 1 --model.num_hidden_layers 8 --optimizer master_adamw ;;
        lora-8layer) train "$run" 1 --model.num_hidden_layers 8 "${LORA[@]}" ;;
        lora-32layer) train "$run" 1 "${LORA[@]}" --recompute selective ;;
        lora-32layer-ep2) train "$run" 2 "${LORA[@]}" --ep-size 2 ;;
        lora-32layer-ep2-full) train "$run" 2 "${LORA[@]}" --ep-size 2 --recompute full ;;
        lora-32layer-ep4) train "$run" 4 "${LORA[@]}" --ep-size 4 --recompute selective ;;
        lora-fp8-8layer) train "$run" 1 --model.num_hidden_layers 8 "${LORA[@]}" --tier device_mxfp8 ;;
        lora-fp8-32layer) train "$run" 1 "${LORA[@]}" --tier device_mxfp8 --recompute selective ;;
        lora-fp8-32layer-norecompute) train "$run" 1 "${LORA[@]}" --tier device_mxfp8 --recompute none ;;
        lora-nf4-32layer) train "$run" 1 "${LORA[@]}" --lora.base nf4 --recompute selective ;;
        lora-nf4-32layer-full) train "$run" 1 "${LORA[@]}" --lora.base nf4 --recompute full ;;
        lora-nf4-8x22b)
            step "$run"
            launch "$run" 1 run_finetune_ep.py --config configs/mixtral-8x22b.yaml "${FLAGS[@]}" --batch_size 1 \
                "${LORA[@]}" --lora.base nf4 --recompute full --output-dir "$OUT_DIR/$run" ;;
        fp8-accuracy)  # one layer: the op's own error; four: with the routing it changes downstream
            step "$run"
            for layers in 1 4; do
                launch "$run-$layers" 1 -m benchmarks.lora_fp8_base --layers $layers
            done ;;
        profile-8layer)  # kernel time by kind, 8 layers, LoRA: the FP8 base beside the BF16 one
            step "$run"
            for tier in device_mxfp8 custom_grouped; do
                python3 -m benchmarks.kernel_profile ours --config configs/mixtral-8x7b-lora.yaml --tier $tier \
                    --model.num_hidden_layers 8 --recompute none --lora.alpha 16 >"$OUT_DIR/$run-$tier.log" 2>&1 \
                    || failed+=("$run-$tier")
                grep -A40 "^=== " "$OUT_DIR/$run-$tier.log" | head -40
            done ;;
        peft-32layer)
            step "$run"
            launch "$run" 1 -m benchmarks.peft_peer "${PEER[@]}" --json "$OUT_DIR/$run.json" ;;
        peft-32layer-ddp)
            step "$run"
            launch "$run" 2 -m benchmarks.peft_peer "${PEER[@]}" --json "$OUT_DIR/$run.json" ;;
        *) echo "unknown run '$run'"; failed+=("$run") ;;
    esac
done
finish

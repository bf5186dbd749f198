#!/usr/bin/env bash
# What stands between a rank's share of the full Mixtral-8x7B and its targets, in one go: 16 layers
# at EP=2 on two GPUs with each recompute setting and tier, each with its phase profile, a kernel
# profile, the 2-layer one-GPU step, and the two peers (docs/full-model.md says why each).
#
# Usage: scripts/depth_gpu.sh OUT_DIR RUN [RUN ...]
#   RUN is one of
#     cg-none         16 layers, EP=2, custom_grouped, no recompute (fits 16 layers, not the full model)
#     cg-selective    the same, the expert FFN recomputed (what the full model at EP=4 needs)
#     cg-full         the same, every layer recomputed
#     gl-selective    grouped_linear (TE's GroupedLinear), selective recompute
#     fp8-selective   device_mxfp8, selective recompute, no FP8 weight cache (it does not fit with one)
#     profile         CUDA kernel time per step by kind (benchmarks/kernel_profile.py), custom_grouped,
#                     selective recompute, 16 layers, EP=2 (each rank prints its own)
#     2layer          2 layers on one GPU, custom_grouped, one causal 8192-token sequence, 30 steps,
#                     master_adamw (as the step it is to beat was measured)
#     titan           torchtitan's MoE at the same 16 layers, EP=2, tokens and GPUs
#                     (benchmarks/torchtitan_peer.py: varlen attention, bf16 training)
#     te-8layer       TE's te_mixtral example on one GPU at 8 layers, as before (16 do not fit one GPU)
#                     (benchmarks/te_example.py; needs .peers/te_mixtral_example)
#     ours-8layer     ours beside it: custom_grouped, 8 layers, one GPU
#     full-ep4        the full model itself: all 32 layers, EP=4 on four GPUs, custom_grouped,
#                     selective recompute (the estimate's choice), phase profile (four H200s)
#     fp8-full-ep4    the same with device_mxfp8, no FP8 weight cache
#     full-ep4-fewest full-ep4 with the expert FFN recomputed in the first 27 of the 32 layers only,
#                     the fewest that fit four H200s by the estimate (--estimate-memory 4 --gpu h200)
#     8layer-master   the loss reference for 8-bit moments: 8 layers on one GPU, custom_grouped,
#                     master_adamw as the config has it (bf16 moments), 200 steps on the embedded text
#     8layer-8bit     the same with the experts' moments in 8 bits (--expert_moments 8bit), its loss
#                     checked against 8layer-master's (run that first, in the same call)
#     full-ep4-8bit   full-ep4 with the experts' moments in 8 bits, recomputing the expert FFN in the
#                     first 11 of the 32 layers, the fewest that fit four H200s by the estimate (27
#                     without 8-bit moments; --recompute none needs 154 GiB a rank, not 140)
#     full-ep4-cN     full-ep4-fewest without its phase profile, each MoE layer's exchanges in N
#                     chunks overlapped with the experts (--ep_chunks N; c1: no overlap): the overlap's A/B
#     lora-ep4-cN     LoRA r=16 over the whole model at EP=4, custom_grouped, no recompute, --ep_chunks N
#     overlap-probe   whether an all-to-all runs under the expert GEMMs at all, four GPUs
#                     (benchmarks/overlap_probe.py)
#   Megatron-Core beside ours (benchmarks/megatron_peer.py, then our run at the same layers, EP,
#   GPUs and rows, both with Mixtral's load-balancing loss at 0.02; ROUNDS=N alternates the pair
#   N times, named NAME-1, NAME-2, ...):
#     megatron-4l-ep1          4 layers on one GPU; ours: custom_grouped, no recompute
#     megatron-8l-ep2          8 layers, EP=2 on two GPUs; ours: custom_grouped, no recompute
#     megatron-8l-ep2-overlap  the same with Megatron's MoE all-to-all overlap (--moe-overlap, each
#                              GPU's row cut into 2 micro-batches of 4096 tokens)
#     megatron-32l-ep4         the whole model, EP=4 on four GPUs; Megatron with its precision-aware
#                              optimizer (bf16 moments, 16-bit master remainders), bf16 gradients and
#                              full recompute of every layer, to fit; ours: full-ep4-fewest
# Every training run: full fine-tuning (no LoRA), bf16 parameters with master_adamw, the
# config's lr 2e-5, one packed 8192-token sequence per GPU per step, 15 steps of which the
# first 5 are left out of the timing (the phase profile runs after them), the same seed.
# Transformer Engine and `datasets` must be importable (see scripts/gpu_check.sh); torchtitan
# too for `titan`; megatron-core 0.19.2 for `megatron-*` (installed here, without its
# dependencies, from .whl/megatron_core-0.19.2-*.whl where it does not import).
# STOP_AFTER_S=N (optional): start no run once N seconds have gone, so that a call with a time
# limit still ends with its summary; the runs left out are named at the end.
USAGE="scripts/depth_gpu.sh OUT_DIR RUN [RUN ...]"
source "$(dirname "${BASH_SOURCE[0]}")/runs_common.sh"

DEPTH=configs/mixtral-8x7b-16layer-ep2.yaml
# The 16-layer config's training settings, on the full model at EP=4.
FULL=(configs/mixtral-8x7b.yaml --ep-size 4 --batch_size 4 --lr 2e-5 --warmup_steps 3 --dtype bf16
      --optimizer master_adamw --recompute selective --profile_phases true)
STEPS=(--steps 15 --timing_warmup_steps 5)
PEER_STEPS=(--steps 15 --warmup 5)
train() {  # name, GPUs, config, extra arguments
    local name=$1 nproc=$2 config=$3; shift 3
    step "$name"
    launch "$name" "$nproc" run_finetune_ep.py --config "$config" "${STEPS[@]}" --plots false "$@" \
        --output-dir "$OUT_DIR/$name"
}
beside() {  # name, GPUs, the peer's arguments (one string), ours' (config first): the pair, ROUNDS times
    local name=$1 nproc=$2 peer=$3 r tag; shift 3
    python3 -c "import megatron.core" 2>/dev/null || python3 -m pip install --no-deps --quiet \
        .whl/megatron_core-0.19.2-*.whl || { failed+=("$name (megatron-core)"); return; }
    for ((r = 1; r <= ${ROUNDS:-1}; r++)); do
        tag=$name; [ "${ROUNDS:-1}" -gt 1 ] && tag=$name-$r
        step "$tag-megatron"
        # shellcheck disable=SC2086  # the peer's arguments, one word each
        launch "$tag-megatron" "$nproc" -m benchmarks.megatron_peer $peer "${PEER_STEPS[@]}" \
            --json "$OUT_DIR/$tag-megatron.json"
        train "$tag-ours" "$nproc" "$@" --model.router_aux_loss_coef 0.02
    done
}
MEGATRON_FULL="--config configs/mixtral-8x7b.yaml --batch-size 4 --ep 4 --recompute full"
depth() {  # name, tier, recompute, extra arguments: a 16-layer EP=2 run with its phase profile
    local name=$1 tier=$2 recompute=$3; shift 3
    train "$name" 2 "$DEPTH" --ep-size 2 --tier "$tier" --recompute "$recompute" --profile_phases true "$@"
}

not_started=()
for run in "$@"; do
    if [ "${STOP_AFTER_S:-0}" -gt 0 ] && [ "$SECONDS" -ge "${STOP_AFTER_S:-0}" ]; then
        not_started+=("$run")
        continue
    fi
    case $run in
        cg-none) depth "$run" custom_grouped none ;;
        cg-selective) depth "$run" custom_grouped selective ;;
        cg-full) depth "$run" custom_grouped full ;;
        gl-selective) depth "$run" grouped_linear selective ;;
        fp8-selective) depth "$run" device_mxfp8 selective --fp8_weight_cache false ;;
        profile)
            step "$run"
            launch "$run" 2 -m benchmarks.kernel_profile ours --config "$DEPTH" --tier custom_grouped \
                --output-dir "$OUT_DIR/$run" --ep-size 2 --recompute selective
            grep -A12 "^=== " "$OUT_DIR/$run.log" ;;
        2layer) train "$run" 1 configs/mixtral-8x7b-2layer.yaml --tier custom_grouped --dtype bf16 --optimizer master_adamw \
            --steps 30 --profile_phases true ;;
        titan)
            step "$run"
            launch "$run" 2 -m benchmarks.torchtitan_peer --config "$DEPTH" --ep 2 --attention varlen \
                --dtype bfloat16 "${PEER_STEPS[@]}" --json "$OUT_DIR/$run.json" ;;
        te-8layer)
            step "$run"
            launch "$run" 1 -m benchmarks.te_example --example-dir .peers/te_mixtral_example \
                --config configs/mixtral-8x7b-8layer.yaml "${PEER_STEPS[@]}" --json "$OUT_DIR/$run.json" ;;
        ours-8layer) train "$run" 1 configs/mixtral-8x7b-8layer.yaml --tier custom_grouped ;;
        full-ep4) train "$run" 4 "${FULL[@]}" --tier custom_grouped ;;
        fp8-full-ep4) train "$run" 4 "${FULL[@]}" --tier device_mxfp8 --fp8_weight_cache false ;;
        full-ep4-fewest) train "$run" 4 "${FULL[@]}" --tier custom_grouped --recompute_layers 27 ;;
        full-ep4-c*) train "$run" 4 "${FULL[@]}" --tier custom_grouped --recompute_layers 27 --profile_phases false \
            --ep_chunks "${run#full-ep4-c}" ;;
        lora-ep4-c*) train "$run" 4 configs/mixtral-8x7b.yaml --ep-size 4 --batch_size 4 --lr 2e-5 --warmup_steps 3 \
            --dtype bf16 --tier custom_grouped --lora.rank 16 --recompute none --ep_chunks "${run#lora-ep4-c}" ;;
        overlap-probe)
            step "$run"
            launch "$run" 4 -m benchmarks.overlap_probe --json "$OUT_DIR/$run.json" ;;
        megatron-4l-ep1) beside "$run" 1 "--config configs/mixtral-8x7b-8layer.yaml --layers 4 --ep 1" \
            configs/mixtral-8x7b-8layer.yaml --model.num_hidden_layers 4 --tier custom_grouped ;;
        megatron-8l-ep2) beside "$run" 2 "--config $DEPTH --layers 8 --ep 2" \
            "$DEPTH" --model.num_hidden_layers 8 --ep-size 2 --recompute none --tier custom_grouped ;;
        megatron-8l-ep2-overlap) beside "$run" 2 "--config $DEPTH --layers 8 --ep 2 --moe-overlap --micro-batches 2" \
            "$DEPTH" --model.num_hidden_layers 8 --ep-size 2 --recompute none --tier custom_grouped ;;
        megatron-32l-ep4) beside "$run" 4 "$MEGATRON_FULL --precision-aware-optimizer --grads bf16" \
            "${FULL[@]}" --tier custom_grouped --recompute_layers 27 ;;
        8layer-master) train "$run" 1 configs/mixtral-8x7b-8layer.yaml --tier custom_grouped --steps 200 ;;
        8layer-8bit) train "$run" 1 configs/mixtral-8x7b-8layer.yaml --tier custom_grouped --steps 200 \
            --expert_moments 8bit --loss-check "$OUT_DIR/8layer-master/results.json" ;;
        full-ep4-8bit) train "$run" 4 "${FULL[@]}" --tier custom_grouped --expert_moments 8bit --recompute_layers 11 ;;
        *) echo "unknown run '$run'"; failed+=("$run") ;;
    esac
done
[ ${#not_started[@]} -eq 0 ] || { echo; echo "not started (past STOP_AFTER_S=$STOP_AFTER_S s): ${not_started[*]}"; }
finish

"""`depth`: what stands between a rank's share of the full Mixtral-8x7B and its targets: 16
layers at EP=2 on two GPUs with each recompute setting and tier, each with its phase profile, a
kernel profile, the 2-layer one-GPU step, the peers (torchtitan, TE's example, Megatron-Core),
the 8-layer kernel profiles beside TE's example and the TE backend's fusions with and without,
the expert GEMMs' tiles at the 8-layer step's rows, and the full model at EP=4
(docs/full-model.md says why each). Every training run, unless its comment says otherwise:
full fine-tuning, bf16 parameters with master_adamw, the config's lr 2e-5, one packed
8192-token sequence per GPU per step, 15 steps of which the first 5 are left out of the timing,
the same seed."""

from gpu_catalogs.launch import Launch, gemm_tiles, pytest_gpu

DEPTH = "configs/mixtral-8x7b-16layer-ep2.yaml"
# The 16-layer config's training settings, on the full model at EP=4.
FULL = ("configs/mixtral-8x7b.yaml", "--ep-size", "4", "--batch_size", "4", "--lr", "2e-5", "--warmup_steps", "3",
        "--dtype", "bf16", "--optimizer", "master_adamw", "--recompute", "selective", "--profile_phases", "true")
PEER_STEPS = ("--steps", "15", "--warmup", "5")


def depth_train(name: str, nproc: int, config: str, *extra: str) -> list[Launch]:
    return [Launch(name, nproc, ("run_finetune_ep.py", "--config", config, "--steps", "15", "--timing_warmup_steps",
                                 "5", "--plots", "false", *extra, "--output-dir", f"{{out}}/{name}"))]


# megatron-core 0.19.2 from the wheel carried in .whl/ where it does not import (its only
# dependencies, torch, numpy and packaging, are on the GPU image).
MEGATRON_INSTALL = Launch("megatron-core", 1, ("-c", "python3 -c 'import megatron.core' 2>/dev/null || python3 -m pip "
                                                     "install --no-deps --quiet .whl/megatron_core-0.19.2-*.whl"),
                          program=("bash",))


def beside_megatron(name: str, nproc: int, peer: tuple[str, ...], config: str, *ours: str) -> list[Launch]:
    """Megatron-Core's run, then ours at the same layers, EP, GPUs and rows, both with Mixtral's
    load-balancing loss at 0.02."""
    return [MEGATRON_INSTALL,
            Launch(f"{name}-megatron", nproc, ("-m", "benchmarks.megatron_peer", *peer, *PEER_STEPS, "--json",
                                               f"{{out}}/{name}-megatron.json")),
            *depth_train(f"{name}-ours", nproc, config, *ours, "--model.router_aux_loss_coef", "0.02")]


EIGHT = "configs/mixtral-8x7b-8layer.yaml"


def kernel_profile(name: str, which: str, *flags: str) -> Launch:
    """benchmarks/kernel_profile.py at 8 layers on one GPU (ours: custom_grouped), its table
    shown, its --json at OUT_DIR/NAME.json."""
    ours = ("--tier", "custom_grouped", "--output-dir", f"{{out}}/{name}") if which == "ours" else ()
    return Launch(name, 1, ("-m", "benchmarks.kernel_profile", which, "--config", EIGHT, *ours, *flags, "--json",
                            f"{{out}}/{name}.json"), tail=0, show=18)


# TE's te_mixtral example on one GPU at 8 layers (benchmarks/te_example.py; needs .peers/te_mixtral_example)
TE_8LAYER = Launch("te-8layer", 1, ("-m", "benchmarks.te_example", "--example-dir", ".peers/te_mixtral_example",
                                    "--config", EIGHT, *PEER_STEPS, "--json", "{out}/te-8layer.json"))


def kernel_compare(first: str, second: str, *names: str) -> Launch:
    """benchmarks/kernel_compare.py over two kernel_profile runs of the same call."""
    return Launch(f"compare-{first}-{second}", 1, ("-m", "benchmarks.kernel_compare", f"{{out}}/{first}.json",
                                                   f"{{out}}/{second}.json", *(("--names", *names) if names else ())),
                  tail=None)


# 16384 rows over 8 experts as unevenly as the 8-layer step's router on random weights (the
# busiest expert 1.68x the mean), the expert GEMMs' split in that step
SKEWED_8X2048 = "3441+2719+2243+1997+1838+1603+1399+1144"


def depth_16(name: str, tier: str, recompute: str, *extra: str) -> list[Launch]:
    """A 16-layer EP=2 run with its phase profile."""
    return depth_train(name, 2, DEPTH, "--ep-size", "2", "--tier", tier, "--recompute", recompute,
                       "--profile_phases", "true", *extra)


DEPTH_RUNS = {
    # 16 layers, EP=2, custom_grouped, no recompute (fits 16 layers, not the full model)
    "cg-none": depth_16("cg-none", "custom_grouped", "none"),
    # cg-none with each layer's experts placed on the two ranks by the load cg-none recorded
    # (--ep-placement; run cg-none first, in the same call): the busiest rank's wait, A/B
    "cg-none-placed": depth_16("cg-none-placed", "custom_grouped", "none", "--ep-placement",
                               "{out}/cg-none/results.json"),
    # the same, the expert FFN recomputed (what the full model at EP=4 needs)
    "cg-selective": depth_16("cg-selective", "custom_grouped", "selective"),
    # the same, every layer recomputed
    "cg-full": depth_16("cg-full", "custom_grouped", "full"),
    # grouped_linear (TE's GroupedLinear), selective recompute
    "gl-selective": depth_16("gl-selective", "grouped_linear", "selective"),
    # device_mxfp8, selective recompute, no FP8 weight cache (it does not fit with one)
    "fp8-selective": depth_16("fp8-selective", "device_mxfp8", "selective", "--fp8.weight_cache", "false"),
    # CUDA kernel time per step by kind (benchmarks/kernel_profile.py), custom_grouped, selective
    # recompute, 16 layers, EP=2 (each rank prints its own)
    "profile": [Launch("profile", 2, ("-m", "benchmarks.kernel_profile", "ours", "--config", DEPTH, "--tier",
                                      "custom_grouped", "--output-dir", "{out}/profile", "--ep-size", "2",
                                      "--recompute", "selective"), show=12)],
    # 2 layers on one GPU, custom_grouped, one causal 8192-token sequence, 30 steps, master_adamw
    # (as the step it is to beat was measured)
    "2layer": depth_train("2layer", 1, "configs/mixtral-8x7b-2layer.yaml", "--tier", "custom_grouped", "--dtype",
                          "bf16", "--optimizer", "master_adamw", "--steps", "30", "--profile_phases", "true"),
    # torchtitan's MoE at the same 16 layers, EP=2, tokens and GPUs (benchmarks/torchtitan_peer.py:
    # varlen attention, bf16 training)
    "titan": [Launch("titan", 2, ("-m", "benchmarks.torchtitan_peer", "--config", DEPTH, "--ep", "2", "--attention",
                                  "varlen", "--dtype", "bfloat16", *PEER_STEPS, "--json", "{out}/titan.json"))],
    # TE's te_mixtral example on one GPU at 8 layers (16 do not fit one GPU)
    # (benchmarks/te_example.py; needs .peers/te_mixtral_example)
    "te-8layer": [TE_8LAYER],
    # ours beside it: custom_grouped, 8 layers, one GPU
    "ours-8layer": depth_train("ours-8layer", 1, EIGHT, "--tier", "custom_grouped"),
    # the kernel profiles of both at 8 layers on one GPU (benchmarks/kernel_profile.py) and their
    # table side by side (benchmarks/kernel_compare.py)
    "kernels-vs-te": [kernel_profile("kernels-ours", "ours"), kernel_profile("kernels-te", "te"),
                      kernel_compare("kernels-ours", "kernels-te")],
    # the TE backend's fusions (--te_fusions) at 8 layers on one GPU: ours with them, TE's example,
    # ours without them (step times); then the three kernel profiles, ours against TE's and ours
    # with against without
    "fusions-8layer": [*depth_train("ours-8layer", 1, EIGHT, "--tier", "custom_grouped"),
                       TE_8LAYER,
                       *depth_train("ours-8layer-unfused", 1, EIGHT, "--tier", "custom_grouped", "--te_fusions",
                                    "false"),
                       kernel_profile("kernels-ours", "ours"), kernel_profile("kernels-te", "te"),
                       kernel_profile("kernels-ours-unfused", "ours", "--te_fusions", "false"),
                       kernel_compare("kernels-ours", "kernels-te"),
                       kernel_compare("kernels-ours", "kernels-ours-unfused", "fused", "unfused")],
    # custom_grouped's six expert GEMMs alone at the 8-layer step's rows (8 experts x 2048, and
    # its uneven split): every candidate tile of the table checked against torch, then timed in
    # turn beside cuBLAS per expert and grouped_mm; last the tile-table entries it would pick
    "gemm-tiles": [gemm_tiles("gemm-tiles", f"8x2048,{SKEWED_8X2048}")],
    # the same at the rows TE's example's router gave three of its layers in its last step (busiest
    # expert 3.55x, 3.77x and 2.84x the mean: te-gemms-by-shape's te-splits.json, layers 2, 4, 7)
    "gemm-tiles-te-rows": [gemm_tiles("gemm-tiles-te-rows", "3564+7277+67+1889+245+755+609+1978,"
                                      "175+474+2299+1069+988+22+7713+3644,429+5823+2663+5275+372+323+1491+8")],
    # the same at EP=2's rows (4 experts x 4096) and at 16 experts x 1024
    "gemm-tiles-ep": [gemm_tiles("gemm-tiles-ep", "4x4096,16x1024")],
    # TE's example's expert GEMMs by shape: 8 steps of it at 8 layers recording each layer's rows
    # per expert, then ours and TE's grouped GEMM at the last step's rows, layer by layer, GEMM by
    # GEMM (benchmarks/op_profile.py --cases-from), summed over the step
    "te-gemms-by-shape": [
        Launch("te-splits", 1, ("-m", "benchmarks.te_example", "--example-dir", ".peers/te_mixtral_example",
                                "--config", EIGHT, "--steps", "8", "--warmup", "3", "--splits-json",
                                "{out}/te-splits.json")),
        Launch("te-gemms-by-shape", 1, ("-m", "benchmarks.op_profile", "--family", "8x7b", "--cases-from",
                                        "{out}/te-splits.json", "--ops", "custom_grouped,TE", "--json",
                                        "{out}/te_gemms_by_shape.json"), tail=30)],
    # the fusions' GPU tests (tests/gpu/test_fusions_gpu.py)
    "fusion-tests": [Launch("fusion-tests", 1, ("-m", "pytest", "-q", "-rfEs", "tests/gpu/test_fusions_gpu.py"),
                            tail=None)],
    # the full model itself: all 32 layers, EP=4 on four GPUs, custom_grouped, selective recompute
    # (the estimate's choice), phase profile (four H200s)
    "full-ep4": depth_train("full-ep4", 4, *FULL, "--tier", "custom_grouped"),
    # the same with device_mxfp8, no FP8 weight cache
    "fp8-full-ep4": depth_train("fp8-full-ep4", 4, *FULL, "--tier", "device_mxfp8", "--fp8.weight_cache", "false"),
    # full-ep4 with the expert FFN recomputed in the first 27 of the 32 layers only, the fewest
    # that fit four H200s by the estimate (--estimate-memory 4 --gpu h200)
    "full-ep4-fewest": depth_train("full-ep4-fewest", 4, *FULL, "--tier", "custom_grouped", "--recompute_layers", "27"),
    # full-ep4-fewest without its phase profile, each MoE layer's exchanges in N chunks overlapped
    # with the experts (--ep_chunks N; c1: no overlap): the overlap's A/B
    **{f"full-ep4-c{n}": depth_train(f"full-ep4-c{n}", 4, *FULL, "--tier", "custom_grouped", "--recompute_layers",
                                     "27", "--profile_phases", "false", "--ep_chunks", str(n)) for n in (1, 2, 3)},
    # LoRA r=16 over the whole model at EP=4, custom_grouped, no recompute, --ep_chunks N
    **{f"lora-ep4-c{n}": depth_train(f"lora-ep4-c{n}", 4, "configs/mixtral-8x7b.yaml", "--ep-size", "4",
                                     "--batch_size", "4", "--lr", "2e-5", "--warmup_steps", "3", "--dtype", "bf16",
                                     "--tier", "custom_grouped", "--lora.rank", "16", "--recompute", "none",
                                     "--ep_chunks", str(n)) for n in (1, 2)},
    # The padded exchange's A/B (--ep_capacity: no host wait for split sizes; 0: exact splits),
    # 16 layers, EP=2, custom_grouped, selective recompute; then each one's kernel profile, whose
    # "GPU idle between kernels" line shows the host's waits
    **{f"ep2-cap{cap}": depth_16(f"ep2-cap{cap}", "custom_grouped", "selective", "--profile_phases", "false",
                                 "--ep_capacity", cap) for cap in ("0", "1.5")},
    **{f"profile-ep2-cap{cap}": [Launch(f"profile-ep2-cap{cap}", 2, (
        "-m", "benchmarks.kernel_profile", "ours", "--config", DEPTH, "--tier", "custom_grouped", "--output-dir",
        f"{{out}}/profile-ep2-cap{cap}", "--ep-size", "2", "--recompute", "selective", "--ep_capacity", cap),
        show=12)] for cap in ("0", "1.5")},
    # lora-ep4-c1 with the padded exchange
    "lora-ep4-cap1.5": depth_train("lora-ep4-cap1.5", 4, "configs/mixtral-8x7b.yaml", "--ep-size", "4",
                                   "--batch_size", "4", "--lr", "2e-5", "--warmup_steps", "3", "--dtype", "bf16",
                                   "--tier", "custom_grouped", "--lora.rank", "16", "--recompute", "none",
                                   "--ep_capacity", "1.5"),
    # whether an all-to-all runs under the expert GEMMs at all, four GPUs (benchmarks/overlap_probe.py)
    "overlap-probe": [Launch("overlap-probe", 4, ("-m", "benchmarks.overlap_probe", "--json",
                                                  "{out}/overlap-probe.json"), tail=None)],
    # the AdamW kernels on CUDA, bit for bit against the torch path on the CPU (compiled without
    # fused multiply-adds), then the optimizer step's time against its bandwidth floor
    "moments8-tests": [*pytest_gpu("adamw-kernel-tests", "-rs", "tests/optim/test_adamw_kernel.py", "-k",
                                   "cuda or compiled"),
                       Launch("optimizer-step", 1, ("-m", "benchmarks.optimizer_step", "--json",
                                                    "{out}/optimizer_step.json"), tail=30)],
    # the loss reference for 8-bit moments: 8 layers on one GPU, custom_grouped, master_adamw as
    # the config has it (bf16 moments), 200 steps on the embedded text
    "8layer-master": depth_train("8layer-master", 1, "configs/mixtral-8x7b-8layer.yaml", "--tier", "custom_grouped",
                                 "--steps", "200"),
    # the same with the experts' moments in 8 bits (--expert_moments 8bit), its loss checked
    # against 8layer-master's (run that first, in the same call)
    "8layer-8bit": depth_train("8layer-8bit", 1, "configs/mixtral-8x7b-8layer.yaml", "--tier", "custom_grouped",
                               "--steps", "200", "--expert_moments", "8bit", "--loss-check",
                               "{out}/8layer-master/results.json"),
    # the loss check's noise: a change known to be correct (TE's GroupedLinear for the experts: the
    # same sums in another order), 200 steps as 8layer-master, compared with it as 8layer-8bit is
    "8layer-control": depth_train("8layer-control", 1, "configs/mixtral-8x7b-8layer.yaml", "--tier", "grouped_linear",
                                  "--steps", "200"),
    # full-ep4 with the experts' moments in 8 bits, recomputing the expert FFN in the first 11 of
    # the 32 layers, the fewest that fit four H200s by the estimate (27 without 8-bit moments;
    # --recompute none needs 154 GiB a rank, not 140)
    "full-ep4-8bit": depth_train("full-ep4-8bit", 4, *FULL, "--tier", "custom_grouped", "--expert_moments", "8bit",
                                 "--recompute_layers", "11"),
    # what the estimate, corrected by the whole-model runs, fits on four H200s: 8-bit expert
    # moments with no recompute at all, and bf16 moments recomputing the expert FFN in 20 layers
    "full-ep4-8bit-none": depth_train("full-ep4-8bit-none", 4, *FULL, "--tier", "custom_grouped", "--expert_moments",
                                      "8bit", "--recompute", "none"),
    # full-ep4-8bit-none with each layer's experts placed on the four ranks by the load it recorded
    # (run full-ep4-8bit-none first, in the same call)
    "full-ep4-8bit-none-placed": depth_train("full-ep4-8bit-none-placed", 4, *FULL, "--tier", "custom_grouped",
                                             "--expert_moments", "8bit", "--recompute", "none", "--ep-placement",
                                             "{out}/full-ep4-8bit-none/results.json"),
    "full-ep4-20": depth_train("full-ep4-20", 4, *FULL, "--tier", "custom_grouped", "--recompute_layers", "20"),
    # fp8-full-ep4 with the experts' moments in 8 bits: recomputing the expert FFN in 12 layers,
    # the fewest that fit four H200s by the estimate (29 with bf16 moments)
    "full-ep4-fp8-8bit-12": depth_train("full-ep4-fp8-8bit-12", 4, *FULL, "--tier", "device_mxfp8",
                                        "--fp8.weight_cache", "false", "--expert_moments", "8bit",
                                        "--recompute_layers", "12"),
    # full-ep4-8bit-none with the dense weights and their state sharded over the four ranks by
    # FSDP2: 9 GiB a rank fewer by the estimate (130 of 140), for the busiest rank's rows
    "full-ep4-8bit-none-fsdp": depth_train("full-ep4-8bit-none-fsdp", 4, *FULL, "--tier", "custom_grouped",
                                           "--expert_moments", "8bit", "--recompute", "none", "--sharding", "fsdp"),
    # one rank's share of full-ep4-8bit (recomputing 11 layers) and of full-ep4-8bit-none on one
    # GPU: all 32 layers with 2 experts each (the 2 of 8 a rank holds at EP=4), one 8192-token
    # sequence, so 8192 rows an expert, the mean a rank gets at EP=4; no exchange and no busiest
    # rank. What a GPU at EP=4 would do with its work alone, and its memory without EP's buffers.
    **{f"rank-share-8bit-{recompute}": depth_train(
        f"rank-share-8bit-{recompute}", 1, *FULL[:1], "--model.num_experts", "2", "--batch_size", "1",
        *FULL[5:], "--tier", "custom_grouped", "--expert_moments", "8bit",
        *(("--recompute", "none") if recompute == "none" else ("--recompute_layers", recompute)))
       for recompute in ("11", "none")},
    # the same rank's share in FP8 (device_mxfp8, no weight cache), recomputing the 12 layers
    # full-ep4-fp8-8bit-12 needs at EP=4: what the FP8 target meets without EP
    "rank-share-fp8-8bit-12": depth_train("rank-share-fp8-8bit-12", 1, *FULL[:1], "--model.num_experts", "2",
                                          "--batch_size", "1", *FULL[5:], "--tier", "device_mxfp8",
                                          "--fp8.weight_cache", "false", "--expert_moments", "8bit",
                                          "--recompute_layers", "12"),
    # Megatron-Core beside ours (benchmarks/megatron_peer.py, then our run at the same layers, EP,
    # GPUs and rows, both with Mixtral's load-balancing loss at 0.02):
    # 4 layers on one GPU; ours: custom_grouped, no recompute
    "megatron-4l-ep1": beside_megatron("megatron-4l-ep1", 1, ("--config", "configs/mixtral-8x7b-8layer.yaml",
                                                              "--layers", "4", "--ep", "1"),
                                       "configs/mixtral-8x7b-8layer.yaml", "--model.num_hidden_layers", "4",
                                       "--tier", "custom_grouped"),
    # 8 layers, EP=2 on two GPUs; ours: custom_grouped, no recompute
    "megatron-8l-ep2": beside_megatron("megatron-8l-ep2", 2, ("--config", DEPTH, "--layers", "8", "--ep", "2"),
                                       DEPTH, "--model.num_hidden_layers", "8", "--ep-size", "2", "--recompute",
                                       "none", "--tier", "custom_grouped"),
    # ours of megatron-8l-ep2 again, each layer's experts placed by the load that run recorded
    # (run megatron-8l-ep2 first, in the same call): whether placing lifts our lead at EP=2
    "megatron-8l-ep2-ours-placed": depth_train("megatron-8l-ep2-ours-placed", 2, DEPTH, "--model.num_hidden_layers",
                                               "8", "--ep-size", "2", "--recompute", "none", "--tier",
                                               "custom_grouped", "--model.router_aux_loss_coef", "0.02",
                                               "--ep-placement", "{out}/megatron-8l-ep2-ours/results.json"),
    # the same with Megatron's MoE all-to-all overlap (--moe-overlap, each GPU's row cut into 2
    # micro-batches of 4096 tokens)
    "megatron-8l-ep2-overlap": beside_megatron(
        "megatron-8l-ep2-overlap", 2, ("--config", DEPTH, "--layers", "8", "--ep", "2", "--moe-overlap",
                                       "--micro-batches", "2"),
        DEPTH, "--model.num_hidden_layers", "8", "--ep-size", "2", "--recompute", "none", "--tier", "custom_grouped"),
    # the whole model, EP=4 on four GPUs; Megatron with its precision-aware optimizer (bf16
    # moments, 16-bit master remainders), bf16 gradients and full recompute of every layer, to
    # fit; ours: full-ep4-fewest
    "megatron-32l-ep4": beside_megatron(
        "megatron-32l-ep4", 4, ("--config", "configs/mixtral-8x7b.yaml", "--batch-size", "4", "--ep", "4",
                                "--recompute", "full", "--precision-aware-optimizer", "--grads", "bf16"),
        *FULL, "--tier", "custom_grouped", "--recompute_layers", "27"),
}

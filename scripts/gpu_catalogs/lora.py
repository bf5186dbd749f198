"""`lora`, docs/lora.md's runs: the adapter tests, then Mixtral-8x7B LoRA runs beside full
fine-tuning, the FP8 and NF4 bases, transformers + PEFT and axolotl's ScatterMoE-LoRA (and
Mixtral-8x22B over the NF4 base). Every run: custom_grouped (BF16 base) unless named, one
packed 8192-token sequence per GPU per step, 30 steps, the same seed, so that the runs' losses
compare the bases step by step (nf4-smoke's short run aside: 2 layers, 8 steps, each of its
runs under a time limit)."""

from dataclasses import replace

from gpu_catalogs.launch import Launch, pytest_gpu

LORA_FLAGS = ("--tier", "custom_grouped", "--steps", "30", "--timing_warmup_steps", "5", "--warmup_steps", "3", "--lr",
              "2e-5", "--seq_len", "8192", "--dtype", "bf16", "--plots", "false")
LORA_COMMON = ("--config", "configs/mixtral-8x7b.yaml", *LORA_FLAGS)
LORA = ("--lora.rank", "16")
# The LoRA peers' config: all 32 layers, one sequence per GPU, rank 16 and alpha 16 as ours.
LORA_PEER = ("--config", "configs/mixtral-8x7b-lora.yaml", "--alpha", "16")


def axolotl_peer(name: str, *extra: str) -> Launch:
    """benchmarks/axolotl_peer.py on one GPU at the LoRA peers' config, its JSON as OUT_DIR/NAME.json."""
    return Launch(name, 1, ("-m", "benchmarks.axolotl_peer", *LORA_PEER, *extra, "--json", f"{{out}}/{name}.json"))


def lora_train(name: str, nproc: int, *extra: str) -> list[Launch]:
    return [Launch(name, nproc, ("run_finetune_ep.py", *LORA_COMMON, "--batch_size", str(nproc), *extra,
                                 "--output-dir", f"{{out}}/{name}"))]


LORA_RUNS = {
    # the GPU tests of the adapters alone (LoRA, its memory estimate, its recompute)
    "lora-tests": pytest_gpu("lora-tests", "tests/gpu/test_lora_gpu.py", "tests/gpu/test_memory_lora_gpu.py",
                             "tests/gpu/test_recompute_gpu.py::test_lora_gradients_equal_no_recompute_bf16"),
    # the GPU tests of the device_mxfp8 tier
    "fp8-tests": pytest_gpu("fp8-tests", "tests/gpu/test_device_mxfp8_gpu.py"),
    # the GPU tests of the adapters and of the kernels they run in
    "tests": pytest_gpu("tests", "tests/gpu/test_lora_gpu.py", "tests/gpu/test_memory_lora_gpu.py",
                        "tests/gpu/test_custom_grouped_gpu.py", "tests/gpu/test_small_shared_gpu.py",
                        "tests/gpu/test_grouped_linear_gpu.py",
                        "tests/gpu/test_te_permute_gpu.py", "tests/gpu/test_device_mxfp8_gpu.py"),
    # 8 layers, every weight trained (bf16 parameters, master_adamw)
    "full-8layer": lora_train("full-8layer", 1, "--model.num_hidden_layers", "8", "--optimizer", "master_adamw"),
    # 8 layers, LoRA r=16 on every target
    "lora-8layer": lora_train("lora-8layer", 1, "--model.num_hidden_layers", "8", *LORA),
    # all 32 layers, LoRA r=16, selective recompute (one H200 holds it)
    "lora-32layer": lora_train("lora-32layer", 1, *LORA, "--recompute", "selective"),
    # the same recomputing the expert FFN in the first 13 layers only, the fewest that fit one
    # H200 (the run axolotl's and the NF4 base's are compared with)
    "lora-32layer-fewest": lora_train("lora-32layer-fewest", 1, *LORA, "--recompute", "selective",
                                      "--recompute_layers", "13"),
    # all 32 layers, LoRA r=16, EP=2 on two GPUs, no recompute (two H200s hold it)
    "lora-32layer-ep2": lora_train("lora-32layer-ep2", 2, *LORA, "--ep-size", "2"),
    # the same with full recompute (two H100s hold it)
    "lora-32layer-ep2-full": lora_train("lora-32layer-ep2-full", 2, *LORA, "--ep-size", "2", "--recompute", "full"),
    # all 32 layers, LoRA r=16, EP=4 on four GPUs, selective recompute (beside depth's full-ep4,
    # full fine-tuning at the same setting)
    "lora-32layer-ep4": lora_train("lora-32layer-ep4", 4, *LORA, "--ep-size", "4", "--recompute", "selective"),
    # 8 layers, LoRA r=16 over the FP8 base (beside lora-8layer)
    "lora-fp8-8layer": lora_train("lora-fp8-8layer", 1, "--model.num_hidden_layers", "8", *LORA, "--tier",
                                  "device_mxfp8"),
    # all 32 layers, LoRA r=16 over the FP8 base (device_mxfp8), selective recompute (one H100 holds it)
    "lora-fp8-32layer": lora_train("lora-fp8-32layer", 1, *LORA, "--tier", "device_mxfp8", "--recompute",
                                   "selective"),
    # the same without recompute (one H200 holds it)
    "lora-fp8-32layer-norecompute": lora_train("lora-fp8-32layer-norecompute", 1, *LORA, "--tier", "device_mxfp8",
                                               "--recompute", "none"),
    # the FP8 base against the BF16 base on one batch (benchmarks/lora_fp8_base.py); one layer:
    # the op's own error; four: with the routing it changes downstream
    "fp8-accuracy": [Launch(f"fp8-accuracy-{layers}", 1, ("-m", "benchmarks.lora_fp8_base", "--layers", str(layers)))
                     for layers in (1, 4)],
    # CUDA kernel time per step by kind (benchmarks/kernel_profile.py), 8 layers, LoRA r=16:
    # device_mxfp8 (the FP8 base) then custom_grouped (the BF16 base)
    "profile-8layer": [Launch(f"profile-8layer-{tier}", 1, ("-m", "benchmarks.kernel_profile", "ours", "--config",
                                                           "configs/mixtral-8x7b-lora.yaml", "--tier", tier,
                                                           "--model.num_hidden_layers", "8", "--recompute", "none",
                                                           "--lora.alpha", "16"), tail=0, show=40)
                       for tier in ("device_mxfp8", "custom_grouped")],
    # the same over the NF4 base (custom_grouped, --lora.base nf4), its JSON beside for kernel_compare
    "profile-8layer-nf4": [Launch("profile-8layer-nf4", 1, ("-m", "benchmarks.kernel_profile", "ours", "--config",
                                                          "configs/mixtral-8x7b-lora.yaml", "--tier", "custom_grouped",
                                                          "--model.num_hidden_layers", "8", "--recompute", "none",
                                                          "--lora.alpha", "16", "--lora.base", "nf4", "--json",
                                                          "{out}/profile-8layer-nf4.json"), tail=0, show=40)],
    # the GPU tests of the NF4 base (tests/gpu/test_nf4_gpu.py; its bitsandbytes test needs
    # bitsandbytes installed, e.g. pip install --no-deps .whl/bitsandbytes-*.whl, else it skips)
    "nf4-tests": pytest_gpu("nf4-tests", "-rs", "tests/gpu/test_nf4_gpu.py"),
    # the NF4 base against the BF16 base on one batch, 1 and 4 layers, beside bitsandbytes' NF4 on
    # the same weights (benchmarks/nf4_accuracy.py; without bitsandbytes, ours alone)
    "nf4-accuracy": [Launch("nf4-accuracy", 1, ("-m", "benchmarks.nf4_accuracy", "--layers", "1", "4"))],
    # all 32 layers, LoRA r=16 over the NF4 base (--lora.base nf4), selective recompute
    "lora-nf4-32layer": lora_train("lora-nf4-32layer", 1, *LORA, "--lora.base", "nf4", "--recompute", "selective"),
    # the same with full recompute (the estimate's fit for a 48 GB card)
    "lora-nf4-32layer-full": lora_train("lora-nf4-32layer-full", 1, *LORA, "--lora.base", "nf4", "--recompute",
                                        "full"),
    # the least recompute the estimate fits in 40 GiB (a 48 GB card): full recompute in the first
    # 28 layers (39.75 GiB estimated), then 29 (38.28): the estimate's peak is the head's
    # backward, and the last layers' backward, which it does not count, holds a transient BF16
    # copy of gate_up beside every layer's activations (the NF4 base above 128 rows per expert)
    "lora-nf4-32layer-fit": [launch for layers in ("28", "29") for launch in lora_train(
        f"lora-nf4-32layer-full{layers}", 1, *LORA, "--lora.base", "nf4", "--recompute", "full",
        "--recompute_layers", layers)],
    # the whole Mixtral-8x22B (56 layers), LoRA r=16 over the NF4 base, full recompute (one H200
    # holds it by the estimate, 102 GiB)
    "lora-nf4-8x22b": [Launch("lora-nf4-8x22b", 1, ("run_finetune_ep.py", "--config", "configs/mixtral-8x22b.yaml",
                                                    *LORA_FLAGS, "--batch_size", "1", *LORA, "--lora.base", "nf4",
                                                    "--recompute", "full", "--output-dir", "{out}/lora-nf4-8x22b"))],
    # transformers + PEFT on all 32 layers, the same tokens, gradient checkpointing
    # (benchmarks/peft_peer.py; one H200 holds it)
    "peft-32layer": [Launch("peft-32layer", 1, ("-m", "benchmarks.peft_peer", *LORA_PEER, "--json",
                                                "{out}/peft-32layer.json"))],
    # the same on two GPUs under torchrun, DistributedDataParallel (two H200s)
    "peft-32layer-ddp": [Launch("peft-32layer-ddp", 2, ("-m", "benchmarks.peft_peer", *LORA_PEER, "--json",
                                                        "{out}/peft-32layer-ddp.json"))],
    # axolotl 0.21's ScatterMoE-LoRA (benchmarks/axolotl_peer.py; needs .peers/axolotl, made by
    # scripts/fetch_axolotl.sh, and bitsandbytes for the NF4 base), to run first: its GPU tests, then
    # 2 layers over each base, 10 steps
    "axolotl-smoke": [*pytest_gpu("axolotl-tests", "-rs", "tests/gpu/test_axolotl_peer_gpu.py"),
                      *(axolotl_peer(f"axolotl-2layer-{base}", "--base", base, "--layers", "2", "--steps", "10",
                                     "--warmup", "3") for base in ("bf16", "nf4"))],
    # all 32 layers, the tokens of peft-32layer, bf16 base, gradient checkpointing (one H200 holds it)
    "axolotl-32layer": [axolotl_peer("axolotl-32layer")],
    # the same over bitsandbytes' NF4 (axolotl's QLoRA: load_in_4bit with quantize_moe_experts)
    "axolotl-qlora-32layer": [axolotl_peer("axolotl-qlora-32layer", "--base", "nf4")],
}

# nf4-tests, nf4-accuracy and lora-nf4-32layer in one go
LORA_RUNS["nf4"] = [*LORA_RUNS["nf4-tests"], *LORA_RUNS["nf4-accuracy"], *LORA_RUNS["lora-nf4-32layer"]]
# the NF4 base's kernels on a GPU in four minutes: its GPU tests, its accuracy, and 8 steps of
# 2 layers, LoRA r=16 over it, each stopped if it runs long
LORA_RUNS["nf4-smoke"] = [replace(run, timeout_s=seconds) for run, seconds in zip(
    [*LORA_RUNS["nf4-tests"], *LORA_RUNS["nf4-accuracy"],
     *lora_train("lora-nf4-2layer", 1, *LORA, "--lora.base", "nf4", "--recompute", "selective",
                 "--model.num_hidden_layers", "2", "--steps", "8", "--timing_warmup_steps", "3")], (80, 70, 70))]

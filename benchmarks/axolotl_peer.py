"""axolotl's ScatterMoE-LoRA on Mixtral, trained at our workload: the peer our LoRA runs are measured against.

axolotl (github.com/axolotl-ai-cloud/axolotl) is a fine-tuning tool many people train Mixtral
with. Since transformers 5 dispatches every MoE's expert GEMMs through one registry (its
`ExpertsInterface`, chosen by `experts_implementation`), axolotl's kernels plugin adds its own
entry there: ScatterMoE, Triton kernels that gather each expert's tokens inside the GEMM and
fuse the LoRA adapters into it. This script runs what an axolotl 0.21.0 user gets from

    plugins: [axolotl.integrations.kernels.KernelsPlugin]
    use_kernels: true
    use_scattermoe: true
    adapter: lora                     # --base nf4: qlora, with load_in_4bit and quantize_moe_experts
    lora_target_modules: [q_proj, k_proj, v_proj, o_proj]
    lora_target_parameters: [mlp.experts.gate_up_proj, mlp.experts.down_proj]
    gradient_checkpointing: true

on one GPU, beside our `--lora.rank` run of the same config, on the same tokens. Its parts:

- model: transformers' `MixtralForCausalLM` from our config's model section, bf16, random
  weights, built on the GPU, attention `flash_attention_2` where flash-attn imports, else `sdpa`,
  and gradient checkpointing on (`use_reentrant=False`, what axolotl's Trainer arguments set
  when a recipe says `gradient_checkpointing: true`, as its Mixtral recipes do): all as
  benchmarks/peft_peer.py builds it (`build_mixtral`).
- the kernels, as `KernelsPlugin.pre_model_load` installs them with `use_scattermoe`
  (axolotl/integrations/kernels/libs/scattermoe_lora/experts.py, `register_scattermoe_experts`):
  `scattermoe_experts_forward` registered in transformers' `ALL_EXPERTS_FUNCTIONS`, transformers'
  check of the implementation's name taught to accept it, PEFT's `ParamWrapper.forward`
  replaced (experts_lora_fastpath.py) so that the experts' adapters reach the kernels as
  (A, B, scale) rather than PEFT adding `scale * B @ A` to the whole stacked weight, and its
  runtime settings from the run's config (`configure_scattermoe_runtime`: gradient
  checkpointing on). The model's `experts_implementation` is then "scattermoe". Routing stays
  transformers' (`MixtralSparseMoeBlock`: softmax, top 2, renormalised); only the experts
  change. For Mixtral's few large experts (E <= 32 and in x out >= 20 M) its LoRA forward is
  "split" (kernels/lora_ops.py): the base grouped GEMM, X A and (X A) B as three scatter2scatter
  calls, where smaller experts get one fused kernel; its backward computes dX and the adapters'
  dA and dB in its own kernels, and no gradient of the frozen weights.
- adapters: PEFT's LoRA from our `lora` section, as peft_peer.py adds them
  (`add_peft_adapters`: the same targets, rank and alpha, fp32 adapters, dropout 0); the
  kernels take the expert adapters cast to the activations' dtype.
- `--base nf4` (axolotl's QLoRA): the frozen base in bitsandbytes' 4-bit NF4, as axolotl's
  `load_in_4bit` + `quantize_moe_experts` loads it: attention's four projections as bitsandbytes
  `Linear4bit` (its `BitsAndBytesConfig`: NF4, blocks of 64, double quantisation, bf16 compute
  and storage; `lm_head` stays bf16, and so does the router, a parameter rather than a Linear),
  every expert stack parametrised by bitsandbytes' `replace_parameter_4bit` (NF4, double
  quantisation), PEFT patched by axolotl's `patch_peft_target_parameters_matching` to wrap
  parametrised experts. In training the experts take ScatterMoE's bitsandbytes path
  (`moe_bnb_fast`, its default): the routed experts dequantised to bf16 by its Triton NF4
  kernel at each forward and again in the backward, then the same LoRA kernels. axolotl
  quantises tensor by tensor as a checkpoint loads; with random weights there is no checkpoint,
  so the bf16 model is built on the GPU and quantised module by module after (the 8x7B needs
  93 GB for a moment). axolotl applies the PEFT patch whenever `lora_target_parameters` is
  set; on a bf16 base it wraps the same parameters in the same order as PEFT alone (checked on
  a CPU), so this peer applies it with the 4-bit base only, the one that needs bitsandbytes.
- input, step and figures: as peft_peer.py (one packed row per step with position_ids
  restarting at each document: by default our own run's rows, with `--doc-len` random
  documents; under `torch.autocast(bf16)`; transformers' causal-LM loss without the router's
  load-balancing term; backward; `torch.optim.AdamW(fused=True)` at our lr; timed as our runs
  time a step, `--warmup` steps left out). Peak memory is counted from the first step: the
  build is not training (and axolotl's loader never holds what the 4-bit build holds).

What it does that we do not: gathers and scatters tokens inside its GEMMs (no permuted copy of
the tokens); quantises attention's projections to NF4 as well as the experts (`--lora.base
nf4` keeps attention bf16). What it leaves out of axolotl:
its Trainer and data pipeline (multipack sampling: here one packed row, as for every peer);
its LoRA kernels for attention (`lora_qkv_kernel`, `lora_o_kernel`: auto-enabled by axolotl
0.21 for LoRA configs that set neither them nor `trust_remote_code`; its Mixtral recipes set
`trust_remote_code` and so run without), Liger, cut cross-entropy and 8-bit optimizers, which
a recipe turns on by choice; the router's load-balancing loss (its Mixtral recipes set
`output_router_logits: true`; off here as in peft_peer.py). What we do that it does not:
expert parallelism, an FP8 base, recompute chosen per layer by a memory estimate, Mixtral's
load-balancing and z losses in the same step.

Where axolotl comes from. Installed whole, axolotl 0.21.0 pins torch >= 2.13, transformers
5.20.1 and dozens of packages the GPU image lacks; this peer imports only its kernel modules,
from an unpacked copy of the wheel's files that they need (`--axolotl-dir`, default
.peers/axolotl, which git ignores; `scripts/fetch_axolotl.sh` makes it). The copy leaves out the
`__init__.py` of axolotl's kernels plugin (`integrations/kernels/`), which loads its plugin and
config classes (pydantic, addict, ...), and that of `libs/`: those folders then import as
namespace packages and only the modules named above load. bitsandbytes too for `--base nf4`. On a CPU the
kernels cannot run, not even in Triton's interpreter (its loop over experts calls `.to` on the
loop index, a Python int there): tests/gpu/test_axolotl_peer_gpu.py checks them against
transformers' own experts on a GPU.

From the repository root, on a CUDA machine with transformers, peft and the axolotl copy:

    python3 -m benchmarks.axolotl_peer [--config configs/mixtral-8x7b-8layer.yaml] [--layers N] \\
        [--base bf16|nf4] [--rank R] [--alpha A] [--steps 30] [--warmup 5] [--doc-len L] \\
        [--axolotl-dir .peers/axolotl] [--json out.json]
"""

import argparse
import importlib
import importlib.util
import sys
from pathlib import Path

from benchmarks import common
from benchmarks.peer_workload import add_model_peer_flags, add_run_flags, peer_main, rank_rows, timed_steps
from benchmarks.peft_peer import (
    add_lora_flags,
    add_peft_adapters,
    attention_implementation,
    build_mixtral,
    cuda_device,
    packed_row,
    train_step,
    workload_config,
)
from benchmarks.peft_peer import check_args as check_lora_args
from te_mixtral.errors import UserError

KERNELS = "axolotl.integrations.kernels.libs.scattermoe_lora"  # axolotl's ScatterMoE-LoRA package
BASES = ("bf16", "nf4")


def kernels_file(axolotl_dir: Path) -> Path:
    """Where the copy in `axolotl_dir` keeps the ScatterMoE experts forward."""
    return axolotl_dir / Path(*KERNELS.split(".")) / "experts.py"


def import_scattermoe(axolotl_dir: Path):
    """axolotl's ScatterMoE experts module, imported from the copy in `axolotl_dir`. Its modules
    import one another by absolute name (`axolotl.utils.logging`, ...), so the folder goes on
    sys.path, ahead of any installed axolotl."""
    folder = str(axolotl_dir.resolve())
    if folder not in sys.path:
        sys.path.insert(0, folder)
    return importlib.import_module(f"{KERNELS}.experts")


def install_scattermoe(axolotl_dir: Path, gradient_checkpointing: bool) -> None:
    """What axolotl's `KernelsPlugin.pre_model_load` does with `use_scattermoe` (module docstring)."""
    experts = import_scattermoe(axolotl_dir)
    runtime = importlib.import_module(f"{KERNELS}.runtime")
    experts.register_scattermoe_experts()
    runtime.configure_scattermoe_runtime({"gradient_checkpointing": gradient_checkpointing})


def linear_nf4(linear):
    """A bf16 `nn.Linear` as the bitsandbytes `Linear4bit` axolotl's `BitsAndBytesConfig` loads
    it into (NF4, double quantisation, bf16 compute and storage), quantised where it lies."""
    import bitsandbytes as bnb
    import torch

    settings = {"compress_statistics": True, "quant_type": "nf4", "quant_storage": torch.bfloat16}
    nf4 = bnb.nn.Linear4bit(linear.in_features, linear.out_features, bias=linear.bias is not None,
                            compute_dtype=torch.bfloat16, device="meta", **settings)
    # Params4bit quantises on its first move to a device, as transformers' loader has it do.
    nf4.weight = bnb.nn.Params4bit(linear.weight.data, requires_grad=False, module=nf4,
                                   **settings).to(linear.weight.device)
    nf4.bias = linear.bias
    return nf4


def quantize_nf4(model) -> None:
    """The frozen base in bitsandbytes' NF4 as axolotl's QLoRA loads it (module docstring): every
    Linear but `lm_head` as `Linear4bit`, every expert stack parametrised, one module at a time."""
    import torch
    from axolotl.monkeypatch.moe_quant import record_quantized_expert
    from bitsandbytes.nn.parametrize import replace_parameter_4bit
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    for path, module in list(model.named_modules()):
        if isinstance(module, MixtralExperts):
            # axolotl's loader records each stack's parameters in definition order before the
            # parametrisation reorders them: its PEFT patch wraps them in that order.
            record_quantized_expert(path, module)
            for name in ("gate_up_proj", "down_proj"):
                replace_parameter_4bit(module, name, compress_statistics=True, quant_type="nf4")
        for name, child in list(module.named_children()):
            if type(child) is torch.nn.Linear and f"{path}.{name}".lstrip(".") != "lm_head":
                setattr(module, name, linear_nf4(child))
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the bf16 copies each quantised module leaves behind


def build_axolotl_model(cfg, device, base: str, axolotl_dir: Path, attention: str = "sdpa",
                        gradient_checkpointing: bool = True, dtype=None):
    """transformers' Mixtral with axolotl's ScatterMoE-LoRA experts and PEFT's adapters for
    `cfg.lora`, over a `base` ("bf16" or "nf4") frozen base (module docstring). `dtype`: the
    model's (default bf16; the CPU tests build fp32 models)."""
    import torch

    install_scattermoe(axolotl_dir, gradient_checkpointing)
    model = build_mixtral(cfg, device, dtype or torch.bfloat16, attention, gradient_checkpointing)
    model.set_experts_implementation("scattermoe")  # what axolotl's loader passes to from_pretrained
    if base == "nf4":
        from axolotl.monkeypatch.moe_quant import patch_peft_target_parameters_matching

        quantize_nf4(model)
        patch_peft_target_parameters_matching()
    return add_peft_adapters(model, cfg)


def run(args, cfg) -> dict:
    """Build, train `args.steps` steps on one GPU and measure; the results as --json writes them."""
    import torch

    from te_mixtral.measure.metrics import train_flops
    from te_mixtral.measure.report import package_version

    device = cuda_device("the axolotl peer (Triton kernels)")
    import_scattermoe(args.axolotl_dir)  # its version, from the copy's dist-info, is then readable
    header = common.run_header(device, axolotl=package_version("axolotl"))
    print(common.header_line(header), flush=True)
    torch.manual_seed(cfg.train.seed)

    # --- the model and optimizer, as an axolotl user's run builds them
    attention = attention_implementation()
    model = build_axolotl_model(cfg, device, args.base, args.axolotl_dir, attention, args.gradient_checkpointing)
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=cfg.train.lr, fused=True)
    torch.cuda.reset_peak_memory_stats(device)  # the build is not the training step

    rows = rank_rows(cfg, args, device)
    tokens = cfg.train.batch_size * cfg.data.seq_len
    flops = [train_flops(cfg.model, r["cu_seq_lens_q"].cpu(), tokens, cfg.lora) for r in rows]
    quantised = (None if args.base == "bf16" else
                 "bitsandbytes NF4, double quantisation: attention's projections (Linear4bit) and the experts")
    return timed_steps(
        lambda batch: train_step(model, optimizer, batch, torch.bfloat16), [packed_row(r) for r in rows], args, cfg,
        header, flops, device, 1,
        {"lora": {"rank": cfg.lora.rank, "alpha": cfg.lora.alpha, "targets": cfg.lora.target_list()},
         "trainable_parameters": sum(p.numel() for p in trainable), "attention": attention,
         "experts": model.base_model.model.config._experts_implementation, "base": args.base,
         "quantised": quantised,
         "gradient_checkpointing": args.gradient_checkpointing,
         "optimizer": "torch.optim.AdamW(fused=True), PEFT's fp32 adapters, frozen base, autocast bf16"})


def check_args(args) -> None:
    check_lora_args(args)
    if not kernels_file(args.axolotl_dir).is_file():
        raise UserError(f"--axolotl-dir {args.axolotl_dir} holds no copy of axolotl's ScatterMoE kernels: "
                        f"make one with scripts/fetch_axolotl.sh")
    if args.base == "nf4" and importlib.util.find_spec("bitsandbytes") is None:
        raise UserError("--base nf4 needs bitsandbytes, which does not import here")


def describe(w: dict) -> str:
    return (f"axolotl ScatterMoE-LoRA r{w['lora']['rank']} ({w['num_hidden_layers']} layers, "
            f"{w['tokens_per_step_per_gpu']} tokens/step, {w['base']} base, {w['attention']})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_peer_flags(parser)
    parser.add_argument("--base", choices=BASES, default="bf16",
                        help="the frozen base: bf16, or nf4 (bitsandbytes, axolotl's QLoRA) (default: bf16)")
    add_lora_flags(parser, "axolotl's Mixtral recipes")
    parser.add_argument("--axolotl-dir", type=Path, default=Path(".peers/axolotl"),
                        help="the copy of axolotl's files to import (default: .peers/axolotl; "
                             "scripts/fetch_axolotl.sh makes it)")
    add_run_flags(parser)
    return peer_main("axolotl_peer", parser.parse_args(argv), check_args, run, describe, workload_config)


if __name__ == "__main__":
    sys.exit(main())

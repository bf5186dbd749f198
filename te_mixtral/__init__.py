"""te_mixtral: fine-tune Mixtral-style MoE models with expert parallelism, tier by tier.

A run is `run_finetune_ep.py --config run.yaml` (docs/tutorial.md): the command line and
config are checked, the model is built with the expert tier the config names, and the
training loop runs over packed batches, writing results, checkpoints and exports.

The package, one sub-package per part (each `__init__.py` maps its own files; the
architecture and its import layers are drawn in docs/architecture.md):

    model/          the Mixtral decoder whose numerics equal transformers', its MoE block,
                    router losses, LoRA, and the transformers config and model glue
    experts/        the expert FFN tiers behind one interface, chosen from a registry by
                    name, with their Triton kernels (kernels/) and 8-bit recipes (quant/)
    distributed/    process groups for expert parallelism, token dispatch, FSDP2 sharding,
                    overlapped gradient sums, global tensors for resharding checkpoints
    data/           where records come from, the tokenizer, chat rendering, packing
    training/       the training loop, optimizer and schedule, checkpoints, Hugging Face
                    and PEFT exports, evaluation, generation, the run's output folders
    optim/          AdamW over bf16 parameters with an exact fp32 master
    planning/       before a run starts: the memory estimate and the fit check
    measure/        what a step costs: metrics, phase profiles, expert load, the run log,
                    reports, plots
    results/        offline, off the training path: results pages comparing finished runs

    cli.py                the command line of run_finetune_ep.py
    config.py             the typed run configuration, loaded from YAML, validated once
    config_checks.py      its checks, each a message a user can act on
    config_field.py       setting(): a config field with its help, its role and what it needs
    lora_config.py        LoRA's settings, the projections it adapts and its checks; PEFT's
                          adapter config out, and in (lora.init)
    saved_config.py       configs as files hold them, older layouts upgraded, a run's own known as such
    config_yaml.py        YAML as configs are read: a key given twice, runaway aliases, refused
    local_or_hub.py       where model_path and data.dataset point: a local path or a hub id;
                          whether the hub can be reached
    errors.py             errors a user can act on, and how they are reported
    files.py              files written whole or not at all; folders checked up front
    folder_lock.py        one run at a time in a folder
    te_support.py         finding Transformer Engine, and saying why it cannot be used
    accelerate_launch.py  what `accelerate launch` asks of a run
    torchrun.py           `python -m te_mixtral.torchrun`: torchrun with the ranks' exit code

Shape legend
------------
Tensors are named by what they hold, then a suffix of capital letters, one per dim: `x_TD`
is [T, D]. Every file that uses suffixes says "Shape suffixes: see te_mixtral/__init__.py"
rather than restating them, and names there any letter of its own.

    B samples in a batch           S sequence positions       T tokens on this rank (B*S)
    D model (hidden) dim           H attention heads          V vocabulary
    E experts in the model         L experts on this rank     K top-k (experts per token)
    R rows routed to this rank     F expert hidden dim        P ranks in the EP group
    Y MoE (decoder) layers         A tokens of the whole global batch (all ranks' T)

GEMM-level letters, for code that runs one GEMM without knowing what it multiplies
(experts/kernels/, experts/quant/, the row padding of experts/device_mxfp8.py, the
`_GroupedMatmul` of experts/grouped_linear.py):

    M, N output dims of a GEMM     I its input (reduced) dim  G groups (one per local expert)
    C a generic column dim         Q rows after per-expert padding

A digit in a suffix is a literal size (`gate_up_L2FD` is [L, 2*F, D]); a lowercase `r` is
a LoRA adapter's rank (`a_LrD`). A leading `d` on a name is a gradient with the shape of
what it differentiates: `dy_RD` is d(loss)/d(y_RD), `d_gate_up` that of `gate_up`.
"""

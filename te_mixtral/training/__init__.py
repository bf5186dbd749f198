"""Training a run: the loop, and what it reads, writes and hands on.

    loop.py            the training loop, one plain function read top to bottom: setup, steps, report
    run_report.py      the run's report at its end: loss check, results.json, tables, plots
    optimizer.py       the optimizer a run steps, and its learning-rate schedule
    exchange_capacity.py  the padded exchange's capacity over a run (--ep_capacity): a step
                       that outgrew it runs again; a checkpoint keeps it, a resume goes on at it
    expert_placement.py  which placement the experts take (--ep-placement): a resume its
                       checkpoint's, at any EP size
    checkpoint.py      training checkpoints: stop a run and continue it exactly
    restart.py         torchrun's restarts (--max-restarts): continue the launch's own checkpoint
    resume_checks.py   whether this run can resume a checkpoint: its meta.json against the config
    dcp_index.py       reading torch.distributed.checkpoint's index without running code
    hf_checkpoint.py   Hugging Face Mixtral checkpoints in and out of our parameter layout
    peft_adapters.py   LoRA adapters in PEFT's format, out and in (lora.init)
    evaluate.py        loss and perplexity on held-out samples
    generate.py        greedy generation from the fine-tuned model
    outputs.py         the folders a run writes, checked before it trains
    same_job.py        every rank about to run the same job: config, hub revision, tokenizer, data
"""

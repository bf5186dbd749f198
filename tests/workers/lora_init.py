"""torchrun worker: a LoRA run exports its adapters, then a run starts from them (lora.init).

Usage: torchrun ... tests/workers/lora_init.py OUT CONFIG [run_finetune_ep.py arguments]

Rank 0 first writes OUT/base, tests/hf_reference.py's random Mixtral of CONFIG (transformers'
config fields, JSON) from seed 0, which the other ranks wait for. The exporting run trains over
it with the arguments and `--lora.*` settings of its own (EXPORTING), exporting its adapters to
OUT/adapter; then each rank computes, as the loop does, the loss its last weights give the
batch a run's first step reads: the exporting run's last state, for the step the next run takes
first. The next run is the same arguments over the same base, one step, with `--lora.init
OUT/adapter` and no lora setting or tokenizer of its own: it takes the adapter's. Each rank writes
OUT/rank{r}.pt: {"last": the exporting run's adapters at its end, "started": the next run's as
built, "last_loss": that loss, "first_loss": the next run's first step's}, each rank's own.
"""

import json
import sys
from pathlib import Path
from unittest import mock

import torch
import torch.distributed as dist

from te_mixtral.cli import parse_args
from te_mixtral.config import load_config
from te_mixtral.data.packing import PackedData
from te_mixtral.distributed import layout as layout_module
from te_mixtral.distributed.launcher_env import world_size_from_env
from te_mixtral.distributed.layout import all_reduce_sum
from te_mixtral.model.lora import is_adapter_param
from te_mixtral.training import loop

# The exporting run's adapters, every setting away from its default, and the BPE it trains (the
# base has no tokenizer): the next run must take them all, the tokenizer from beside the adapters.
EXPORTING = ["--lora.rank", "2", "--lora.alpha", "5", "--lora.rslora", "--lora.targets",
             "q_proj,o_proj,gate_up_proj,down_proj", "--tokenizer_vocab_size", "300", "--steps", "2"]


def adapters(model) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters() if is_adapter_param(name)}


def first_step_loss(model, cfg, layout) -> float:
    """The loss the loop reports for step 1 (one micro-batch), from `model` as it is."""
    t = cfg.train
    [micro] = PackedData(cfg.data, t.batch_size, layout.rank, layout.world_size, t.seed, 1).micro_batches(0)
    targets = all_reduce_sum((micro.labels != -100).sum().double()[None], layout)[0]
    with torch.no_grad():
        loss = model.lm_loss(model(micro.input_ids, micro.packed), micro.labels, targets)
    return all_reduce_sum(loss.double()[None], layout).item()


def run(argv: list[str]):
    args, overrides = parse_args([*argv, "--plots", "false"])
    return loop.train(load_config(args.config, overrides, world_size=world_size_from_env()))


out, config, argv = Path(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3:]
common = [*argv, "--model", str(out / "base")]
cfg = load_config(None, parse_args(common)[1], world_size=world_size_from_env())
# One layout for both runs, on the process group started here (or by the launch this runs in).
layout = layout_module.init_layout(cfg.ep_size, "cpu", cfg.dist_timeout_s)
if layout.is_main:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, which holds hf_reference
    from hf_reference import random_hf_mixtral

    torch.manual_seed(0)
    random_hf_mixtral(**config).save_pretrained(out / "base")
if dist.is_initialized():
    dist.barrier()  # no rank reads the base before it is written
built = []  # each run's adapters as built


def recording_build_model(*args, **kwargs):
    model, ran_on = build_model(*args, **kwargs)
    built.append(adapters(model))
    return model, ran_on


build_model = loop.build_model
with (mock.patch.object(loop, "init_layout", lambda *args: layout),
      mock.patch.object(loop, "build_model", recording_build_model)):
    exporting = run([*common, *EXPORTING, "--save-adapter", str(out / "adapter"), "--output-dir", str(out / "a")])
    next_args = [*common, "--lora.init", str(out / "adapter"), "--steps", "1", "--output-dir", str(out / "b")]
    next_run = run(next_args)
# The batch the next run reads first, through the tokenizer it took.
next_cfg = load_config(None, parse_args(next_args)[1], world_size=world_size_from_env())
torch.save({"last": adapters(exporting.model), "started": built[-1], "first_loss": next_run.losses[0],
            "last_loss": first_step_loss(exporting.model, next_cfg, layout)}, out / f"rank{layout.rank}.pt")
layout_module.shutdown(wait_for_peers=True)

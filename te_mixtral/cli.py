"""The command line of `run_finetune_ep.py`: `--config`, then `--key value` overrides of any
config key, validated before anything heavy is imported."""


import argparse
from pathlib import Path

from te_mixtral.config import is_switch, load_config
from te_mixtral.distributed.layout import shutdown, world_size_from_env
from te_mixtral.errors import UserError, report_error

DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml"


USAGE = r"""Fine-tune a Mixtral-style MoE model with expert parallelism.

    python run_finetune_ep.py                      # tiny model, embedded data, CPU or GPU
    torchrun --nproc_per_node=2 run_finetune_ep.py --config configs/tiny.yaml --tier loop --ep-size 2
    python run_finetune_ep.py --config configs/mixtral-8x7b-2layer.yaml --tier grouped_linear --steps 20

Any config key can be overridden: `--lr 1e-4`, `--train.steps 10`, `--model.num_hidden_layers 4`.

Fine-tune a Hugging Face checkpoint, evaluate, export, and survive a crash (docs/checkpoints.md):

    torchrun --nproc_per_node=2 run_finetune_ep.py --ep-size 2 --model PATH_OR_HUB_ID \
        --eval-fraction 0.05 --eval-every 10 --checkpoint-dir ckpt --checkpoint-every 10 \
        --save-hf finetuned --generate "The meaning of"
    ... the same command with --resume continues from the latest checkpoint in ckpt.

--model's config.json replaces the config's `model` section; its tokenizer.json is used
when data.tokenizer is unset.
"""


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, dict[str, str]]:
    parser = argparse.ArgumentParser(description=USAGE, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(DEFAULT_CONFIG), help="YAML config (default: configs/tiny.yaml)")
    parser.add_argument("--estimate-memory", nargs="?", type=int, const=0, metavar="WORLD_SIZE",
                        help="print the per-rank memory estimate (for WORLD_SIZE ranks; default: this launch's) "
                             "and exit without building anything")
    args, rest = parser.parse_known_args(argv)
    overrides = {}
    while rest:
        flag = rest.pop(0)
        if not flag.startswith("--") or len(flag) == 2:
            raise UserError(f"expected --key value, got '{flag}'")
        key, eq, value = flag[2:].partition("=")
        if not eq:
            if (not rest or rest[0].startswith("--")) and is_switch(key):
                value = "true"  # `--resume` alone switches it on
            elif not rest or rest[0].startswith("--"):
                raise UserError(f"--{key} needs a value")
            else:
                value = rest.pop(0)
        # `--model` names a checkpoint; `model` alone is the config section.
        overrides["model_path" if key == "model" else key] = value
    return args, overrides


def main(argv: list[str]) -> int:
    try:
        args, overrides = parse_args(argv)
        world_size = args.estimate_memory or world_size_from_env()
        cfg = load_config(args.config, overrides, world_size=world_size)
        if args.estimate_memory is not None:
            from te_mixtral.measure.memory import print_estimate

            return print_estimate(cfg, world_size)
    except UserError as e:
        return report_error(e)
    from te_mixtral.training.loop import (
        main as train_main,  # after validation: a bad flag fails fast
    )

    try:
        return train_main(cfg)
    finally:
        shutdown()


"""The command line of `run_finetune_ep.py`: `--config`, then `--key value` overrides of any
config key, validated before anything heavy is imported. `--help` lists every key with the
value it has in this run (the config file's, or the override's), its default and its
meaning, read from the config's own fields. Under `accelerate launch`, accelerate's settings
are read first (te_mixtral/accelerate_launch.py)."""


import argparse
import os
import shutil
import signal
import textwrap

from te_mixtral.accelerate_launch import describe, launch_settings
from te_mixtral.config import (
    FOLLOWS,
    SECTIONS,
    SHIPPED_CONFIGS,
    RunConfig,
    is_switch,
    load_run_config,
    settings,
    to_dict,
)
from te_mixtral.distributed.launcher_env import main_rank_from_env, world_size_from_env
from te_mixtral.errors import ExitCode, UserError, end_at_once, print_error, report_error
from te_mixtral.saved_config import flatten

DEFAULT_CONFIG = SHIPPED_CONFIGS / "tiny.yaml"


USAGE = r"""Fine-tune a Mixtral-style MoE model with expert parallelism.

    python run_finetune_ep.py                      # tiny model, embedded data, CPU or GPU
    torchrun --nproc_per_node=2 run_finetune_ep.py --config configs/tiny.yaml --tier loop --ep-size 2
    accelerate launch --multi_gpu --num_processes 2 run_finetune_ep.py --ep-size 2   # the same; README
    python run_finetune_ep.py --config configs/mixtral-8x7b-2layer.yaml --tier grouped_linear --steps 20
    python run_finetune_ep.py --lora.rank 8 --save-adapter my-adapter   # LoRA, exported in PEFT's format

Any config key can be overridden: `--lr 1e-4`, `--train.steps 10`, `--model.num_hidden_layers 4`
(min_lr and timing_warmup_steps, left unset, follow lr and steps).

Fine-tune a Hugging Face checkpoint, evaluate, export, and survive a crash (docs/checkpoints.md):

    torchrun --nproc_per_node=2 run_finetune_ep.py --ep-size 2 --model PATH_OR_HUB_ID \
        --eval-fraction 0.05 --eval-every 10 --checkpoint-dir ckpt --checkpoint-every 10 \
        --save-hf finetuned --generate "The meaning of"
    ... the same command with --resume continues from the latest checkpoint in ckpt.

--model's config.json replaces the config's `model` section (a --model.* key given with it is
refused: the checkpoint loads whole); its tokenizer.json is used when data.tokenizer is unset.
"""


def _parser() -> argparse.ArgumentParser:
    # Our own --help: argparse's would exit before the config it describes is loaded.
    parser = argparse.ArgumentParser(description=USAGE, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     add_help=False)
    parser.add_argument("-h", "--help", action="store_true",
                        help="show this help, with every config key's value, default and meaning, and exit")
    parser.add_argument("--config", default=str(DEFAULT_CONFIG), help="YAML config (default: configs/tiny.yaml)")
    # Bare, it takes this launch's world size (const 0, which no count given can be: `_ranks`).
    parser.add_argument("--estimate-memory", nargs="?", type=_ranks, const=0, metavar="WORLD_SIZE",
                        help="print the per-rank memory estimate (for WORLD_SIZE ranks, 1 to 2**31 - 1, as many as "
                             "torch.distributed numbers; default: this launch's) and exit without building anything")
    return parser


# The most ranks a launch can have: torch.distributed numbers them with 32-bit ints (its
# ProcessGroup takes no larger size), so a larger world is no launch the estimate could describe.
MAX_RANKS = 2**31 - 1


def _ranks(text: str) -> int:
    """--estimate-memory's WORLD_SIZE: a number of ranks, 1 to MAX_RANKS."""
    try:
        ranks = int(text)
    except ValueError:
        ranks = 0
    if ranks < 1:
        raise UserError(f"--estimate-memory takes a number of ranks (1 or more), got {text}")
    if ranks > MAX_RANKS:
        raise UserError(f"--estimate-memory {text}: more ranks than torch.distributed can number (at most "
                        f"{MAX_RANKS}, 2**31 - 1), so no launch has them")
    return ranks


def _shown(value) -> str:
    """A value as one would write it after `--key`."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def key_groups() -> list[tuple[str, list[str]]]:
    """The config's keys as `--help` lists them, by who owns them, each group under its heading:
    the run's own keys (the tier first, then its layout, what it reads and writes), then each
    tier's options (`ExpertTier.options`), then the other sections in the config's order."""
    from te_mixtral.experts.registry import EXPERT_TIERS  # torch: --help comes after the config loaded

    keys = list(settings())
    owners = {tier.options: name for name, tier in EXPERT_TIERS.items() if tier.options is not None}
    sections = sorted(SECTIONS, key=lambda section: SECTIONS[section] not in owners)  # the tiers' first
    groups = [("the run: its tier, layout, inputs and outputs", [key for key in keys if "." not in key])]
    for section in sections:
        cls = SECTIONS[section]
        heading = (f"tier {owners[cls]}'s options ({section}.*), read only with --tier {owners[cls]}" if cls in owners
                   else f"{section}.*: {' '.join(cls.__doc__.split()).split('. ')[0].rstrip('.')}")
        groups.append((heading, [key for key in keys if key.startswith(f"{section}.")]))
    return groups


# The narrowest column a meaning is wrapped into beside its key, value and default; a terminal
# narrower puts each meaning on the lines below its row instead.
MEANING_WIDTH_MIN = 30


def help_text(cfg: RunConfig, config_path: str) -> str:
    """The usage, then one row per config key under its owner's heading (`key_groups`): its
    full name, its value in `cfg`, its default (a rule for the keys that follow another:
    `config.FOLLOWS`) and its meaning, wrapped to the terminal's width."""
    values, fields = flatten(to_dict(cfg)), settings()
    rows = {key: (key, _shown(values[key]), FOLLOWS[key].rule if key in FOLLOWS else _shown(f.default),
                  f.metadata["help"]) for key, f in fields.items()}
    header = ("key", "this run", "default", "meaning")
    key_width = max(len(key) for key in (header[0], *rows))
    value_width, default_width = (min(12, max(len(row[i]) for row in (header, *rows.values()))) for i in (1, 2))
    # Wrapped to the terminal as argparse wraps its own help (COLUMNS, else the terminal's, else 80).
    width = shutil.get_terminal_size().columns - 2
    meaning_at = 2 + key_width + 2 + value_width + 2 + default_width + 2
    if width - meaning_at < MEANING_WIDTH_MIN:  # too narrow beside the columns: each meaning below its row
        meaning_at = 6

    def wrap(text, first="", then=""):
        # break_on_hyphens off: `--ep-size` and file names stay whole.
        return textwrap.fill(text, width, initial_indent=first, subsequent_indent=then,
                             break_on_hyphens=False, break_long_words=False)

    def line(key, value, default, meaning):
        columns = f"  {key:<{key_width}}  {value:<{value_width}}  {default:<{default_width}}  "
        if len(columns) > meaning_at:  # a value or default past its column: the meaning below
            return columns.rstrip() + "\n" + wrap(meaning, " " * meaning_at, " " * meaning_at)
        return wrap(meaning, columns, " " * meaning_at)

    lines = [wrap(f"config keys, with their values from {config_path} and the overrides given "
                  "(--key value, --ep-size or --ep_size alike; the bare name, e.g. --lr, where it is unique):"),
             line(*header)]
    for heading, keys in key_groups():
        lines += ["", wrap(heading), *(line(*rows[key]) for key in keys)]
    return _parser().format_help() + "\n" + "\n".join(lines)


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, dict[str, str]]:
    args, rest = _parser().parse_known_args(argv)
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
    """Run the command line; return the exit code (`errors.ExitCode`)."""
    try:
        return _run(argv)
    except KeyboardInterrupt:  # before training: once it starts, training/loop.py says where it stopped
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # torchrun sends a second one
        if main_rank_from_env():  # every rank got the Ctrl-C
            print_error("interrupted before the first step", ExitCode.INTERRUPTED)
        return ExitCode.INTERRUPTED


ALLOCATOR_SETTINGS = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")


def grow_cuda_memory_in_place(environ) -> None:
    """Unless the user configured torch's CUDA allocator, let it grow its segments in place
    (`expandable_segments`, as torchtitan's launcher sets it). Where the whole model only
    just fits, the default allocator fragments until a request fails, and it then frees its
    cache with cudaFree, which waits for the whole device: with a collective of another rank
    pending on it, that wait can never end. Must run before torch touches CUDA."""
    if not any(name in environ for name in ALLOCATOR_SETTINGS):
        environ["PYTORCH_ALLOC_CONF"] = "expandable_segments:True"


def load_command_line(argv: list[str], world_size: int) -> tuple[argparse.Namespace, dict, int, RunConfig]:
    """The command line read and its config loaded and checked, for `world_size` processes (or
    --estimate-memory's): what every rank does first, and what `python -m te_mixtral.torchrun`
    does before it starts any. Returns the arguments, accelerate's settings (empty unless
    started by `accelerate launch`), the world size and the config; bad input raises UserError."""
    args, overrides = parse_args(argv)
    launch = launch_settings(os.environ)
    world_size = args.estimate_memory or world_size
    return args, launch, world_size, load_run_config(args.config, overrides, world_size=world_size, launch=launch)


def _run(argv: list[str]) -> int:
    grow_cuda_memory_in_place(os.environ)
    try:
        args, launch, world_size, cfg = load_command_line(argv, world_size_from_env())
        if args.estimate_memory is not None:
            from te_mixtral.planning.memory import print_estimate

            return print_estimate(cfg, world_size)
    except UserError as e:
        return report_error(e, world_size_from_env(), main_rank_from_env())
    if args.help:
        print(help_text(cfg, args.config))
        return 0
    if launch and main_rank_from_env():
        print(describe(launch), flush=True)
    from te_mixtral.distributed.layout import shutdown
    from te_mixtral.training.loop import (
        main as train_main,  # after validation: a bad flag fails fast
    )

    try:
        return train_main(cfg, args.config)
    except Exception as e:  # a crash: training/loop.py's main returns for every error it can describe
        if world_size_from_env() > 1:
            end_at_once(e)
        raise
    finally:
        shutdown()


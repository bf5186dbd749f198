"""torchrun worker: train like run_finetune_ep.py, then run the trained (sharded) model once.

Usage: torchrun ... tests/workers/train_then_logits.py OUT.pt [--random-model CONFIG] [run_finetune_ep.py arguments]

After training every rank runs one forward on fixed token ids (the experts are sharded, so
all must); rank 0 saves {"ids", "logits"} to OUT.pt for comparison with the HF export.

With --random-model CONFIG (transformers' Mixtral config fields, JSON), rank 0 first writes
the folder the arguments' --model names, which the other ranks wait for: a random Mixtral of
that config from seed 0, with the default data's tokenizer (its vocabulary and eos set in the
config).
"""

import contextlib
import json
import os
import sys
import time
from pathlib import Path

import torch

from te_mixtral.cli import parse_args
from te_mixtral.config import DataConfig, load_config
from te_mixtral.data.sources import load_documents
from te_mixtral.data.tokenizer import load_tokenizer
from te_mixtral.distributed.launcher_env import world_size_from_env
from te_mixtral.distributed.layout import shutdown
from te_mixtral.model.layers import PackedSequences
from te_mixtral.training.loop import train


def write_random_model(folder: Path, config: dict) -> None:
    """The random checkpoint, renamed into place whole: a rank that sees it may read it."""
    from transformers import MixtralConfig, MixtralForCausalLM

    tokenizer = load_tokenizer(DataConfig(), load_documents(DataConfig()))  # the session's cached BPE
    torch.manual_seed(0)
    written = folder.with_name(folder.name + ".partial")
    MixtralForCausalLM(MixtralConfig(vocab_size=tokenizer.vocab_size, eos_token_id=tokenizer.eos_id, **config)
                       ).save_pretrained(written)
    tokenizer.backend.save(str(written / "tokenizer.json"))
    written.rename(folder)


def wait_for(folder: Path, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not folder.exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"rank 0 wrote no {folder} in {timeout_s:.0f} s")
        time.sleep(0.05)


out, argv = Path(sys.argv[1]), sys.argv[2:]
if argv[:1] == ["--random-model"]:
    config, argv = json.loads(argv[1]), argv[2:]
    source = Path(argv[argv.index("--model") + 1])
    if os.environ.get("RANK", "0") == "0":
        write_random_model(source, config)
    wait_for(source)
args, overrides = parse_args(argv)
cfg = load_config(args.config, overrides, world_size=world_size_from_env())
result = train(cfg)
device = next(result.model.parameters()).device
ids = (torch.arange(2 * 16).view(2, 16) * 7 % 101).to(device)
packed = PackedSequences(torch.arange(16, device=device).expand(2, 16),
                         torch.tensor([0, 16, 32], dtype=torch.int32, device=device), 16)
autocast = (torch.autocast(device.type, dtype=torch.bfloat16) if cfg.precision == "bf16"
            else contextlib.nullcontext())
with torch.no_grad(), autocast:
    logits = result.model(ids, packed)
if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
    torch.save({"ids": ids.cpu(), "logits": logits.float().cpu()}, out)
shutdown(wait_for_peers=True)
sys.exit(result.exit_code)

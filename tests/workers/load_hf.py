"""torchrun worker: load HF checkpoints into this rank's shard; report logits and memory.

Usage: [torchrun ...] tests/workers/load_hf.py OUT_DIR [--ep-size N [--random CONFIG]] CHECKPOINT_DIR...

For each checkpoint folder every rank builds the model with EP = N (default: the world
size; a smaller N makes data-parallel replicas of the experts), loads it with
`load_hf_weights` while measuring how far its resident memory grows (the kernel's peak RSS,
reset just before loading), then runs one forward on fixed token ids (every rank must: the
experts are sharded). Writes OUT_DIR/rank{r}.json, OUT_DIR/logits.pt from rank 0, and
with --ep-size each rank's loaded state dicts, OUT_DIR/weights{r}.pt (checkpoint -> state).
With --random CONFIG (transformers' Mixtral config fields, JSON), rank 0 first writes the one
checkpoint folder named: tests/hf_reference.py's random model of that config, from seed 0.
"""

import ctypes
import gc
import json
import sys
from pathlib import Path

import torch

from te_mixtral.distributed.launcher_env import world_size_from_env
from te_mixtral.distributed.layout import init_layout, shutdown
from te_mixtral.experts.loop import LoopTier
from te_mixtral.model.hf_config import model_config_from_hf
from te_mixtral.model.layers import TORCH, PackedSequences
from te_mixtral.model.mixtral import MixtralForCausalLM
from te_mixtral.training.hf_checkpoint import load_hf_weights


def status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def reset_peak_rss() -> bool:
    # Hand memory freed by the previous checkpoint's model back to the OS first, or reusing
    # it would hide part of this load from the RSS.
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    try:
        Path("/proc/self/clear_refs").write_text("5")  # Linux: VmHWM := current RSS
        return True
    except OSError:
        return False


def write_random_checkpoint(folder: str, config: str) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, which holds hf_reference
    from hf_reference import random_hf_mixtral

    torch.manual_seed(0)
    random_hf_mixtral(**json.loads(config)).save_pretrained(folder)


out_dir, checkpoints = Path(sys.argv[1]), sys.argv[2:]
save_weights = checkpoints[:1] == ["--ep-size"]
ep_size = int(checkpoints[1]) if save_weights else world_size_from_env()
checkpoints = checkpoints[2:] if save_weights else checkpoints
random_config = checkpoints[1] if checkpoints[:1] == ["--random"] else None
checkpoints = checkpoints[2:] if random_config else checkpoints
layout = init_layout(ep_size, "cpu", 120)
if random_config:
    if layout.is_main:
        write_random_checkpoint(*checkpoints, random_config)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()  # no rank reads it before it is written
report, logits, weights = {}, {}, {}
for checkpoint in checkpoints:
    m = model_config_from_hf(checkpoint)
    model = MixtralForCausalLM(m, TORCH, layout, LoopTier())
    measured = reset_peak_rss()
    before_kib = status_kib("VmRSS")
    bytes_read = load_hf_weights(model, checkpoint, layout)
    growth = (status_kib("VmHWM") - before_kib) * 1024 if measured else None
    ids = torch.arange(2 * 16).view(2, 16) * 7 % m.vocab_size
    packed = PackedSequences(torch.arange(16).expand(2, 16), torch.tensor([0, 16, 32], dtype=torch.int32), 16)
    with torch.no_grad():
        logits[checkpoint] = {"ids": ids, "logits": model(ids, packed)}
    report[checkpoint] = {"peak_rss_growth": growth, "bytes_read": bytes_read,
                          "shard_bytes": sum(p.nbytes for p in model.parameters())}
    if save_weights:
        weights[checkpoint] = model.state_dict()
    del model
out_dir.mkdir(parents=True, exist_ok=True)
(out_dir / f"rank{layout.rank}.json").write_text(json.dumps(report))
if layout.is_main:
    torch.save(logits, out_dir / "logits.pt")
if save_weights:
    torch.save(weights, out_dir / f"weights{layout.rank}.pt")
shutdown(wait_for_peers=True)

"""torchrun worker: train like run_finetune_ep.py, then save this rank's weights, whole
(sharded ones gathered: what the rank would hold without sharding), the gradients it held
after each step's gradient reduction and after each step's clipping, and the bytes of its
parameters and optimizer state as it holds them.

Usage: torchrun ... tests/workers/train_and_save.py WEIGHTS_DIR [run_finetune_ep.py arguments]
   or: torchrun ... tests/workers/train_and_save.py --runs RUNS.json
where RUNS.json lists [WEIGHTS_DIR, [arguments]] pairs: several runs, one after another, in
one launch (start-up, not training, is most of a short CPU run's time). Each run builds its
own model, optimizer and layout; only the process group is shared. RUNS.json may also hold
{"script": SCRIPT, "argv": [arguments], "output": DIR}: another worker script of tests/workers,
run here as torchrun would run it alone (its layouts on the shared process group), what each
rank prints kept in DIR/stdout{r} and DIR/stderr{r}; should it fail, this launch fails at once.
And {"stopped_at": N, "whole": RUN, "resumed": RUN, "checkpoints": [FROM, TO]}: a run stopped
after N steps and resumed, in this launch: the RUN never stopped trains (its checkpoints in
FROM), TO is made what that run would have left had it been killed right after its step-N
checkpoint, and the resumed RUN (--resume, its checkpoints in TO) trains on from there.

Writes WEIGHTS_DIR/rank{r}.pt (the state dict) and WEIGHTS_DIR/grads{r}.pt: one dict of
gradients per call of the loop's `reduce_gradients`, so the list's length is how many
times the gradients were communicated; WEIGHTS_DIR/clipped{r}.pt: the same after each call
of the loop's `clip_gradients`, times the clip factor the optimizer applies itself (where it
does): the gradients the optimizer stepped with.
"""

import contextlib
import json
import os
import runpy
import shutil
import sys
import traceback
from pathlib import Path
from unittest.mock import patch

import torch
import torch.distributed as dist
from token_cache import tokenize_once
from torch.distributed.tensor import DTensor

from te_mixtral.cli import parse_args
from te_mixtral.config import load_config
from te_mixtral.data import packing
from te_mixtral.distributed import layout as layout_module
from te_mixtral.distributed.launcher_env import world_size_from_env
from te_mixtral.distributed.layout import init_layout, shutdown
from te_mixtral.distributed.parallelize import reduce_gradients, set_gradient_sync
from te_mixtral.training import loop
from te_mixtral.training.optimizer import clip_gradients

reduced, clipped, syncs = [], [], []


def local_grads(model) -> dict:
    return {name: (p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad).clone()
            for name, p in model.named_parameters() if p.grad is not None}


def recording_reduce_gradients(model, layout, sharding):
    reduce_gradients(model, layout, sharding)
    reduced.append(local_grads(model))


def recording_set_gradient_sync(model, layout, sharding, enabled):
    syncs.append(enabled)
    set_gradient_sync(model, layout, sharding, enabled)


def recording_clip_gradients(optimizer, model, max_norm, layout):
    total_norm, grad_scale = clip_gradients(optimizer, model, max_norm, layout)
    grads = local_grads(model)
    clipped.append(grads if grad_scale is None else {name: g * grad_scale for name, g in grads.items()})
    return total_norm, grad_scale


def init_layout_once(ep_size, device, timeout_s):
    """The loop's `init_layout`, starting the process group only on the first run: later runs
    build their layout (mesh and groups) on the same group (a group destroyed and started
    again in one process can hang at its rendezvous). Later runs meet at a barrier instead of
    that rendezvous: making the mesh's groups does not wait for the peers, and a rank gone
    ahead would start writing the run's outputs while a peer still checks that there are none
    ("holds the steps.jsonl of a run that did not finish")."""
    if not dist.is_initialized():
        return init_layout(ep_size, device, timeout_s)
    dist.barrier()
    with patch.object(dist, "init_process_group", lambda *args, **kwargs: None):
        return init_layout(ep_size, device, timeout_s)


def train_and_save(weights_dir: Path, argv: list[str]) -> int:
    reduced.clear()
    clipped.clear()
    syncs.clear()
    args, overrides = parse_args(argv)
    # No loss and step-time PNGs unless a run asks for them: the tests read these runs' numbers,
    # and drawing costs rank 0 about a second a run while the other ranks wait (the app's own
    # runs draw them: tests/measure/test_run_log.py).
    overrides.setdefault("plots", "false")
    cfg = load_config(args.config, overrides, world_size=world_size_from_env())
    result = loop.train(cfg)
    rank = dist.get_rank() if dist.is_initialized() else 0
    weights_dir.mkdir(parents=True, exist_ok=True)
    weights = {name: value.full_tensor() if isinstance(value, DTensor) else value
               for name, value in result.model.state_dict().items()}
    torch.save(weights, weights_dir / f"rank{rank}.pt")
    state = [value.to_local() if isinstance(value, DTensor) else value
             for per_param in result.optimizer.state.values() for value in per_param.values()]
    params = [p.to_local() if isinstance(p, DTensor) else p for p in result.model.parameters()]
    held = {"parameters": sum(p.nbytes for p in params), "optimizer state": sum(t.nbytes for t in state if t.dim() > 0),
            "syncs": syncs}
    (weights_dir / f"held{rank}.json").write_text(json.dumps(held))
    torch.save(reduced, weights_dir / f"grads{rank}.pt")
    torch.save(clipped, weights_dir / f"clipped{rank}.pt")
    return result.exit_code


def stop_and_resume(step: int, whole: list, resumed: list, checkpoints: list[str]) -> int:
    """Train `whole`, leave in the second checkpoint folder what it had left after `step`
    steps (its later steps' checkpoints removed, `latest` naming step `step`), then train
    `resumed` on from there."""
    exit_code = train_and_save(Path(whole[0]), whole[1])
    if not dist.is_initialized() or dist.get_rank() == 0:
        ckpt, into = map(Path, checkpoints)
        shutil.copytree(ckpt, into)
        kept = f"step-{step:06d}"
        for later in into.glob("step-*"):
            if later.name > kept:  # zero-padded: later steps sort after
                shutil.rmtree(later)
        (into / "latest").write_text(f"{kept}\n")
    if dist.is_initialized():
        dist.barrier()  # no rank resumes before the checkpoint is in place
    return max(exit_code, train_and_save(Path(resumed[0]), resumed[1]))


def keep_process_group(wait_for_peers: bool = False) -> None:
    """The scripts' `shutdown`: the peers reach the end of the script, the group stays."""
    if dist.is_initialized():
        dist.barrier()


def run_script(script: str, argv: list[str], output: Path) -> int:
    """Run a worker script as `torchrun ... SCRIPT ARGV` would, on this launch's process group,
    which its `shutdown` leaves for the next run (and which a script that starts a group itself,
    as the peers' do, joins). Should it fail, exit now, as it would alone: torchrun then stops
    the other ranks, which a failed collective could leave waiting."""
    output.mkdir(parents=True, exist_ok=True)
    rank = os.environ.get("RANK", "0")  # the group may not be started yet: the script starts it
    sys.argv = [script, *argv]
    start_group = dist.init_process_group

    def start_group_once(*args, **kwargs):
        if not dist.is_initialized():
            start_group(*args, **kwargs)

    try:
        with (open(output / f"stdout{rank}", "w") as stdout, open(output / f"stderr{rank}", "w") as stderr,
              contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr),
              patch.object(layout_module, "init_layout", init_layout_once),
              patch.object(layout_module, "shutdown", keep_process_group),
              patch.object(dist, "init_process_group", start_group_once)):
            runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        if e.code not in (None, 0):
            print(f"{script} exited with {e.code}", file=sys.stderr, flush=True)
            os._exit(1)
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    return 0


def run_job(run: list | dict) -> int:
    """One job of RUNS.json (see the module)."""
    if not isinstance(run, dict):
        return train_and_save(Path(run[0]), run[1])
    if "script" in run:
        return run_script(run["script"], run["argv"], Path(run["output"]))
    return stop_and_resume(run["stopped_at"], run["whole"], run["resumed"], run["checkpoints"])


if sys.argv[1] == "--runs":
    runs = json.loads(Path(sys.argv[2]).read_text())
else:
    runs = [(sys.argv[1], sys.argv[2:])]
loop.reduce_gradients = recording_reduce_gradients  # the loop's own calls, wrapped
loop.clip_gradients = recording_clip_gradients
loop.set_gradient_sync = recording_set_gradient_sync
loop.init_layout = init_layout_once
packing.token_stream = tokenize_once(packing.token_stream)
exit_codes = [run_job(run) for run in runs]
shutdown(wait_for_peers=True)
# Everything is written and closed by now. Python's finalization would walk every object torch
# and the libraries made in a last garbage collection: a second or more per rank, for nothing.
sys.stdout.flush()
sys.stderr.flush()
os._exit(max(exit_codes))

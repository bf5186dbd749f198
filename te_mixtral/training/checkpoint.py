"""Training checkpoints: stop a run (or lose it) and continue it exactly where it was.

What a checkpoint holds
-----------------------
Everything the next step depends on, and nothing that can be recomputed:

- the trained weights and the optimizer state (AdamW's moments and step counts,
  master_adamw's remainders) as *global* tensors (with LoRA the adapters alone: the frozen
  base is read again from `--model`, or made again from the seed, so resuming needs the same
  `model_path` and seed): an expert parameter stacks all the model's experts, a
  dense one is whole, whatever the layout that wrote them (distributed/global_state.py).
  torch.distributed.checkpoint (DCP) writes each rank's pieces once and reads back, on each
  rank of the resuming run, exactly the slices that rank holds: a checkpoint written on W
  ranks at EP=E, sharded or not, resumes on W' ranks at EP=E', sharded or not. Experts placed
  by load (`ep_placement`) are stacked in their placement's slot order, which the resumed run
  takes as its own placement (training/expert_placement.py);
- each rank's RNG states (CPU, and CUDA when it runs there), and module state that is not a
  parameter (TE's FP8 metadata, where the model has it);
- the number of completed steps. That is also the data position and the learning rate:
  `PackedData.micro_batches(step)` and `training.optimizer.learning_rate(step)` are pure
  functions of the step, and the order of the samples depends on the seed alone, not on the
  world size, so a resumed run reads exactly the batches the lost one would have read, at any
  world size;
- the losses, gradient norms and evaluations so far, so that a resumed run's results.json
  tells the whole story; the run's id, which its steps.jsonl lines carry too, so that a
  resume into another run's output folder is told from one into its own; the ids of its
  experiment trackers' runs, which a resume goes on in (measure/trackers.py); the run's config,
  so that resuming into a different model is refused; and the SHA-256 of the tokenizer's
  JSON, so that resuming with a different one (a tokenizer trained on other data gives the
  same ids other meanings) is refused too (resume_checks.py: every check of a checkpoint
  against the resuming run's config).

Resuming on another layout computes the same steps with the work cut differently: the
losses equal an uninterrupted run's at the new layout to fp32 rounding (sums are added in
another order), not bit for bit. The RNG states are the saved rank's of the same number, or
rank 0's for a rank the saved run did not have (every rank seeds alike, and without LoRA
dropout training draws no random numbers, so they are all the same; with it, a rank's draws
follow its rows, and a resume on another layout draws other masks than a run there would).

Layout on disk::

    checkpoint_dir/
      latest              "step-000040": the newest complete checkpoint; always written last
      step-000040/
        meta.json         step, world and EP size, config, tokenizer hash, losses, gradient
                          norms, evaluations, run and tracker run ids, the torchrun launch it was
                          written in (training/restart.py), the experts' placement, and the
                          size and SHA-256 of every other file
        .metadata         DCP's index: which file holds which slice of which global tensor
        __0_0.distcp      DCP's data: the pieces rank 0 wrote (one file per rank)
        rank00000.pt      one per rank: {"rng", "extra"} (torch.save)

Atomicity
---------
A checkpoint is written into `step-000040.tmp/`: every rank writes and fsyncs its files,
the ranks hash them (each a share), rank 0 collects the sizes and hashes, writes meta.json,
fsyncs, renames the folder to `step-000040`, and only then replaces `latest` (a temporary
file, fsync, rename, each followed by an fsync of the folder so the rename itself is on
disk). A run killed at any instant, or a disk that fills up, leaves `latest` naming the
previous complete checkpoint; a `.tmp` folder is never read, and the next save removes it
first (so the free-space check counts it as free). A save is refused, on every rank, when
any rank's weights are not finite: `latest` never moves onto a diverged model. On resume
every file is checked against meta.json's size and SHA-256 (each rank a share) before any
is read, so a truncated, corrupted or replaced file is refused with a message instead of
being half loaded. Nothing read can run code, even from a checkpoint whose meta.json was
replaced along with its files: tensors are read with `torch.load(weights_only=True)`, and
DCP's index, a pickle, by an unpickler that builds nothing but an index (dcp_index.py).

Pitfalls: every rank writes into one folder that rank 0 then renames, so `checkpoint_dir`
must be one filesystem that all ranks see (a local disk on one node, a shared filesystem
across nodes).
"""

import contextlib
import hashlib
import json
import math
import os
import pickle
import re
import uuid
import warnings
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor

from te_mixtral.config import RunConfig, resumable_keys, to_dict
from te_mixtral.distributed.global_state import GlobalView, global_state_dict
from te_mixtral.distributed.launcher_env import launch_id_from_env
from te_mixtral.distributed.layout import Layout, all_reduce_max, is_expert_param
from te_mixtral.errors import Diverged, UserError, WriteFailed, first_line, only_here, see_elsewhere
from te_mixtral.experts.quant.frozen import FrozenWeight
from te_mixtral.files import (
    SCRATCH_MARKER,
    folder_bytes,
    is_scratch,
    make_scratch,
    publish_folder,
    remove_marked,
    require_free_space,
    require_writable,
    sha256_of,
    write_failure,
    write_text_atomic,
)
from te_mixtral.local_or_hub import base_model
from te_mixtral.model.lora import base_weights
from te_mixtral.planning.memory import state_bytes
from te_mixtral.saved_config import flatten, upgrade_saved
from te_mixtral.training.dcp_index import INDEX, IndexedReader, read_index
from te_mixtral.training.resume_checks import check_resumable

FORMAT_VERSION = 2  # 1 held each rank's shards in a file of its own, resumable on the same layout only
LATEST = "latest"
META = "meta.json"
_STEP_FOLDER = re.compile(r"step-(\d{6,})")


def step_folder(step: int) -> str:
    return f"step-{step:06d}"


def rank_file(rank: int) -> str:
    return f"rank{rank:05d}.pt"


# --- collectives ------------------------------------------------------------------------


def _any_rank(flag: bool, layout: Layout, device: torch.device) -> bool:
    """Whether `flag` holds on any rank; every rank must call it."""
    return bool(all_reduce_max(torch.tensor(int(flag), device=device), layout).item())


def _fail_together(problem: UserError | None, layout: Layout, device: torch.device, elsewhere: str) -> None:
    """Raise `problem` on the rank that has one and `WriteFailed(elsewhere)` on the others,
    so that no rank is left waiting in the next collective; every rank must call it."""
    if _any_rank(problem is not None, layout, device):
        raise only_here(problem) if problem else see_elsewhere(WriteFailed(elsewhere))


def _local(t: torch.Tensor) -> torch.Tensor:
    """What this rank holds of `t`: a sharded tensor's local shard, else `t`."""
    return t.to_local() if isinstance(t, DTensor) else t


def require_finite_weights(model: torch.nn.Module, layout: Layout, what: str) -> None:
    """Raise `Diverged` on every rank when any rank holds a NaN or infinite weight; every
    rank must call it. The largest magnitude is NaN or infinite exactly then, and PyTorch's
    multi-tensor norm finds it in one pass with no temporary of the weights' size."""
    local = [_local(p.detach()) for p in model.parameters()]
    # A quantised frozen base is finite where its scales are: an amax makes each scale.
    local += [w.scale for w in base_weights(model).values() if isinstance(w, FrozenWeight)]
    bad = not math.isfinite(torch.nn.utils.get_total_norm(local, norm_type=math.inf).item())
    require_finite(bad, layout, local[0].device, what)


def require_finite(bad: bool, layout: Layout, device: torch.device, what: str, whose: str = "the weights") -> None:
    """Raise `Diverged` on every rank when `bad` holds on any rank (`whose` values are not
    finite, so `what` is not saved); every rank must call it."""
    if _any_rank(bad, layout, device):
        raise Diverged(f"{whose} are not finite (NaN or infinity); refusing to save {what}")


def tokenizer_sha256(tokenizer) -> str:
    """The fingerprint of a `data.tokenizer.Tokenizer`: the SHA-256 of its JSON (which
    `tokenizers` writes the same way in every process)."""
    return hashlib.sha256(tokenizer.backend.to_str().encode()).hexdigest()


def _gather_to_main(obj, layout: Layout) -> list | None:
    if layout.world_size == 1:
        return [obj]
    gathered = [None] * layout.world_size if layout.is_main else None
    dist.gather_object(obj, gathered, dst=0)
    return gathered


def _share(names: list[str], layout: Layout) -> list[str]:
    """This rank's share of the files of a checkpoint, to hash or to verify: each file once."""
    return names[layout.rank::layout.world_size]


@contextlib.contextmanager
def _dcp_quietly():
    """DCP warns that it assumes a single process whenever it runs without torch.distributed,
    even when told to: a line in every one-process run's log that says nothing."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _first_failure(e: CheckpointException) -> BaseException:
    """The exception behind a DCP failure (of the lowest rank that had one)."""
    return e.failures[min(e.failures)][0]


# --- what each rank keeps of its own -----------------------------------------------------


def _rng_state(device: torch.device) -> dict:
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["cpu"].cpu())
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"].cpu(), device)


def _extra_state(model: torch.nn.Module) -> dict:
    """What the model's state dict holds besides its parameters (TE's FP8 metadata, buffers)."""
    params = {name for name, _ in model.named_parameters()}
    return {name: _local(t) for name, t in model.state_dict().items() if name not in params}


def _save_rank_file(path: Path, model: torch.nn.Module, device: torch.device) -> None:
    with open(path, "wb") as f:
        torch.save({"rng": _rng_state(device), "extra": _extra_state(model)}, f)
        f.flush()
        os.fsync(f.fileno())


def _load_extra(model: torch.nn.Module, extra: dict, path: Path) -> None:
    unexpected = model.load_state_dict(extra, strict=False).unexpected_keys
    if unexpected:
        raise UserError(f"checkpoint file {path} holds state this model does not have ({unexpected[0]}, ...)")


# --- the checkpointer -------------------------------------------------------------------


@dataclass
class TrainState:
    """Where a run is: completed steps, and what it has measured so far."""

    step: int = 0
    losses: list[float] = field(default_factory=list)
    evals: list[dict] = field(default_factory=list)  # evaluate.Evaluation dictionaries
    router: list[dict] = field(default_factory=list)  # measure/expert_load.step_record, per step
    grad_norms: list[float | None] = field(default_factory=list)  # None: a step of an older checkpoint
    # Made by a fresh run, kept by its resumes. Each rank makes one, and rank 0's is the one
    # written (into meta.json and steps.jsonl: rank 0 writes both).
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    # The experiment trackers' runs, {tracker: its run id}, which a resume goes on in
    # (measure/trackers.py): rank 0's, which starts the trackers and writes meta.json.
    tracker_runs: dict[str, str] = field(default_factory=dict)
    # The padded exchange's capacity as the run raised it, and the steps it ran again: a resume
    # goes on at it (training/exchange_capacity.py). Empty for exact exchanges.
    exchange: dict = field(default_factory=dict)


class Checkpointer:
    """Saves and loads the training checkpoints of `cfg.checkpoint_dir` (see the module
    docstring). Every method is called by every rank at the same point of the run."""

    def __init__(self, cfg: RunConfig, layout: Layout, device: torch.device, tokenizer_hash: str,
                 base_hash: str | None = None):
        self.dir = Path(cfg.checkpoint_dir)
        self.keep = cfg.checkpoint_keep
        self.layout = layout
        self.device = device
        self.tokenizer_hash = tokenizer_hash  # `tokenizer_sha256` of the run's tokenizer
        self.base_hash = base_hash  # a LoRA run's over a --model: `hf_checkpoint.base_sha256` of its base
        self.state_bytes = {expert: state_bytes(cfg, expert) for expert in (False, True)}  # per parameter
        self.single = layout.world_size == 1  # one process: DCP runs without torch.distributed
        # Never deleted with a checkpoint, even where the user put it inside one.
        self.output_dir = Path(cfg.output_dir).resolve() if cfg.output_dir is not None else None
        require_writable(self.dir, "checkpoint directory")

    def check_free_space(self, model: torch.nn.Module) -> None:
        """Refuse to start when the checkpoints cannot fit, rather than fail at a save.

        A save writes a new checkpoint (weights and the optimizer's state: AdamW's two moments,
        and master_adamw's remainders; all ranks) while the `keep` newest stay on disk, and
        prunes only after: at its peak the folder holds `keep + 1` checkpoints. Those already
        here (a resumed run's) are on disk, so they count as written; the leftovers of an
        interrupted save are deleted first, so they count as free. Each global tensor is
        written once, however many ranks hold a copy of it.
        """
        view = GlobalView(self.layout)
        one = round(sum(view.of(name, p).numel() * (p.element_size() + self.state_bytes[is_expert_param(name)])
                        for name, p in model.named_parameters() if p.requires_grad))  # what a checkpoint holds
        complete = [p for p in self.dir.iterdir() if _STEP_FOLDER.fullmatch(p.name)]
        needed = (self.keep + 1 - min(len(complete), self.keep)) * one
        reclaimable = sum(folder_bytes(p) for p in self._leftovers())
        require_free_space(self.dir, needed, f"training checkpoints ({self.keep} kept and the one being written)",
                           reclaimable)

    def _leftovers(self) -> list[Path]:
        return leftovers(self.dir)

    def _may_delete(self, path: Path) -> bool:
        """Whether `path` is a checkpoint folder this manager wrote (`written_here`) that holds
        nothing the run writes elsewhere (its output folder)."""
        return written_here(path) and not (self.output_dir is not None and (
            self.output_dir == path.resolve() or path.resolve() in self.output_dir.parents))

    def save(self, state: TrainState, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
             cfg: RunConfig) -> Path:
        name = step_folder(state.step)
        tmp = self.dir / f"{name}.tmp"
        intact = "the previous checkpoint (if any) is intact"
        require_finite_weights(model, self.layout, f"checkpoint {self.dir / name}; {intact}")
        problem = None
        if self.layout.is_main:
            try:
                for leftover in self._leftovers():  # of runs that died while saving
                    if not self._may_delete(leftover):
                        raise WriteFailed(_not_ours(leftover))
                    remove_marked(leftover, (META,))
                if (self.dir / name).exists() and not self._may_delete(self.dir / name):
                    raise WriteFailed(_not_ours(self.dir / name))  # a stale future this save replaces
                make_scratch(tmp)
            except OSError as e:
                problem = write_failure(f"checkpoint folder {tmp}", e)
            except WriteFailed as e:
                problem = e
        _fail_together(problem, self.layout, self.device, f"checkpoint {tmp} failed on rank 0 (see its error)")
        # A collective that fails inside DCP (a peer died) is no write failure: it goes on up.
        try:
            with _dcp_quietly():
                dcp.save(global_state_dict(model, optimizer, self.layout), checkpoint_id=tmp, no_dist=self.single)
        except CheckpointException as e:  # a write failed: raised on every rank, whichever rank it was
            problem = WriteFailed(f"{write_failure(f'checkpoint {tmp}', _first_failure(e))}; {intact}")
        if problem is None:
            path = tmp / rank_file(self.layout.rank)
            try:
                _save_rank_file(path, model, self.device)
            except (OSError, RuntimeError) as e:  # torch.save raises RuntimeError on a full disk
                problem = WriteFailed(f"{write_failure(f'checkpoint file {path}', e)}; {intact}")
        _fail_together(problem, self.layout, self.device, f"a rank could not write checkpoint {tmp} (see its "
                                                          f"error); {intact}")
        # Every file is complete now (DCP's save ends when every rank's writes have): each rank
        # hashes a share of them.
        names = sorted(p.name for p in tmp.iterdir())
        entry = {name: {"bytes": (tmp / name).stat().st_size, "sha256": sha256_of(tmp / name)}
                 for name in _share(names, self.layout)}
        entries = _gather_to_main(entry, self.layout)
        if self.layout.is_main:
            meta = {
                "format": FORMAT_VERSION,
                "date": datetime.now().isoformat(timespec="seconds"),
                "world_size": self.layout.world_size,
                "ep_size": self.layout.ep_size,
                "tokenizer_sha256": self.tokenizer_hash,
                "base_model": base_model(cfg.model_path),
                "base_sha256": self.base_hash,
                "launch": launch_id_from_env(),
                "placement": model.placement.record(),
                **asdict(state),
                "config": to_dict(cfg),
                "files": {name: e for share in entries for name, e in sorted(share.items())},
            }
            try:
                write_text_atomic(tmp / META, json.dumps(meta, indent=1))
                publish_folder(tmp, self.dir / name)
                write_text_atomic(self.dir / LATEST, name + "\n")
                self._prune(name)
            except OSError as e:
                problem = WriteFailed(f"{write_failure(f'checkpoint {self.dir / name}', e)}; {intact}")
        # Every rank returns once the checkpoint is committed, or fails with rank 0.
        _fail_together(problem, self.layout, self.device, f"rank 0 could not finish checkpoint {self.dir / name} "
                                                          f"(see its error); {intact}")
        return self.dir / name

    def _prune(self, latest: str) -> None:
        """Keep the newest `keep` checkpoints up to `latest`; delete the rest, and leftovers of
        interrupted saves. A checkpoint *newer* than `latest` belongs to a run that died before
        it could point `latest` at it, a future this run has replaced. Only what this manager
        wrote goes (`_may_delete`): a link, or a folder of the user's named like a checkpoint,
        stays."""
        latest_step = int(_STEP_FOLDER.fullmatch(latest)[1])
        folders = [p for p in self.dir.iterdir() if p.name.startswith("step-")]
        complete = {int(m[1]): p for p in folders if (m := _STEP_FOLDER.fullmatch(p.name))}
        kept = {complete[step] for step in sorted(s for s in complete if s <= latest_step)[-self.keep:]}
        for path in folders:
            if path not in kept and self._may_delete(path):
                with contextlib.suppress(OSError):
                    remove_marked(path, (META,))

    def last_saved(self) -> Path | None:
        """The checkpoint `latest` names, or None when there is none."""
        try:
            return self.dir / (self.dir / LATEST).read_text().strip()
        except OSError:
            return None

    def load_latest(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, cfg: RunConfig) -> TrainState:
        """Restore the weights, the optimizer state and the RNG from the checkpoint `latest`
        names, each rank reading the slices this run's layout gives it."""
        pointer = self.dir / LATEST
        try:
            name = pointer.read_text(errors="replace").strip()
        except FileNotFoundError:
            raise UserError(f"no checkpoint to resume from in {self.dir} (no '{LATEST}' file)") from None
        except OSError as e:
            raise UserError(f"cannot read {pointer}: {e.strerror}") from None
        if not _STEP_FOLDER.fullmatch(name):
            raise UserError(f"{pointer} is corrupt: it names '{name[:40]}', not a step-NNNNNN folder")
        folder = self.dir / name
        try:
            meta = json.loads((folder / META).read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise UserError(f"checkpoint {folder} is unreadable or corrupt ({META}: {e}); "
                            f"delete it and point {pointer} at an older one") from None
        _check_meta(meta, folder)
        check_resumable(meta, cfg, folder / META, self.tokenizer_hash, self.base_hash)

        problem = next(filter(None, (_verify(folder / name, meta["files"][name])
                                     for name in _share(sorted(meta["files"]), self.layout))), None)
        # DCP's index (which names the data files) and this rank's own file must be listed, so
        # that nothing unverified is read.
        own = rank_file(self.layout.rank if self.layout.rank < meta["world_size"] else 0)  # see the module
        problem = problem or next((f"checkpoint file {folder / name} is not listed in its {META}"
                                   for name in (INDEX, own) if name not in meta["files"]), None)
        index = None
        if problem is None:
            try:
                index = read_index(folder / INDEX)
            except UserError as e:
                problem = str(e)
        # A rank with a bad file must not leave the others waiting in the next collective.
        if _any_rank(problem is not None, self.layout, self.device):
            raise only_here(UserError(problem)) if problem else see_elsewhere(UserError(
                f"checkpoint {folder} failed verification on another rank (see its error)"))
        try:
            with _dcp_quietly():
                dcp.load(global_state_dict(model, optimizer, self.layout), storage_reader=IndexedReader(folder, index),
                         no_dist=self.single)
        except CheckpointException as e:  # raised on every rank
            raise UserError(f"checkpoint {folder} does not fit this run's model: "
                            f"{first_line(_first_failure(e))}") from None
        try:
            blob = torch.load(folder / own, map_location=self.device, weights_only=True)
        except pickle.UnpicklingError:  # its message advises weights_only=False, which runs the file's code
            raise UserError(f"checkpoint file {folder / own} holds objects other than tensors and plain data, which "
                            f"te_mixtral never writes: it was altered, or written by another program; it is not "
                            f"loaded") from None
        _load_extra(model, blob["extra"], folder / own)
        _set_rng_state(blob["rng"], self.device)
        if self.layout.is_main:
            # A change of EP size or sharding is among the notes below; the world size is no setting.
            moved = (f", written by {meta['world_size']} rank(s), read by {self.layout.world_size}"
                     if meta["world_size"] != self.layout.world_size else "")
            print(f"te_mixtral: resuming from {folder} (step {meta['step']} of {cfg.train.steps}){moved}", flush=True)
            for note in _changed_settings(upgrade_saved(meta["config"]), to_dict(cfg)):
                print(f"te_mixtral: note: changed since the checkpoint: {note}", flush=True)
        # Checkpoints saved before the router records or the gradient norms were kept have none.
        grad_norms = meta.get("grad_norms", [None] * meta["step"])
        # Checkpoints saved before run ids: the resumed run makes one; before tracker runs: none.
        return TrainState(meta["step"], [float(x) for x in meta["losses"]], list(meta["evals"]),
                          list(meta.get("router", [])), grad_norms, **({"run_id": str(meta["run_id"])}
                                                                       if "run_id" in meta else {}),
                          tracker_runs=dict(meta.get("tracker_runs", {})), exchange=dict(meta.get("exchange", {})))


def latest_meta(folder: Path) -> tuple[Path, dict] | None:
    """The checkpoint `latest` names in the checkpoint folder `folder`, and its meta.json as
    written; None where there is none, or it cannot be read (`load_latest` says why)."""
    try:
        checkpoint = folder / (folder / LATEST).read_text().strip()
        meta = json.loads((checkpoint / META).read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    return (checkpoint, meta) if isinstance(meta, dict) else None


def leftovers(folder: Path) -> list[Path]:
    """The leftovers of interrupted saves in the checkpoint folder `folder`, which the next
    save deletes."""
    return [p for p in folder.iterdir() if p.name.startswith("step-") and p.name.endswith((".tmp", ".old"))]


def written_here(path: Path) -> bool:
    """Whether `path` is a checkpoint folder a `Checkpointer` wrote: a folder (not a link to
    one) holding the marker it was made with, or (a checkpoint written before the marker) its
    meta.json; or an empty one, which a save or pruning killed midway leaves (files.py)."""
    return is_scratch(path) or (path.is_dir() and not path.is_symlink() and (path / META).is_file())


def _not_ours(path: Path) -> str:
    return (f"{path} is in the way of a checkpoint save, which would delete it, and nothing shows te_mixtral wrote "
            f"it (no {SCRATCH_MARKER} or {META}; a link; or the run's output folder is inside it): move it away")


# What meta.json must hold for `load_latest` to read it: key -> its type.
_META_KEYS = {"format": int, "step": int, "world_size": int, "ep_size": int, "losses": list, "evals": list,
              "config": dict, "files": dict}


def _check_meta(meta, folder: Path) -> None:
    """Refuse a meta.json that parses but lacks what resuming reads (edited by hand, or
    written by another program): one line naming the key, not a KeyError."""
    where = folder / META
    if not isinstance(meta, dict):
        raise UserError(f"checkpoint {where} is corrupt: it holds a {type(meta).__name__}, not a mapping")
    if meta.get("format") != FORMAT_VERSION:  # another format may have other keys: say which format
        why = (": each rank's own shards, which only the te_mixtral that wrote them reads (finish that run with it)"
               if meta.get("format") == 1 else "")
        raise UserError(f"checkpoint {folder} has format {meta.get('format')}, this version reads {FORMAT_VERSION}{why}")
    for key, typ in _META_KEYS.items():
        if not isinstance(meta.get(key), typ) or isinstance(meta.get(key), bool):
            problem = "lacks" if key not in meta else f"has a {type(meta[key]).__name__} for"
            raise UserError(f"checkpoint {where} is corrupt: it {problem} '{key}' ({typ.__name__} expected)")
    for name, entry in meta["files"].items():
        if not (isinstance(entry, dict) and isinstance(entry.get("bytes"), int)
                and isinstance(entry.get("sha256"), str)):
            raise UserError(f"checkpoint {where} is corrupt: its entry for {name} lacks 'bytes' or 'sha256'")
    if not isinstance(upgrade_saved(meta["config"], str(where)).get("model"), dict):
        raise UserError(f"checkpoint {where} is corrupt: its 'config' has no 'model' section")
    if not all(map(_is_number, meta["losses"])):
        raise UserError(f"checkpoint {where} is corrupt: its 'losses' are not all numbers")
    runs = meta.get("tracker_runs", {})  # older checkpoints have none
    if not (isinstance(runs, dict) and all(isinstance(run_id, str) for run_id in runs.values())):
        raise UserError(f"checkpoint {where} is corrupt: its 'tracker_runs' is not a mapping of tracker names to "
                        f"run ids")
    exchange = meta.get("exchange", {})  # older checkpoints, and exact exchanges: none
    if not (isinstance(exchange, dict) and (not exchange or (_is_number(exchange.get("capacity"))
                                                            and isinstance(exchange.get("steps_run_again"), list)))):
        raise UserError(f"checkpoint {where} is corrupt: its 'exchange' is not the padded exchange's capacity and "
                        f"the steps it ran again")


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _verify(path: Path, entry: dict | None) -> str | None:
    """Why the file at `path` must not be loaded, or None when it matches its manifest entry."""
    if entry is None:
        return f"checkpoint file {path} is not listed in its {META}"
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return f"checkpoint file {path} is missing"
    if size != entry["bytes"]:
        return f"checkpoint file {path} is truncated or corrupt ({size} bytes, {entry['bytes']} written)"
    if sha256_of(path) != entry["sha256"]:
        return f"checkpoint file {path} is corrupt (its SHA-256 differs from the one recorded when it was written)"
    return None


def _changed_settings(saved: dict, now: dict) -> list[str]:
    """'train.steps 6 -> 8' for each setting that differs, other than those that may change
    on resume (`resumable_keys`: with LoRA's dropout, not those that cut its masks otherwise);
    the model is checked separately."""
    saved_flat, now_flat = flatten(saved), flatten(now)
    resumable = resumable_keys(now_flat)
    return [f"{key} {saved_flat.get(key)!r} -> {value!r}" for key, value in now_flat.items()
            if key not in resumable and saved_flat.get(key) != value]

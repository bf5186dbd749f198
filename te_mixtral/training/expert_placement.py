"""Which placement a run's experts take (te_mixtral/distributed/placement.py).

A new run: the one `ep_placement`'s load gives, or in order. A resumed run: the placement of
the checkpoint it resumes, whatever its EP size. The checkpoint stacks each layer's experts in
that placement's slot order, and a slot order is a placement at any EP size that divides the
experts (rank r holds the slots r*E/EP onwards), so the resume reads the experts it holds as
the router's ids name them on any layout, as an in-order checkpoint always could. Placed by
load at EP=4, each pair of experts a rank holds is balanced; at EP=2 a rank holds two such
pairs, also balanced.

A resume given `ep_placement` checks the file against the checkpoint: at the checkpoint's EP
size, the file must still place the experts as it did then (so a run resumed with its own
config goes on, at any EP size); a file that now places them otherwise, or a checkpoint in
order, is refused in one line, since the run would not place them as the file says.
"""

from pathlib import Path

from te_mixtral.config import RunConfig, changes_nothing, to_dict
from te_mixtral.distributed.launcher_env import main_rank_from_env
from te_mixtral.distributed.placement import ExpertPlacement
from te_mixtral.errors import UserError
from te_mixtral.measure.expert_load import placement_by_recorded_load
from te_mixtral.saved_config import flatten
from te_mixtral.training.checkpoint import latest_meta


def run_placement(cfg: RunConfig) -> ExpertPlacement:
    """The placement of this run's experts (the module docstring); rank 0 says what a new run's
    `ep_placement` placed, and where a resume takes one that `ep_placement` does not name."""
    # A saved config's ep_placement that this run's ep_size or tier turns off is left alone
    # (config_checks.check_needs): it places nothing, and its file is not read.
    asked = cfg.ep_placement is not None and not changes_nothing("ep_placement", flatten(to_dict(cfg)))
    latest = latest_meta(Path(cfg.checkpoint_dir)) if cfg.resume and cfg.checkpoint_dir else None
    if latest is None:  # a new run, or no checkpoint to resume (load_latest says so)
        if not asked:
            return ExpertPlacement(cfg.ep_size)
        placement = _by_file(cfg, cfg.ep_size)
        if main_rank_from_env():  # a load that moves nothing leaves the run in order: said, as nothing else tells
            print(f"te_mixtral: the experts are placed by the load ep_placement {cfg.ep_placement} recorded: "
                  f"{placement.layers_placed()} of {cfg.model.num_hidden_layers} layers otherwise than in order"
                  if placement.placed else
                  f"te_mixtral: note: ep_placement {cfg.ep_placement}'s load places no layer's experts better than "
                  f"in order: they stay in order", flush=True)
        return placement
    folder, meta = latest
    saved = _saved_placement(meta, folder, cfg)
    saved_file = meta["config"].get("ep_placement") if isinstance(meta.get("config"), dict) else None
    if asked and _by_file(cfg, _saved_ep_size(meta, folder, cfg)).record() != saved:
        held = "in order" if saved is None else f"placed by the load ep_placement {saved_file} recorded then"
        raise UserError(f"checkpoint {folder} holds its experts {held}, not as ep_placement {cfg.ep_placement} places "
                        f"them at its EP={meta['ep_size']}: resume without --ep-placement (a resume keeps its "
                        f"checkpoint's placement)")
    if saved is not None and not asked and main_rank_from_env():
        held = ("the experts are placed as" if cfg.ep_size > 1 else
                "one rank holds every expert, in the order in which")  # placed for no rank but read as stacked
        print(f"te_mixtral: note: {held} checkpoint {folder} placed them (by the load of {saved_file}): a resume "
              f"keeps its checkpoint's placement", flush=True)
    return ExpertPlacement(cfg.ep_size, None if saved is None else tuple(map(tuple, saved)))


def _by_file(cfg: RunConfig, ep_size: int) -> ExpertPlacement:
    return placement_by_recorded_load(cfg.ep_placement, cfg.model.num_hidden_layers, cfg.model.num_experts, ep_size)


def _saved_placement(meta: dict, folder: Path, cfg: RunConfig) -> list[list[int]] | None:
    """The checkpoint's placement as meta.json records it (None: in order, as every checkpoint
    before placements was). One of another model's shape is left for resume_checks to refuse
    with the model; one that is not a placement, refused as corrupt."""
    saved = meta.get("placement")
    layers, experts = cfg.model.num_hidden_layers, cfg.model.num_experts
    if saved is None or (isinstance(saved, list) and len(saved) != layers):
        return None
    if not all(isinstance(s, list) and all(type(e) is int for e in s) and sorted(s) == list(range(experts))
               for s in saved):
        raise UserError(f"checkpoint {folder} is corrupt: its 'placement' is not each layer's {experts} experts, each "
                        f"once")
    return saved


def _saved_ep_size(meta: dict, folder: Path, cfg: RunConfig) -> int:
    ep_size = meta.get("ep_size")
    if not (type(ep_size) is int and ep_size > 0 and cfg.model.num_experts % ep_size == 0):
        raise UserError(f"checkpoint {folder} is corrupt: its 'ep_size' {ep_size!r} does not divide the experts")
    return ep_size

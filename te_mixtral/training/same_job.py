"""Every rank runs the same job: checked once the ranks have started, before the first step.

Each rank reads its own config file, command line and environment (`accelerate launch`'s
settings), and its own copy of the data, from which it reads or trains its tokenizer. On
several machines those are several copies, and copies drift: a config edited on one node,
another node's accelerate config asking for bf16, a data file that differs. Ranks that
disagree either fail in a collective with a line that blames a lost peer (the rows they
exchange differ in dtype or count) or, worse, train on without a word (a learning rate that
differs pulls the replicated weights apart). So the ranks compare what they are about to run,
and every rank refuses alike, naming the first setting that differs.

Compared: every config key as resolved (the file, the overrides, accelerate's settings, a
--model checkpoint's model section), a hub checkpoint's revision, the tokenizer's SHA-256, the
experts' placement (each rank reads `ep_placement`'s file for itself), and the token counts
of the training and held-out data (counts, not contents: hashing a large corpus at every
start would cost more than the few differences it alone would find).

A --model hub id is read from each rank's own Hugging Face cache (HF_HOME), which may differ
from node to node in where it is and in which revision it holds: the revision is compared (it
fixes the weights, which each rank reads for itself), the folder it is in is not (a tokenizer
read from it is compared by its SHA-256). A local --model folder is compared by its path, as
given: copies of it on several machines are trusted to hold the same weights.
"""

from pathlib import Path

import torch.distributed as dist

from te_mixtral.config import RunConfig, to_dict
from te_mixtral.data.packing import PackedData
from te_mixtral.distributed.layout import Layout
from te_mixtral.distributed.placement import ExpertPlacement
from te_mixtral.errors import UserError
from te_mixtral.model.hf_config import hub_revision
from te_mixtral.saved_config import flatten
from te_mixtral.training.checkpoint import tokenizer_sha256


def settings_summary(cfg: RunConfig, model_dir: Path | None) -> dict[str, object]:
    """The settings this rank is about to run with, as the ranks compare them: every config
    key as resolved, `model_dir` (the --model checkpoint's folder) by its hub revision."""
    settings = flatten(to_dict(cfg))
    if model_dir is not None and settings["data.tokenizer"] == str(model_dir):
        settings["data.tokenizer"] = "the --model checkpoint's"  # where this rank's cache keeps it: its own
    return {**settings, "the --model checkpoint's hub revision": hub_revision(model_dir) if model_dir else None}


def job_summary(cfg: RunConfig, data: PackedData, model_dir: Path | None,
                placement: ExpertPlacement) -> dict[str, object]:
    """What this rank is about to run, as the ranks compare it."""
    return {**settings_summary(cfg, model_dir), "the tokenizer's SHA-256": tokenizer_sha256(data.tokenizer),
            "the experts' placement by ep_placement's file": placement.record() or "in order",
            "the training data's token count": len(data.stream.tokens),
            "the held-out data's token count": len(data.eval_stream.tokens)}


def first_difference(summaries: list[dict[str, object]]) -> str | None:
    """Where a rank's summary first differs from rank 0's, in words; None where none does."""
    first = summaries[0]
    for rank, summary in enumerate(summaries[1:], start=1):
        for key in [*first, *(key for key in summary if key not in first)]:
            if repr(summary.get(key)) != repr(first.get(key)):  # repr: a NaN equals itself
                return f"{key} is {first.get(key)} on rank 0 and {summary.get(key)} on rank {rank}"
    return None


def require_same_job(summary: dict[str, object], layout: Layout) -> None:
    """A `UserError` on every rank alike where any rank's `summary` differs from rank 0's."""
    if layout.world_size == 1:
        return
    summaries = [None] * layout.world_size
    dist.all_gather_object(summaries, summary)
    difference = first_difference(summaries)
    if difference is not None:
        raise UserError(f"the ranks would run different jobs: {difference}; give every rank the same config file, "
                        f"command line, ACCELERATE_* settings, data, ep_placement file and Hugging Face cache")

"""`setting`: a config field that carries its own meaning and role.

The config's sections (config.py) and the tiers' own options (experts/options.py) declare
their keys with it, so the code that asks "which keys ...?" (the results pages, the resume
check, `--help`) reads the answer from the fields instead of keeping its own list. It lives
below both, so that a tier's options need not import the config they are part of.
"""

from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Needs:
    """What a key needs of other keys before it changes anything: LoRA's alpha needs a rank,
    generate_tokens a prompt. `holds` takes the values of `keys` (full names), in that order;
    `text` completes the one-line refusal that starts with the key's name. The config refuses
    a key given without what it needs (`config_checks.check_needs`), rather than ignore it."""

    keys: tuple[str, ...]
    holds: Callable[..., bool]
    text: str

    def hold_in(self, value_of: Callable[[str], object]) -> bool:
        """Whether what the key needs holds, `value_of` giving each key's value by its full name
        (of a run config, or of a saved one flattened)."""
        return self.holds(*(value_of(key) for key in self.keys))


def setting(default, *, help: str, workload: bool = True, resumable: bool | Needs = False, headline: bool = False,
            needs: Needs | None = None, path: bool = False):
    """A config field that says what it means and what role it plays, so that the code that
    asks "which keys ...?" reads the answer here instead of keeping its own list:

    - `help`: one line, what the key means (`run_finetune_ep.py --help` lists it);
    - `workload`: the key changes what a timed step computes, so a results page compares two
      runs only when they agree on it. On by default: a new key keeps runs apart until it is
      declared harmless, which is the safe mistake;
    - `resumable`: the key may change on `--resume` without a note (where output goes, what
      happens between or after steps). Off by default, for the same reason. A `Needs`: only
      where it holds in the resumed run's config (the keys that cut a step's rows otherwise,
      without LoRA's dropout, whose masks are drawn over the rows as cut);
    - `headline`: a reproduce command names it even at its default: the runs of a sweep
      (`scripts/gpu_runs.py tiers`) differ in it;
    - `needs`: what other keys must say for this one to change anything (`Needs`); None: it
      always does;
    - `path`: the key names a file or folder (or a hub id): a leading `~` is the user's home
      wherever the key is set, as a shell expands it on the command line (config.load_config).
    """
    return field(default=default, metadata={"help": help, "workload": workload, "resumable": resumable,
                                            "headline": headline, "needs": needs, "path": path})

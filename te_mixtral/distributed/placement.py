"""Which experts each expert-parallel rank holds, layer by layer.

Shape suffixes: see te_mixtral/__init__.py (Y layers, E experts, S slots, P ranks).

Each MoE layer's all-to-all waits for its busiest rank, and a rank's rows are the token
copies the router sent to the experts it holds. In order (the default), EP rank r holds
experts r*L .. (r+1)*L - 1 of every layer, L = E/P. Which experts share a rank is free: it
changes no number the model computes (each expert meets the same rows in the same order),
only where they are computed. Placed by load (`ep_placement`: an earlier run's results.json),
each layer's experts go heaviest first onto the rank with the fewest rows that still has
room, by the tokens per layer and expert that run recorded: the heavy beside the light, so
that the busiest rank has fewer rows for the others to wait for. With two experts a rank
that is the best placement there is; with more, greedy. A layer stays in order where that
leaves its busiest rank no more rows (ties, no load at all). The load must be that of the same
model and data (the same router): a layer's heavy experts stay heavy from step to step, so a
placement held for a run meets about the balance it was chosen on.

The model holds its experts in *slot* order: EP rank r holds slots [r*L, (r+1)*L) of every
layer, and slot s of layer y holds expert `experts_YS[y][s]`. The dispatcher turns the
router's expert ids into slots before the exchange (`slot_of_expert`); what reads or writes
an expert by its id (HF weights in and out, the seed-made init, LoRA adapters) asks
`held` or `in_expert_order`. Training checkpoints hold the stacked experts in slot order and
record the placement, which a resume takes as its own, at any EP size that divides the
experts (training/expert_placement.py).
"""

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ExpertPlacement:
    ep_size: int
    experts_YS: tuple[tuple[int, ...], ...] | None = None  # None: in order

    @classmethod
    def by_load(cls, tokens_YE: torch.Tensor, ep_size: int) -> "ExpertPlacement":
        """Each layer's experts placed greedily by their load (the module docstring); a rank's
        experts in the order of their ids. A layer stays in order where that leaves its
        busiest rank no more rows (ties, no load): a move that gains nothing is only a
        placement a checkpoint must then be resumed under."""
        num_experts = tokens_YE.shape[1]
        room = num_experts // ep_size
        experts_YS = []
        for load_E in tokens_YE.double().tolist():
            rows, held = [0.0] * ep_size, [[] for _ in range(ep_size)]
            for expert in sorted(range(num_experts), key=lambda e: (-load_E[e], e)):
                rank = min((r for r in range(ep_size) if len(held[r]) < room), key=lambda r: (rows[r], r))
                rows[rank] += load_E[expert]
                held[rank].append(expert)
            in_order = max(sum(load_E[r * room:(r + 1) * room]) for r in range(ep_size))
            experts_YS.append(tuple(range(num_experts)) if in_order <= max(rows) else
                              tuple(e for experts in held for e in sorted(experts)))
        if all(experts == tuple(range(num_experts)) for experts in experts_YS):
            return cls(ep_size)
        return cls(ep_size, tuple(experts_YS))

    @property
    def placed(self) -> bool:
        return self.experts_YS is not None

    def layers_placed(self) -> int:
        """How many layers hold their experts otherwise than in order."""
        return sum(list(experts) != sorted(experts) for experts in self.experts_YS or ())

    def held(self, layer: int, ep_rank: int, num_experts: int) -> list[int]:
        """The ids of the experts `ep_rank` holds in `layer`, in its local order."""
        local = num_experts // self.ep_size
        slots = range(ep_rank * local, (ep_rank + 1) * local)
        return list(slots) if self.experts_YS is None else [self.experts_YS[layer][s] for s in slots]

    def slot_of_expert(self, layer: int) -> list[int] | None:
        """Each expert id's slot in `layer`, indexed by expert; None in order."""
        if self.experts_YS is None:
            return None
        slots = [0] * len(self.experts_YS[layer])
        for slot, expert in enumerate(self.experts_YS[layer]):
            slots[expert] = slot
        return slots

    def in_expert_order(self, layer: int, by_slot: list) -> list:
        """A layer's items given slot by slot (every rank's experts, gathered), by expert id."""
        slots = self.slot_of_expert(layer)
        return by_slot if slots is None else [by_slot[slot] for slot in slots]

    def rows(self, tokens_YE: torch.Tensor) -> torch.Tensor:
        """The rows each rank gets in each layer under this placement, [Y, P]."""
        layers, num_experts = tokens_YE.shape
        if self.experts_YS is not None:
            tokens_YE = tokens_YE.gather(1, torch.tensor(self.experts_YS, device=tokens_YE.device))
        return tokens_YE.reshape(layers, self.ep_size, num_experts // self.ep_size).sum(-1)

    def record(self) -> list[list[int]] | None:
        """What checkpoints and results.json keep: each layer's experts slot by slot, or None
        (in order)."""
        return None if self.experts_YS is None else [list(experts) for experts in self.experts_YS]

"""A frozen LoRA base's stacked expert weight held quantised alone, filled as it loads.

Shape suffixes: see te_mixtral/__init__.py.

With LoRA the base never changes, so a tier may hold each stacked expert weight [L, N, I]
in a format of its own (FP8 in frozen_fp8.py, NF4 in frozen_nf4.py) and never keep a
BF16 copy. Every such format quantises each row (one output channel of one expert)
independently of the others, which is what lets a weight fill row block by row block: a
Hugging Face checkpoint's w1, w3 and w2 tensors land in their rows of the stack as they
are read (`weight[expert, rows].copy_(tensor)`, what training/hf_checkpoint.py does with
any weight), and the whole model is never in memory in BF16. A seeded initialisation draws
each expert in the dtype a BF16 base would (`normal_`), so the quantised base is the BF16
base's quantisation and the two can be compared on one run.

The quantised parts are buffers that share the stack's leading dims [L, N] (each format
chooses the dims after them), not parameters and not in the state dict: a LoRA checkpoint holds
the adapters, and a resumed run reads the base again from `--model` or the seed. Every
format has a float32 `scale` part that is not finite where its rows are not (a row's or
block's amax makes it): training/checkpoint.py's finiteness check reads it.
"""

import abc

import torch
from torch import nn


class FrozenWeight(nn.Module, abc.ABC):
    """One stacked expert weight [L, N, I] as quantised parts, each [L, N, its own width]."""

    format: str  # the format's name, for messages

    def __init__(self, shape: tuple[int, ...], parts: dict[str, tuple[tuple[int, ...], torch.dtype]]):
        """Empty (filled by `copy_` or `normal_` on its rows); `parts` maps each buffer's
        name to (its dims after the leading [L, N], its dtype)."""
        super().__init__()
        for name, (tail, dtype) in parts.items():
            self.register_buffer(name, torch.empty((*shape[:-1], *tail), dtype=dtype), persistent=False)
        self.part_names = tuple(parts)
        self.first_tail = len(next(iter(parts.values()))[0])  # the first part's dims after [L, N]
        self.row_width = shape[-1]
        # What a seeded initialisation draws in: the dtype a BF16 (or fp32) base would be made in.
        self.source_dtype = torch.get_default_dtype()

    @property
    def shape(self) -> torch.Size:
        return self[:].shape

    def numel(self) -> int:
        return self.shape.numel()

    def parts(self) -> tuple[torch.Tensor, ...]:
        return tuple(getattr(self, name) for name in self.part_names)

    @classmethod
    def stored_bytes(cls, shape: tuple[int, ...]) -> int:
        """Bytes a weight of `shape` takes in this format: its parts, made on the meta device
        (no memory), so what is counted is what the format allocates."""
        with torch.device("meta"):
            return sum(part.nbytes for part in cls(shape).parts())

    def __getitem__(self, index) -> "QuantizedRows":
        return QuantizedRows(self, index)

    def copy_(self, weight: torch.Tensor) -> "FrozenWeight":
        self[:].copy_(weight)
        return self

    @abc.abstractmethod
    def quantize(self, rows: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The parts of `rows` [..., I], in `part_names` order."""

    @abc.abstractmethod
    def dequantized(self, dtype=torch.float32) -> torch.Tensor:
        """The weight the quantised GEMMs multiply by, in `dtype` (a merged export's base)."""


class QuantizedRows:
    """Whole rows of a `FrozenWeight` (an index that keeps the last dim), which a loader
    fills like a tensor: `copy_` quantises what it is given, `normal_` draws it first."""

    def __init__(self, weight: FrozenWeight, index):
        self.weight, self.index = weight, index
        self.parts = tuple(part[index] for part in weight.parts())  # views: filling them fills the weight

    @property
    def shape(self) -> torch.Size:
        first = self.parts[0].shape
        return torch.Size((*first[:len(first) - self.weight.first_tail], self.weight.row_width))

    @torch.no_grad()
    def copy_(self, rows: torch.Tensor) -> "QuantizedRows":
        if rows.shape != self.shape:
            raise ValueError(f"cannot fill {self.weight.format} rows of shape {tuple(self.shape)} from "
                             f"{tuple(rows.shape)}")
        for part, value in zip(self.parts, self.weight.quantize(rows.to(self.parts[0].device))):
            part.copy_(value)
        return self

    def normal_(self, mean: float, std: float, generator: torch.Generator | None = None) -> "QuantizedRows":
        drawn = torch.empty(self.shape, dtype=self.weight.source_dtype, device=self.parts[0].device)
        return self.copy_(drawn.normal_(mean, std, generator=generator))

"""Documents in, packed batches out: the token stream, its windows, and sharding.

The documents come from te_mixtral/data/sources.py, the tokenizer from
te_mixtral/data/tokenizer.py; this module packs them.

The idea
--------
Fine-tuning batches here are *packed*: every document is tokenized, closed with an end of
sequence token (eos), and the documents are laid end to end in one long token stream.
A sample is a window of that stream, exactly `seq_len` tokens long, so there is never any
padding and every token of compute is spent on real text.

Packing puts several documents in one sample, so the model must be told where each one
starts, or attention and the loss would leak from one document into the next:

- `position_ids` restart at 0 at every document start inside a sample;
- `labels` are the next stream token, except at an eos, whose next token is the first token
  of an unrelated document; that label is -100 (no loss);
- `cu_seqlens` lists the cumulative lengths of the document segments over the flattened
  `B*S` tokens, the "THD" layout that Transformer Engine's fused attention takes to keep
  attention inside each segment. A sample boundary is always a segment boundary: a document
  cut by the edge of a sample goes on in the next sample as a new segment at position 0.

`position_ids` and `cu_seqlens`, with the longest segment `max_seqlen`, travel as the
batch's `packed`: the model's own `PackedSequences`, handed to its forward as it is.

Example, S = 6, `|` an eos::

    stream     a b c | d e f g | h i ...
    sample 0   a b c | d e         positions 0 1 2 3 0 1   labels b c | -100 e f
    sample 1   f g | h i ...       positions 0 1 2 0 1 ...

Chat data (te_mixtral/data/chat.py) packs the same way, with two differences: a
conversation holds an eos after every reply, so its edges come from the conversations'
lengths rather than from eos tokens; and only the assistant's tokens are targets, every
other label is -100. Samples left with no target at all (a long prompt can fill one) would
train nothing and are left out.

Windows overlap by one token: sample i reads stream tokens [i*S, i*S + S] (S + 1 of them:
S inputs, and the last one is only a label), so the last label of a sample is the first
input of the next. Every stream token after the first is then a target exactly once and
nothing is thrown away but the short remainder at the end.

Sharding and micro-batches
--------------------------
A global step takes `batch_size` samples, summed over ranks, from a seeded permutation of
all samples (a fresh one each epoch, seeded `seed + epoch`). With gradient accumulation
(`grad_accum_steps` N > 1) the step's samples are cut into N consecutive slices of
M = batch_size / N, one per forward and backward; rank r takes rows [r*m, (r+1)*m) of each
slice, m = M / world_size. The data order therefore depends on the seed alone, not on the
world size nor on N: the ranks' rows, concatenated in rank order, are the single-process
micro-batch, and the micro-batches, concatenated, are the step's batch. An epoch is
`num_samples // batch_size` whole steps; the few samples left over are skipped, different
ones each epoch.

    step of 8 samples, N = 2, world 2:   s0 s1 s2 s3 | s4 s5 s6 s7
    micro-batch 0                        rank 0: s0 s1   rank 1: s2 s3
    micro-batch 1                        rank 0: s4 s5   rank 1: s6 s7

Held-out data
-------------
`eval_fraction` holds out whole documents or conversations, before packing: that share of
the records (rounded, at least one), a fixed draw (seed EVAL_SPLIT_SEED) that depends on the
data alone, not on the run's seed, the world size or the batch size, so evaluations compare
across runs. They pack into a stream of their own, never trained on; the training stream is
the other records in their order, so with nothing held out the training batches are exactly
those of a run without evaluation. The held-out stream keeps its short remainder: it is
padded (padding is never a target) to whole global micro-batches, so every held-out target is
scored and every rank runs the same number of evaluation forwards.
"""

import sys
from dataclasses import dataclass

import datasets
import pyarrow as pa
import pyarrow.compute as pc
import torch

from te_mixtral.config import DataConfig
from te_mixtral.data.cache_key import map_fingerprint
from te_mixtral.data.cache_writes import writing_cache
from te_mixtral.data.formats import FORMATS
from te_mixtral.data.sources import load_records
from te_mixtral.data.tokenizer import Tokenizer
from te_mixtral.errors import UserError
from te_mixtral.model.layers import PackedSequences

EVAL_SPLIT_SEED = 20240601  # fixed: the held-out records must not move with the run's seed


@dataclass
class Batch:
    """One rank's share of a global micro-batch, packed (see the module docstring)."""

    input_ids: torch.Tensor  # int64 [B, S]
    labels: torch.Tensor  # int64 [B, S], -100 where there is no loss
    packed: PackedSequences  # where the documents are: position ids, cu_seqlens, max_seqlen

    def to(self, device) -> "Batch":
        return Batch(self.input_ids.to(device, non_blocking=True), self.labels.to(device, non_blocking=True),
                     self.packed.to(device))

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()


# Part of the cache key of tokenized data sets: change it whenever tokenization changes, so
# `datasets` does not hand back token ids made the old way.
TOKENIZE_RECIPE = "tokenize-1"


@dataclass
class TokenStream:
    """Every record's tokens, end to end, n of them: `tokens` int64 [n]; `ends` bool [n], the
    last token of each document or conversation; `trained` bool [n], whether a token is a loss
    target (False: its label is -100), or None when every token is (text); `lengths` int64,
    one per record, the tokens of each record."""

    tokens: torch.Tensor
    ends: torch.Tensor
    trained: torch.Tensor | None
    lengths: torch.Tensor

    def records(self, keep_R: torch.Tensor) -> "TokenStream":
        """The records where `keep_R` (bool [R]) is set, end to end in their order."""
        keep = keep_R.repeat_interleave(self.lengths)
        return TokenStream(self.tokens[keep], self.ends[keep], None if self.trained is None else self.trained[keep],
                           self.lengths[keep_R])

    def num_targets(self) -> int:
        """The loss targets of the stream read end to end: each token but the first, unless
        the one before it ends a record or it is not trained."""
        trained = torch.ones_like(self.ends) if self.trained is None else self.trained
        return int((trained[1:] & ~self.ends[:-1]).sum())

    def padded(self, length: int, eos_id: int) -> "TokenStream":
        """The stream made `length` tokens long with eos tokens that are never targets (one
        record of padding)."""
        pad = length - len(self.tokens)
        trained = torch.ones_like(self.ends) if self.trained is None else self.trained
        ends = torch.zeros(pad, dtype=torch.bool)
        ends[-1:] = True
        return TokenStream(torch.cat([self.tokens, torch.full((pad,), eos_id)]), torch.cat([self.ends, ends]),
                           torch.cat([trained, torch.zeros(pad, dtype=torch.bool)]),
                           torch.cat([self.lengths, torch.tensor([pad])]))


def _numpy(column: pa.Array | pa.ChunkedArray) -> torch.Tensor:
    # A copy: arrow's buffers are read-only, and torch wants to own what it may write.
    return torch.from_numpy(column.to_numpy(zero_copy_only=False).copy())


def _flat(column: pa.ChunkedArray) -> torch.Tensor:
    """A list column's values, end to end."""
    return _numpy(pa.concat_arrays([chunk.flatten() for chunk in column.chunks]))


def token_stream(tokenizer: Tokenizer, records: datasets.Dataset, fmt) -> TokenStream:
    """Tokenize the records (one column, which `fmt`, a `formats.FORMATS` entry, reads) with
    `datasets.map`, batched. Records read from files are cached by `datasets` beside them,
    keyed by the records and the tokenizer (its JSON, eos and what else the format depends
    on: chat's template), so a second run or a second rank reads the token ids back
    instead of tokenizing again.

    Text documents are each closed by eos, and an eos is a document edge, as always; a
    conversation's edges are its length (a multi-turn conversation holds an eos per reply)
    and it is closed by eos only if its template does not end it with one."""
    (field,) = records.column_names

    def tokenize(batch, indices):
        ids, trained = fmt.encode(tokenizer, batch, indices)
        return {"input_ids": ids} if trained is None else {"input_ids": ids, "trained": trained}
    key = map_fingerprint(TOKENIZE_RECIPE, records, tokenizer.backend.to_str(), str(tokenizer.eos_id),
                          fmt.cache_key(tokenizer))  # not `datasets`' hash of `tokenize` (cache_key.py)
    encoded = records.map(tokenize, batched=True, input_columns=field, with_indices=True,
                          remove_columns=[field], new_fingerprint=key, desc="tokenizing")
    tokens = _flat(encoded.data.column("input_ids")).to(torch.int64)
    lengths = _numpy(pc.list_value_length(encoded.data.column("input_ids"))).to(torch.int64)
    if not fmt.masked:
        return TokenStream(tokens, tokens == tokenizer.eos_id, None, lengths)
    ends = torch.zeros_like(tokens, dtype=torch.bool)
    ends[lengths.cumsum(0) - 1] = True
    return TokenStream(tokens, ends, _flat(encoded.data.column("trained")).to(torch.bool), lengths)


def batch_from_windows(windows: torch.Tensor, eos_id: int) -> Batch:
    """Turn windows of a text stream, int64 [B, S+1], into a packed `Batch` of B samples of
    S tokens, each eos a document edge."""
    return packed_batch(windows, windows == eos_id)


def packed_batch(windows: torch.Tensor, ends: torch.Tensor, trained: torch.Tensor | None = None) -> Batch:
    """Turn stream windows, int64 [B, S+1], into a packed `Batch` of B samples of S tokens.
    `ends`, bool [B, S+1], marks the last token of each document; `trained`, bool [B, S+1]
    or None (all), the tokens that are loss targets."""
    input_ids, labels = windows[:, :-1], windows[:, 1:].clone()
    is_end = ends[:, :-1]
    labels[is_end] = -100  # the next token belongs to another document
    if trained is not None:
        labels[~trained[:, 1:]] = -100

    B, S = input_ids.shape
    starts = torch.zeros_like(is_end)
    starts[:, 0] = True  # a sample edge is a document start too
    starts[:, 1:] = is_end[:, :-1]
    column = torch.arange(S).expand(B, S)
    # Each position minus the column of the latest document start at or before it.
    last_start = torch.where(starts, column, 0).cummax(dim=1).values
    position_ids = column - last_start

    start_offsets = starts.flatten().nonzero().flatten()
    cu_seqlens = torch.cat([start_offsets, torch.tensor([B * S])]).to(torch.int32)
    max_seqlen = int(cu_seqlens.diff().max())
    return Batch(input_ids, labels, PackedSequences(position_ids, cu_seqlens, max_seqlen))


def held_out_records(num_records: int, eval_fraction: float, unit: str = "records") -> torch.Tensor:
    """bool [R]: the records held out for evaluation (module docstring, "Held-out data"):
    `eval_fraction` of them, rounded, at least one; none when it is 0. `unit` names the
    records in a refusal (documents, conversations)."""
    held = torch.zeros(num_records, dtype=torch.bool)
    if eval_fraction == 0:
        return held
    num_eval = max(1, round(eval_fraction * num_records))
    if num_eval >= num_records:
        raise UserError(f"data.eval_fraction {eval_fraction} of {num_records} {unit} leaves none to train on: "
                        f"lower it, or use more data")
    held[torch.randperm(num_records, generator=torch.Generator().manual_seed(EVAL_SPLIT_SEED))[:num_eval]] = True
    return held


class PackedData:
    """The packed samples of a data set and this rank's share of each global step, in
    `grad_accum_steps` micro-batches (`batch_size` must divide by `world_size * grad_accum_steps`).

    Loads the records, the tokenizer (`self.tokenizer`; its `vocab_size` bounds the
    model's) and encodes everything once, up front (`self.stream`).
    """

    def __init__(self, cfg: DataConfig, batch_size: int, rank: int, world_size: int, seed: int,
                 grad_accum_steps: int = 1):
        if not sys.stderr.isatty():
            # In a log file or a pipe each redraw of `datasets`' bars is one more line of noise.
            datasets.disable_progress_bars()
        fmt = FORMATS[cfg.format]
        with writing_cache():  # `datasets` caches what it reads and maps
            records = load_records(cfg)
            self.tokenizer = fmt.tokenizer(cfg, records)
            stream = token_stream(self.tokenizer, records, fmt)
        unit = fmt.unit
        held = held_out_records(len(stream.lengths), cfg.eval_fraction, unit)
        self.stream = stream.records(~held)
        if self.stream.trained is not None and not self.stream.trained.any():
            raise fmt.nothing_to_train(cfg)
        self.seq_len = cfg.seq_len
        self.num_samples = (len(self.stream.tokens) - 1) // cfg.seq_len
        self.train_samples = self._samples_with_targets()
        if len(self.train_samples) < batch_size:
            held_out = f", {int(held.sum())} {unit} held out" if held.any() else ""
            skipped = fmt.skipped_note(self.num_samples - len(self.train_samples))
            raise UserError(
                f"data set '{cfg.dataset}' packs into {self.num_samples} samples of {cfg.seq_len} tokens "
                f"({len(self.train_samples)} to train on{held_out}{skipped}), but one global batch needs "
                f"{batch_size}: use more data, a shorter data.seq_len or a smaller train.batch_size"
            )
        self.batch_size = batch_size
        self.grad_accum_steps = grad_accum_steps
        self.micro_batch_size = batch_size // grad_accum_steps  # global: summed over ranks
        held_stream = stream.records(held)
        if held.any() and held_stream.num_targets() == 0:  # evaluation would divide 0 by 0
            raise UserError(f"the {int(held.sum())} {unit} held out by data.eval_fraction {cfg.eval_fraction} hold no "
                            f"target token{' (no assistant reply)' if fmt.masked else ''}, so evaluation "
                            f"would score nothing: raise data.eval_fraction or use other data")
        self.eval_stream, self.eval_samples = self._held_out(held_stream, self.tokenizer.eos_id)
        self.local_batch_size = self.micro_batch_size // world_size  # one rank's rows of one forward
        self.rank = rank
        self.seed = seed
        self.steps_per_epoch = len(self.train_samples) // batch_size
        self._epoch, self._order = -1, None

    def _held_out(self, stream: TokenStream, eos_id: int) -> tuple[TokenStream, torch.Tensor]:
        """The held-out stream padded to whole global micro-batches of samples, and its samples."""
        if len(stream.tokens) == 0:
            return stream, torch.arange(0)
        rows = -(-(len(stream.tokens) - 1) // self.seq_len)  # every token scored: the remainder too
        rows = max(1, -(-rows // self.micro_batch_size)) * self.micro_batch_size
        return stream.padded(rows * self.seq_len + 1, eos_id), torch.arange(rows)

    def _window_indices(self, samples: torch.Tensor) -> torch.Tensor:
        """Stream indices of the samples' windows, int64 [B, S+1]."""
        return samples[:, None] * self.seq_len + torch.arange(self.seq_len + 1)

    def _samples_with_targets(self) -> torch.Tensor:
        """The samples with at least one loss target: all of them for text, whose only
        untrained labels are document edges."""
        samples = torch.arange(self.num_samples)
        if self.stream.trained is None:
            return samples
        window = self._window_indices(samples)
        has_target = (self.stream.trained[window[:, 1:]] & ~self.stream.ends[window[:, :-1]]).any(dim=1)
        return samples[has_target]

    def _order_of(self, epoch: int) -> torch.Tensor:
        if epoch != self._epoch:
            generator = torch.Generator().manual_seed(self.seed + epoch)
            order = torch.randperm(len(self.train_samples), generator=generator)
            self._epoch, self._order = epoch, self.train_samples[order]
        return self._order

    def _rows(self, stream: TokenStream, samples: torch.Tensor) -> Batch:
        window = self._window_indices(samples)
        return packed_batch(stream.tokens[window], stream.ends[window],
                            None if stream.trained is None else stream.trained[window])

    def _rank_rows(self, samples: torch.Tensor, first: int, stream: TokenStream | None = None) -> Batch:
        """This rank's rows of the global (micro-)batch that starts at `samples[first]`, of
        `stream` (the training stream by default)."""
        first += self.rank * self.local_batch_size
        return self._rows(self.stream if stream is None else stream, samples[first : first + self.local_batch_size])

    def eval_batches(self) -> list[Batch]:
        """This rank's rows of the held-out samples, one global micro-batch at a time (no
        forward is larger than a training one), sharded like training batches (so every rank
        of an EP group runs the same number of forwards)."""
        return [self._rank_rows(self.eval_samples, start, self.eval_stream)
                for start in range(0, len(self.eval_samples), self.micro_batch_size)]

    def micro_batches(self, step: int) -> list[Batch]:
        """This rank's rows of global step `step` (0-based; any step, epochs repeat), one
        `Batch` per micro-batch, in order."""
        epoch, step_in_epoch = divmod(step, self.steps_per_epoch)
        first = step_in_epoch * self.batch_size
        return [self._rank_rows(self._order_of(epoch), first + i * self.micro_batch_size)
                for i in range(self.grad_accum_steps)]

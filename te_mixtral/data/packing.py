"""Documents in, packed batches out: loading, a tokenizer, packing and sharding.

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

Example, S = 6, `|` an eos::

    stream     a b c | d e f g | h i ...
    sample 0   a b c | d e         positions 0 1 2 3 0 1   labels b c | -100 e f
    sample 1   f g | h i ...       positions 0 1 2 0 1 ...

Windows overlap by one token: sample i reads stream tokens [i*S, i*S + S] (S + 1 of them:
S inputs, and the last one is only a label), so the last label of a sample is the first
input of the next. Every stream token after the first is then a target exactly once and
nothing is thrown away but the short remainder at the end.

Sharding
--------
A global step takes `batch_size` samples, summed over ranks, from a seeded permutation of
all samples (a fresh one each epoch, seeded `seed + epoch`); rank r takes rows
[r*b, (r+1)*b) with b = batch_size / world_size. The data order therefore depends on the
seed alone, not on the world size: the ranks' rows, concatenated in rank order, are the
single-process batch. An epoch is `num_samples // batch_size` whole steps; the few samples
left over are skipped, different ones each epoch.

Pitfall: the tokenizer trained here (when no tokenizer is given) is cached on disk, keyed
by the documents and the vocabulary size. Several ranks may train it at once on a cold
cache; that is safe because training is deterministic and the file is written atomically.
"""

import hashlib
import itertools
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import datasets
import tokenizers
import torch

from te_mixtral.config import DataConfig
from te_mixtral.errors import UserError

LOCAL_BUILDERS = {".json": "json", ".jsonl": "json", ".txt": "text"}
EOS_CANDIDATES = ("</s>", "<eos>", "<|endoftext|>")
# Part of the tokenizer cache key: change it whenever the training recipe changes, so an
# old cached tokenizer is not mistaken for a new one.
TOKENIZER_RECIPE = "byte-level-bpe-1"
EVAL_SPLIT_SEED = 20240601  # fixed: the held-out samples must not move with the run's seed


@dataclass
class Batch:
    """One rank's share of a global step, packed (see the module docstring)."""

    input_ids: torch.Tensor  # int64 [B, S]
    labels: torch.Tensor  # int64 [B, S], -100 where there is no loss
    position_ids: torch.Tensor  # int64 [B, S], 0 at each document start
    cu_seqlens: torch.Tensor  # int32 [num_segments + 1], over the flattened B*S tokens
    max_seqlen: int  # longest segment

    def to(self, device) -> "Batch":
        return Batch(
            self.input_ids.to(device, non_blocking=True),
            self.labels.to(device, non_blocking=True),
            self.position_ids.to(device, non_blocking=True),
            self.cu_seqlens.to(device, non_blocking=True),
            self.max_seqlen,
        )

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()


# --- documents --------------------------------------------------------------------------


def _embedded_dataset(text_field: str) -> datasets.Dataset:
    # pydoc's help topics: ~0.5 MB of English prose shipped with every Python, so the default
    # run needs no network and no download. One topic is one document.
    from pydoc_data.topics import topics

    return datasets.Dataset.from_dict({text_field: [topics[name] for name in sorted(topics)]})


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _local_datasets(path: Path) -> list[datasets.Dataset]:
    """A file, or every .json/.jsonl/.txt file directly inside a folder (in name order)."""
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix in LOCAL_BUILDERS)
        if not files:
            raise UserError(f"folder {path} holds no {'/'.join(LOCAL_BUILDERS)} files")
    elif path.suffix in LOCAL_BUILDERS:
        files = [path]
    else:
        raise UserError(f"cannot read {path}: data files must end in {', '.join(LOCAL_BUILDERS)}")
    loaded = []
    # json and text files need different builders, so each run of same-kind files is one call.
    for builder, run in itertools.groupby(files, key=lambda p: LOCAL_BUILDERS[p.suffix]):
        names = [str(p) for p in run]
        try:
            # Local files all land in the "train" split, whatever `data.split` says.
            loaded.append(datasets.load_dataset(builder, data_files=names, split="train"))
        except Exception as e:
            raise UserError(f"cannot read {', '.join(names)}: {_first_line(e)}") from None
    return loaded


def _hub_dataset(name: str, split: str) -> datasets.Dataset:
    # Without a network the hub client retries for ~20 s before giving up;
    # HF_HUB_OFFLINE=1 makes it fail at once.
    try:
        return datasets.load_dataset(name, split=split)
    except Exception as e:
        raise UserError(
            f"could not load data set '{name}' (split '{split}') from the Hugging Face hub: {_first_line(e)}; "
            f"offline, use data.dataset=embedded or a local .json/.jsonl/.txt file or folder"
        ) from None


def _is_local(name: str) -> bool:
    # Hub names look like paths ("owner/name"), so a name is local only if it exists, has a
    # data-file suffix, or is plainly a path; a typo in a local path must not go to the hub.
    return Path(name).expanduser().exists() or Path(name).suffix in LOCAL_BUILDERS or name.startswith(("/", ".", "~"))


def load_documents(cfg: DataConfig) -> list[str]:
    """The data set's documents in their stored order: non-empty texts, the first
    `max_documents` of them. Empty texts (blank lines of a .txt file) are skipped."""
    if cfg.dataset == "embedded":
        sources = [_embedded_dataset(cfg.text_field)]
    elif _is_local(cfg.dataset):
        path = Path(cfg.dataset).expanduser()
        if not path.exists():
            raise UserError(f"data set path {cfg.dataset} does not exist")
        sources = _local_datasets(path)
    else:
        sources = [_hub_dataset(cfg.dataset, cfg.split)]

    for source in sources:
        if cfg.text_field not in source.column_names:
            raise UserError(
                f"data set '{cfg.dataset}' has no field '{cfg.text_field}' (fields: {', '.join(source.column_names)}); "
                f"set data.text_field"
            )
        if getattr(source.features[cfg.text_field], "dtype", None) not in ("string", "large_string"):
            raise UserError(f"field '{cfg.text_field}' of data set '{cfg.dataset}' does not hold text")
    texts = (text for source in sources for text in source[cfg.text_field] if text and text.strip())
    documents = list(itertools.islice(texts, cfg.max_documents))
    if not documents:
        raise UserError(f"data set '{cfg.dataset}' has no non-empty '{cfg.text_field}' documents")
    return documents


# --- tokenizer --------------------------------------------------------------------------


@dataclass
class Tokenizer:
    """A `tokenizers.Tokenizer` and the id of the eos token that closes every document."""

    backend: tokenizers.Tokenizer
    eos_id: int

    @classmethod
    def wrap(cls, backend: tokenizers.Tokenizer, where: str) -> "Tokenizer":
        for token in EOS_CANDIDATES:
            if (eos_id := backend.token_to_id(token)) is not None:
                return cls(backend, eos_id)
        raise UserError(f"tokenizer {where} has none of the eos tokens {', '.join(EOS_CANDIDATES)}")

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        # The tokenizer's own special-token template applies: a Mixtral checkpoint's tokenizer
        # opens each document with its <s> (as in pretraining); the one trained here adds none.
        return [encoding.ids for encoding in self.backend.encode_batch(texts)]


def cache_dir() -> Path:
    return Path(os.environ.get("TE_MIXTRAL_CACHE") or "~/.cache/te_mixtral").expanduser()


def train_tokenizer(documents: list[str], vocab_size: int) -> tokenizers.Tokenizer:
    """A byte-level BPE with an <eos> special token. Byte level means any text encodes
    (no unknown token). The trainer breaks ties between equally frequent merges by the pair
    itself, so the same documents always give the same tokenizer, in any process."""
    backend = tokenizers.Tokenizer(tokenizers.models.BPE())
    backend.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<eos>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(documents, trainer)
    return backend


def _cache_key(documents: list[str], vocab_size: int) -> str:
    content = hashlib.sha256()
    for doc in documents:
        data = doc.encode()
        # The length prefix keeps ["ab", "c"] and ["a", "bc"] apart.
        content.update(len(data).to_bytes(8, "little") + data)
    return hashlib.sha256(f"{TOKENIZER_RECIPE}:{content.hexdigest()}:{vocab_size}".encode()).hexdigest()[:20]


def _cached_tokenizer(documents: list[str], vocab_size: int) -> tokenizers.Tokenizer:
    path = cache_dir() / f"tokenizer-{_cache_key(documents, vocab_size)}.json"
    if path.exists():
        return tokenizers.Tokenizer.from_file(str(path))
    backend = train_tokenizer(documents, vocab_size)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # Ranks may race on a cold cache: each writes its own temporary file and renames it
        # into place, so a reader sees either no file or a whole one.
        with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as tmp:
            tmp.write(backend.to_str())
        os.replace(tmp.name, path)
    except OSError as e:
        raise UserError(
            f"cannot write the tokenizer cache {path.parent} ({e.strerror}); set TE_MIXTRAL_CACHE"
        ) from None
    return backend


def load_tokenizer(cfg: DataConfig, documents: list[str]) -> Tokenizer:
    """`cfg.tokenizer` (a tokenizer.json, or a folder holding one such as a Hugging Face
    checkpoint), or else a BPE trained on `documents` and cached."""
    if cfg.tokenizer is None:
        return Tokenizer.wrap(_cached_tokenizer(documents, cfg.tokenizer_vocab_size), "trained on the data")
    path = Path(cfg.tokenizer).expanduser()
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise UserError(f"tokenizer file {path} does not exist")
    try:
        backend = tokenizers.Tokenizer.from_file(str(path))
    except Exception as e:
        raise UserError(f"cannot read tokenizer {path}: {_first_line(e)}") from None
    return Tokenizer.wrap(backend, str(path))


# --- packing and sharding ---------------------------------------------------------------


def token_stream(tokenizer: Tokenizer, documents: list[str]) -> torch.Tensor:
    """All documents, each closed by eos, end to end: int64 [N]."""
    ids = tokenizer.encode_batch(documents)
    closed = (doc if doc and doc[-1] == tokenizer.eos_id else doc + [tokenizer.eos_id] for doc in ids)
    return torch.tensor(list(itertools.chain.from_iterable(closed)), dtype=torch.int64)


def batch_from_windows(windows: torch.Tensor, eos_id: int) -> Batch:
    """Turn stream windows, int64 [B, S+1], into a packed `Batch` of B samples of S tokens."""
    input_ids, labels = windows[:, :-1], windows[:, 1:].clone()
    is_eos = input_ids == eos_id
    labels[is_eos] = -100  # the next token belongs to another document

    B, S = input_ids.shape
    starts = torch.zeros_like(is_eos)
    starts[:, 0] = True  # a sample edge is a document start too
    starts[:, 1:] = is_eos[:, :-1]
    column = torch.arange(S).expand(B, S)
    # Each position minus the column of the latest document start at or before it.
    last_start = torch.where(starts, column, 0).cummax(dim=1).values
    position_ids = column - last_start

    start_offsets = starts.flatten().nonzero().flatten()
    cu_seqlens = torch.cat([start_offsets, torch.tensor([B * S])]).to(torch.int32)
    max_seqlen = int(cu_seqlens.diff().max())
    return Batch(input_ids, labels, position_ids, cu_seqlens, max_seqlen)


def held_out_split(num_samples: int, eval_fraction: float, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(training samples, held-out samples), each sorted.

    The held-out samples are a fixed draw (seed EVAL_SPLIT_SEED, not the run's seed) of
    `eval_fraction` of all samples, rounded down to whole global batches: the same samples
    for every seed and every world size, so evaluations compare across runs. With nothing
    held out the training samples are all of them, in their natural order, and training
    batches are exactly those of a run without evaluation.
    """
    num_eval = int(eval_fraction * num_samples) // batch_size * batch_size
    if eval_fraction > 0 and num_eval == 0:
        raise UserError(f"data.eval_fraction {eval_fraction} of {num_samples} samples is less than one global batch "
                        f"({batch_size}): raise it, or use more data")
    if num_eval == 0:
        return torch.arange(num_samples), torch.arange(0)
    order = torch.randperm(num_samples, generator=torch.Generator().manual_seed(EVAL_SPLIT_SEED))
    return order[num_eval:].sort().values, order[:num_eval].sort().values


class PackedData:
    """The packed samples of a data set and this rank's share of each global step.

    Loads the documents, the tokenizer (`self.tokenizer`; its `vocab_size` bounds the
    model's) and encodes everything once, up front.
    """

    def __init__(self, cfg: DataConfig, batch_size: int, rank: int, world_size: int, seed: int):
        documents = load_documents(cfg)
        self.tokenizer = load_tokenizer(cfg, documents)
        self.tokens = token_stream(self.tokenizer, documents)
        self.seq_len = cfg.seq_len
        self.num_samples = (len(self.tokens) - 1) // cfg.seq_len
        self.train_samples, self.eval_samples = held_out_split(self.num_samples, cfg.eval_fraction, batch_size)
        if len(self.train_samples) < batch_size:
            raise UserError(
                f"data set '{cfg.dataset}' packs into {self.num_samples} samples of {cfg.seq_len} tokens "
                f"({len(self.eval_samples)} held out), but one global batch needs {batch_size}: use more data, "
                f"a shorter data.seq_len or a smaller train.batch_size"
            )
        self.batch_size = batch_size
        self.local_batch_size = batch_size // world_size
        self.rank = rank
        self.seed = seed
        self.steps_per_epoch = len(self.train_samples) // batch_size
        self._epoch, self._order = -1, None

    def _order_of(self, epoch: int) -> torch.Tensor:
        if epoch != self._epoch:
            generator = torch.Generator().manual_seed(self.seed + epoch)
            order = torch.randperm(len(self.train_samples), generator=generator)
            self._epoch, self._order = epoch, self.train_samples[order]
        return self._order

    def _rows(self, samples: torch.Tensor) -> Batch:
        windows = self.tokens[samples[:, None] * self.seq_len + torch.arange(self.seq_len + 1)]
        return batch_from_windows(windows, self.tokenizer.eos_id)

    def eval_batches(self) -> list[Batch]:
        """This rank's rows of the held-out samples, one global batch at a time, sharded like
        training batches (so every rank of an EP group runs the same number of forwards)."""
        first = self.rank * self.local_batch_size
        return [self._rows(self.eval_samples[start + first : start + first + self.local_batch_size])
                for start in range(0, len(self.eval_samples), self.batch_size)]

    def batch(self, step: int) -> Batch:
        """This rank's rows of global step `step` (0-based; any step, epochs repeat)."""
        epoch, step_in_epoch = divmod(step, self.steps_per_epoch)
        first = step_in_epoch * self.batch_size + self.rank * self.local_batch_size
        return self._rows(self._order_of(epoch)[first : first + self.local_batch_size])

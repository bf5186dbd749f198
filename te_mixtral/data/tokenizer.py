"""The tokenizer: a Hugging Face checkpoint's, a given tokenizer.json, or one trained here.

Every document is closed with an end of sequence token (eos) before packing, so whichever
tokenizer is used must have one (`EOS_CANDIDATES`, first match wins).

Chat data (`data.format: chat`) needs the tokenizer's chat template as well, so there the
tokenizer is a folder read with `transformers.AutoTokenizer` (te_mixtral/data/formats.py), and
its eos is the one that folder names.

Without `data.tokenizer`, a byte-level BPE is trained on the run's documents and cached on
disk (`$TE_MIXTRAL_CACHE`, default ~/.cache/te_mixtral), keyed by the documents, the
vocabulary size and `TOKENIZER_RECIPE`. Training is deterministic, so every rank, and
every later run on the same documents, gets the same tokenizer.

Pitfall: several ranks may train it at once on a cold cache; that is safe because training
is deterministic and the file is written atomically. A cached file that no longer loads is
trained again and replaced, the same way.
"""

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tokenizers

from te_mixtral.config import DataConfig
from te_mixtral.errors import UserError, first_line
from te_mixtral.files import require_regular_file, write_text_atomic

EOS_CANDIDATES = ("</s>", "<eos>", "<|endoftext|>")
# Part of the tokenizer cache key: change it whenever the training recipe changes, so an
# old cached tokenizer is not mistaken for a new one.
TOKENIZER_RECIPE = "byte-level-bpe-1"


@dataclass
class Tokenizer:
    """A `tokenizers.Tokenizer` and the id of the eos token that closes every document;
    for chat data, `chat` is the transformers tokenizer (over the same backend) whose chat
    template renders the conversations."""

    backend: tokenizers.Tokenizer
    eos_id: int
    chat: Any = None  # transformers.PreTrainedTokenizerBase; transformers is imported only for chat data

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


def _read_cached(path: Path) -> tokenizers.Tokenizer | None:
    """The cached tokenizer at `path`, or None when the file is damaged (a disk error, an
    edit, a copy cut short): the cache can always be rebuilt, so a bad entry must not fail
    every later run. One that loads but lacks the eos token that training adds is damaged too."""
    try:
        backend = tokenizers.Tokenizer.from_file(str(path))
    except Exception:  # the tokenizers library raises a bare Exception for a malformed file
        return None
    return backend if backend.token_to_id("<eos>") is not None else None


def _cached_tokenizer(documents: list[str], vocab_size: int) -> tokenizers.Tokenizer:
    path = cache_dir() / f"tokenizer-{_cache_key(documents, vocab_size)}.json"
    if path.exists():
        if (cached := _read_cached(path)) is not None:
            return cached
        print(f"te_mixtral: note: the cached tokenizer {path} is corrupt; training it again", flush=True)
    backend = train_tokenizer(documents, vocab_size)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # Ranks may race on a cold cache: each writes its own temporary file and renames it
        # into place, so a reader sees either no file or a whole one.
        write_text_atomic(path, backend.to_str())
    except OSError as e:
        raise UserError(
            f"cannot write the tokenizer cache {path.parent} ({e.strerror}); set TE_MIXTRAL_CACHE"
        ) from None
    return backend


def load_tokenizer(cfg: DataConfig, documents: list[str]) -> Tokenizer:
    """`cfg.tokenizer` (a tokenizer.json, or a folder holding one such as a Hugging Face
    checkpoint), or else a BPE trained on `documents` and cached: text data's tokenizer
    (chat data's is a folder with a chat template: te_mixtral/data/formats.py)."""
    if cfg.tokenizer is None:
        return Tokenizer.wrap(_cached_tokenizer(documents, cfg.tokenizer_vocab_size), "trained on the data")
    path = Path(cfg.tokenizer)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.exists():
        raise UserError(f"tokenizer file {path} does not exist")
    require_regular_file(path, "tokenizer file")
    try:
        backend = tokenizers.Tokenizer.from_file(str(path))
    except Exception as e:
        raise UserError(f"cannot read tokenizer {path}: {first_line(e)}") from None
    return Tokenizer.wrap(backend, str(path))

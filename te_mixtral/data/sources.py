"""Where the records come from: the embedded corpus, local files, or the Hugging Face hub.

`data.dataset` names one of three sources, and each gives a `datasets.Dataset` of records,
of which one field is read: `data.text_field` (a text document) or, for chat data,
`data.messages_field` (a conversation, te_mixtral/data/chat.py):

- `embedded`: pydoc's help topics, ~0.5 MB of English prose shipped with every Python, so
  the default run needs no network and no download;
- a local path: one .json/.jsonl/.txt file, or a folder of them (read in name order; its
  hidden files, as `datasets` skips them, and subfolders are not); a .txt file gives one
  document per non-empty line;
- anything else: a data set on the Hugging Face hub, `data.subset` and `data.split` of it.

`datasets` writes every data set it reads, local files too, into its cache (HF_DATASETS_CACHE,
by default HF_HOME/datasets), and takes a lock file there even to read a copy it cached
before: a cache it cannot write is refused first, by name (`_check_cache`), not as the data
file or the hub it would otherwise be blamed on.

`data.split` picks records with `datasets`' split syntax (`train`, `test`, `train[:90%]`,
`train[100:200]+train[-50:]`). Local files and the embedded corpus hold one split, `train`,
which may be sliced the same way; any other split name is refused, not silently read as
`train`.

Pitfall: hub names look like paths ("owner/name"), so a name counts as local only when it
exists, has a data-file suffix, or is plainly a path (`local_or_hub.is_hub_dataset`); a typo in a
local path must not turn into a hub download.
"""

import codecs
import itertools
from pathlib import Path

import datasets
import pyarrow as pa

from te_mixtral.config import DataConfig
from te_mixtral.data.cache_writes import cache_write_failure
from te_mixtral.data.formats import FORMATS
from te_mixtral.errors import UserError, first_line
from te_mixtral.files import check_writable, require_regular_file
from te_mixtral.local_or_hub import LOCAL_DATA_BUILDERS, hub_unreachable, is_hub_dataset


def _embedded_dataset(text_field: str) -> datasets.Dataset:
    # pydoc's help topics: ~0.5 MB of English prose shipped with every Python, so the default
    # run needs no network and no download. One topic is one document.
    from pydoc_data.topics import topics

    return datasets.Dataset.from_dict({text_field: [topics[name] for name in sorted(topics)]})


def _local_datasets(path: Path) -> list[datasets.Dataset]:
    """A file, or every .json/.jsonl/.txt file directly inside a folder (in name order) but
    hidden ones: an editor's backup, macOS's binary `._` twins."""
    if path.is_dir():
        files = sorted(p for p in path.iterdir()
                       if p.suffix in LOCAL_DATA_BUILDERS and p.is_file() and not p.name.startswith("."))
        if not files:
            raise UserError(f"folder {path} holds no {'/'.join(LOCAL_DATA_BUILDERS)} files")
    elif path.suffix in LOCAL_DATA_BUILDERS:
        require_regular_file(path, "data file")
        files = [path]
    else:
        raise UserError(f"cannot read {path}: data files must end in {', '.join(LOCAL_DATA_BUILDERS)}")
    for file in files:
        _check_text_file(file)
    # json and text files need different builders, so each run of same-kind files is one call.
    return [source for builder, run in itertools.groupby(files, key=lambda p: LOCAL_DATA_BUILDERS[p.suffix])
            for source in _load_files(builder, list(run))]


def _check_text_file(path: Path) -> None:
    """Refuse an empty or binary file before `datasets` reads it: its own error names
    neither the file nor the problem ("An error occurred while generating the dataset")."""
    try:
        with open(path, "rb") as f:
            head = f.read(1 << 16)
    except OSError as e:
        raise UserError(f"cannot read data file {path}: {e.strerror}") from None
    if not head.strip() and len(head) < (1 << 16):
        raise UserError(f"data file {path} is empty")
    try:
        # Incremental, so a character cut at the end of the sample is not an error.
        codecs.getincrementaldecoder("utf-8")().decode(head, final=False)
    except UnicodeDecodeError:
        raise UserError(f"data file {path} is not UTF-8 text (a binary file?)") from None
    if b"\0" in head:
        raise UserError(f"data file {path} holds NUL bytes: it is binary, not text")


def _cause(error: Exception) -> str:
    """What went wrong inside `datasets`: its own top error only says that something did,
    so report the first error it wraps, or that the file is not UTF-8 text."""
    chain, e = [], error
    while e is not None and len(chain) < 10:
        chain.append(e)
        e = e.__cause__ or e.__context__
    if any(isinstance(e, UnicodeDecodeError) or isinstance(e, pa.ArrowInvalid) and "UTF8" in str(e) for e in chain):
        return "not UTF-8 text"
    return first_line(chain[1] if isinstance(error, datasets.exceptions.DatasetGenerationError) and len(chain) > 1
                      else error)


def _load_files(builder: str, files: list[Path]) -> list[datasets.Dataset]:
    """The files as one source, or one each where they do not make one table (their fields
    differ: `load_records` reads one of them)."""
    try:
        # Local files all land in the "train" split; `_take_split` then slices the whole source.
        # utf-8-sig: a byte order mark (Notepad's UTF-8) is no text of the first line.
        source = datasets.load_dataset(builder, data_files=[str(p) for p in files], split="train",
                                       **({"encoding": "utf-8-sig"} if builder == "text" else {}))
        # pyarrow's JSON reader does not check UTF-8 (the text builder decodes in Python): a
        # bad byte past the head `_check_text_file` reads would fail wherever it is first read.
        source.data.validate(full=True)
        return [source]
    except Exception as e:
        if failure := cache_write_failure(e):  # the cache's fault, not the files'
            raise failure from None
        if len(files) > 1:  # the file at fault, loaded alone, raises naming itself; else they differ
            return [source for file in files for source in _load_files(builder, [file])]
        raise UserError(f"cannot read {', '.join(map(str, files))}: {_cause(e)}") from None


def _check_hub_reachable(name: str) -> None:
    """Refuse in one line, at once, where the hub cannot be reached (`hub_unreachable`): its
    client would retry for half a minute before failing."""
    if reason := hub_unreachable():
        raise UserError(f"data set '{name}' is no local path, and {reason}: use data.dataset=embedded or a local "
                        f".json/.jsonl/.txt file or folder, or set HF_HUB_OFFLINE=1 to read a copy already in the cache")


def _check_cache() -> None:
    """Refuse a `datasets` cache that cannot be written (the module docstring)."""
    try:
        check_writable(Path(datasets.config.HF_DATASETS_CACHE), "the datasets cache")
    except UserError as e:
        raise UserError(f"{e}; set HF_DATASETS_CACHE (or HF_HOME) to a folder you can write") from None


def _hub_dataset(name: str, subset: str | None, split: str) -> datasets.Dataset:
    try:
        return datasets.load_dataset(name, subset, split=split)
    except Exception as e:
        if failure := cache_write_failure(e):
            raise failure from None
        which = f"subset '{subset}', split '{split}'" if subset else f"split '{split}'"
        raise UserError(
            f"could not load data set '{name}' ({which}) from the Hugging Face hub: {first_line(e)}; "
            f"offline, use data.dataset=embedded or a local .json/.jsonl/.txt file or folder"
        ) from None


def _take_split(source: datasets.Dataset, split: str) -> datasets.Dataset:
    """`split` of a local or embedded source, whose records are all one 'train' split."""
    try:
        parts = datasets.ReadInstruction.from_spec(split).to_absolute({"train": len(source)})
    except (ValueError, AssertionError) as e:
        raise UserError(f"data.split '{split}': {first_line(e).rstrip('.')}; local files and the embedded text are one 'train' "
                        f"split, which may be sliced (e.g. train[:90%], train[100:])") from None
    if [(p.from_, p.to) for p in parts] == [(0, len(source))]:
        return source  # all of it: no indices mapping, so the data stays as loaded
    return source.select([i for p in parts for i in range(p.from_, p.to)])


def check_source(cfg: DataConfig) -> None:
    """Refuse in one line a data set that is not there: a local path that does not exist, or a
    hub name where the hub cannot be reached. The training loop asks before it estimates or
    reads anything, so that this is the one line a run prints; `load_records` asks again."""
    if cfg.dataset == "embedded":
        return
    if not is_hub_dataset(cfg.dataset):
        if not Path(cfg.dataset).exists():
            raise UserError(f"data set path {cfg.dataset} does not exist")
    else:
        _check_hub_reachable(cfg.dataset)


def load_records(cfg: DataConfig) -> datasets.Dataset:
    """The data set's records in their stored order, `data.split` of them, as one column:
    the field that `data.format` reads (a chat layout's records turned into conversations). Texts that are empty or blank (blank lines of a .txt
    file) are skipped, a record without one is refused; then the first `max_documents` records are kept."""
    fmt = FORMATS[cfg.format]
    check_source(cfg)
    if cfg.dataset == "embedded":  # made in memory: no cache
        sources = [_embedded_dataset(cfg.text_field)]
    elif not is_hub_dataset(cfg.dataset):
        _check_cache()
        sources = _local_datasets(Path(cfg.dataset))
    else:
        _check_cache()
        sources = [_hub_dataset(cfg.dataset, cfg.subset, cfg.split)]

    for source in sources:
        for field in fmt.fields(cfg):
            if field not in source.column_names:
                raise UserError(
                    f"data set '{cfg.dataset}' has no field '{field}' (fields: {', '.join(source.column_names)}); "
                    f"{fmt.missing_field_advice(cfg, source.column_names)}")
    try:
        records = datasets.concatenate_datasets([fmt.records(cfg, source) for source in sources])
    except ValueError as e:  # files whose conversations differ in layout: a message's keys
        raise UserError(f"the files of data set '{cfg.dataset}' hold their records in layouts that cannot be read "
                        f"as one: {first_line(e)}") from None
    (field,) = records.column_names
    if not is_hub_dataset(cfg.dataset):  # the hub loader took the split itself
        all_records, records = len(records), _take_split(records, cfg.split)
        if len(records) == 0:
            raise UserError(f"data.split '{cfg.split}' selects none of the {all_records} records of data set "
                            f"'{cfg.dataset}'")
    records = fmt.without_empty(records, field)
    if cfg.max_documents is not None and cfg.max_documents < len(records):
        records = records.select(range(cfg.max_documents))
    if len(records) == 0:
        raise UserError(f"data set '{cfg.dataset}' has no non-empty '{field}' records")
    return records


def load_documents(cfg: DataConfig) -> list[str]:
    """The text documents of `load_records` (format text), as a list."""
    return load_records(cfg)[cfg.text_field]

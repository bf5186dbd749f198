"""Data: loading, the cached tokenizer, packing invariants and sharding.

Packing and sharding are checked on fresh random documents each run (the seed is printed,
so a failure can be replayed), against expectations computed here independently.
"""

import json
import random
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import datasets
import huggingface_hub
import pytest
import tokenizers
import torch

from te_mixtral.config import DataConfig
from te_mixtral.data import packing
from te_mixtral.data.packing import PackedData, batch_from_windows
from te_mixtral.data.sources import load_documents, load_records
from te_mixtral.data.tokenizer import load_tokenizer, train_tokenizer
from te_mixtral.errors import UserError


@pytest.fixture(autouse=True)
def tokenizer_cache(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("TE_MIXTRAL_CACHE", str(cache))
    return cache


@pytest.fixture
def rng():
    seed = random.randrange(2**32)
    print(f"random seed {seed}")
    return random.Random(seed)


def random_documents(rng, count: int) -> list[str]:
    """Short documents of made-up words: many document boundaries per sample."""
    words = ["".join(rng.choices("abcdefghij", k=rng.randint(1, 6))) for _ in range(40)]
    return [" ".join(rng.choices(words, k=rng.randint(1, 30))) for _ in range(count)]


def write_jsonl(path, documents, field="text"):
    path.write_text("".join(json.dumps({field: doc, "id": i}) + "\n" for i, doc in enumerate(documents)))
    return path


# --- documents --------------------------------------------------------------------------


def test_embedded_documents_are_real_prose_and_capped_in_order():
    documents = load_documents(DataConfig())
    assert len(documents) > 50
    assert sum(map(len, documents)) > 300_000
    assert all(isinstance(doc, str) and doc.strip() for doc in documents)
    assert load_documents(DataConfig(max_documents=7)) == documents[:7]


def test_local_jsonl_txt_and_folder(tmp_path, rng):
    jsonl_docs, txt_docs = random_documents(rng, 20), random_documents(rng, 15)
    folder = tmp_path / "corpus"
    folder.mkdir()
    write_jsonl(folder / "a.jsonl", jsonl_docs)
    # Blank and whitespace-only lines must not become documents.
    (folder / "b.txt").write_text("\n\n".join(txt_docs) + "\n   \n")
    (folder / "notes.md").write_text("not data")

    assert load_documents(DataConfig(dataset=str(folder / "a.jsonl"))) == jsonl_docs
    assert load_documents(DataConfig(dataset=str(folder / "b.txt"))) == txt_docs
    assert load_documents(DataConfig(dataset=str(folder))) == jsonl_docs + txt_docs
    assert load_documents(DataConfig(dataset=str(folder), max_documents=25)) == (jsonl_docs + txt_docs)[:25]


def test_a_folder_reads_its_visible_files_whatever_else_they_hold(tmp_path, rng):
    # Before: hidden files (an editor's backup, macOS's binary ._ files) were read as data,
    # and files with other fields beside the text failed with "Couldn't cast".
    folder = tmp_path / "corpus"
    folder.mkdir()
    docs = random_documents(rng, 20)
    write_jsonl(folder / "a.jsonl", docs[:10])  # text and id
    (folder / "b.jsonl").write_text("".join(json.dumps({"text": doc}) + "\n" for doc in docs[10:]))
    (folder / ".backup.jsonl").write_text(json.dumps({"text": "an old copy"}) + "\n")
    (folder / "._a.jsonl").write_bytes(b"\x00\x05\x16\x07\x00\x02\x00\x00Mac OS X")
    assert load_documents(DataConfig(dataset=str(folder))) == docs
    # Conversations whose messages differ in layout cannot be one column: one line, not a traceback.
    (folder / "b.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "hi", "name": "ann"}]}) + "\n")
    write_jsonl(folder / "a.jsonl", [[{"role": "user", "content": "hi"}]], field="messages")
    with pytest.raises(UserError, match="hold their records in layouts that cannot be read as one"):
        load_records(DataConfig(dataset=str(folder), format="chat", tokenizer="unused"))


def test_a_windows_text_file_reads_as_its_lines(tmp_path):
    # Notepad's UTF-8 starts with a byte order mark, which began the first document.
    (tmp_path / "w.txt").write_bytes("\ufeffone\r\ntwo\r\n".encode())
    assert load_documents(DataConfig(dataset=str(tmp_path / "w.txt"))) == ["one", "two"]


def test_user_errors_for_bad_data(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        load_documents(DataConfig(dataset=str(tmp_path / "missing.jsonl")))
    path = write_jsonl(tmp_path / "d.jsonl", ["hello"], field="content")
    with pytest.raises(UserError, match="no field 'text'.*content"):
        load_documents(DataConfig(dataset=str(path)))
    # A record without the field was skipped as if blank: the run trained on less than given.
    (tmp_path / "e.jsonl").write_text('{"text": "one"}\n{"txet": "two"}\n')
    with pytest.raises(UserError, match="record 1 has no 'text'"):
        load_documents(DataConfig(dataset=str(tmp_path / "e.jsonl")))
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="holds no"):
        load_documents(DataConfig(dataset=str(tmp_path / "empty")))


@pytest.mark.parametrize("name, content, message", [
    ("a.jsonl", b"", "is empty"),
    ("a.txt", b"  \n\n", "is empty"),
    ("a.txt", bytes(range(256)) * 4, "is not UTF-8 text"),
    ("a.jsonl", b'{"text": "caf\xe9"}\n', "is not UTF-8 text"),
    # Past the head that is checked before reading: pyarrow's JSON reader lets it through.
    ("a.jsonl", b'{"text": "fine"}\n' * 5000 + b'{"text": "caf\xe9"}\n', ": not UTF-8 text"),
    ("a.txt", b"text\x00with\x00NUL bytes", "holds NUL bytes"),
    ("a.jsonl", b'{"text": "one"}\n{"text": "two"\n', "Missing a comma"),
    ("a.json", b'[{"text": "one"}, ', "cannot read"),
], ids=["empty", "blank", "binary", "latin-1", "late-latin-1", "nul", "bad-jsonl", "bad-json"])
def test_a_bad_data_file_is_named_with_what_is_wrong(tmp_path, name, content, message):
    """Alone or among good files, the bad one is named: `datasets` itself says only "An error
    occurred while generating the dataset"."""
    folder = tmp_path / "corpus"
    folder.mkdir()
    write_jsonl(folder / "0-good.jsonl", ["fine"])
    write_jsonl(folder / "z-good.jsonl", ["fine too"])
    (folder / name).write_bytes(content)
    for dataset in (folder / name, folder):
        with pytest.raises(UserError) as info:
            load_documents(DataConfig(dataset=str(dataset)))
        error = str(info.value)
        assert f"{folder / name}" in error and message in error and "\n" not in error, error
        assert "0-good" not in error and "z-good" not in error and "An error occurred" not in error, error


@pytest.mark.parametrize("dataset", ["local", "someone/corpus"])
def test_a_datasets_cache_that_cannot_be_written_is_named_not_the_data(tmp_path, monkeypatch, dataset):
    # `datasets` writes every data set it reads into its cache, and locks it there even to read
    # a copy cached before. Before, a local file's refusal blamed the file ("cannot read
    # data.jsonl: [Errno 20] Not a directory: ..."), and a hub data set's the hub.
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(blocker / "datasets"))  # what HF_HOME=a_file sets
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    local = write_jsonl(tmp_path / "data.jsonl", ["one document", "and another"])
    with pytest.raises(UserError) as info:
        load_documents(DataConfig(dataset=str(local) if dataset == "local" else dataset))
    assert str(info.value) == (f"the datasets cache {blocker / 'datasets'} cannot be made: {blocker} is a file, not a "
                               f"folder; set HF_DATASETS_CACHE (or HF_HOME) to a folder you can write")


def test_hub_failure_is_a_user_error(monkeypatch):
    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'someone/corpus' on the Hub")

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # the client's own failure, below
    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(UserError, match="could not load data set 'someone/corpus'.*embedded") as info:
        load_documents(DataConfig(dataset="someone/corpus"))
    assert "\n" not in str(info.value)


def test_an_unreachable_hub_is_refused_at_once(monkeypatch):
    # A port nothing listens on: refused at once, as a machine without a network is. The hub
    # client would retry for half a minute; the check before it says so in one line.
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    for proxy in ("https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(proxy, raising=False)
    start = time.perf_counter()
    with pytest.raises(UserError, match=r"no_such/corpus' is no local path, and the Hugging Face hub \(127.0.0.1:9\) "
                                        r"cannot be reached.*HF_HUB_OFFLINE=1") as info:
        load_documents(DataConfig(dataset="no_such/corpus"))
    assert "\n" not in str(info.value) and time.perf_counter() - start < 10  # the client's retries: ~30 s


# --- tokenizer --------------------------------------------------------------------------


def test_trained_tokenizer_is_cached(tokenizer_cache, monkeypatch, rng):
    documents = random_documents(rng, 50)
    cfg = DataConfig(tokenizer_vocab_size=300)
    first = load_tokenizer(cfg, documents)
    assert len(list(tokenizer_cache.glob("tokenizer-*.json"))) == 1
    assert first.backend.id_to_token(first.eos_id) == "<eos>"

    def no_training(*args):
        raise AssertionError("the cached tokenizer should have been loaded")

    monkeypatch.setattr("te_mixtral.data.tokenizer.train_tokenizer", no_training)
    second = load_tokenizer(cfg, documents)
    assert second.backend.to_str() == first.backend.to_str()
    # Other documents or another vocabulary size must not hit the same cache entry.
    with pytest.raises(AssertionError, match="cached"):
        load_tokenizer(DataConfig(tokenizer_vocab_size=301), documents)
    with pytest.raises(AssertionError, match="cached"):
        load_tokenizer(cfg, documents[:-1])


@pytest.mark.parametrize("damage", ["", '{"version": "1.0", "trunc', "\x00\xff binary", '{"model": {"type": "BPE"}}',
                                    "plain"])
def test_a_corrupt_cached_tokenizer_is_trained_again(tokenizer_cache, rng, capsys, damage):
    documents = random_documents(rng, 50)
    cfg = DataConfig(tokenizer_vocab_size=300)
    fresh = load_tokenizer(cfg, documents).backend.to_str()
    (cached,) = tokenizer_cache.glob("tokenizer-*.json")
    if damage == "plain":  # loads, but is not what training writes: no <eos>
        tokenizers.Tokenizer(tokenizers.models.BPE()).save(str(cached))
    else:
        cached.write_bytes(damage.encode("latin-1"))
    assert load_tokenizer(cfg, documents).backend.to_str() == fresh
    assert "is corrupt; training it again" in capsys.readouterr().out
    assert cached.read_text() == fresh  # repaired, so the next run reads it
    assert load_tokenizer(cfg, documents).backend.to_str() == fresh
    assert "corrupt" not in capsys.readouterr().out


def test_tokenizer_training_is_deterministic_across_processes(tmp_path, rng):
    documents = random_documents(rng, 200)
    here = train_tokenizer(documents, 400).to_str()
    assert train_tokenizer(documents, 400).to_str() == here
    (tmp_path / "docs.json").write_text(json.dumps(documents))
    script = (
        "import json, sys; from te_mixtral.data.tokenizer import train_tokenizer; "
        "print(train_tokenizer(json.load(open(sys.argv[1])), 400).to_str())"
    )
    there = subprocess.run([sys.executable, "-c", script, str(tmp_path / "docs.json")],
                           capture_output=True, text=True, check=True, cwd=str(Path(packing.__file__).parents[1]))
    assert there.stdout.strip() == here


def test_tokenizer_from_file_or_folder(tmp_path, rng):
    backend = train_tokenizer(random_documents(rng, 30), 300)
    backend.add_special_tokens(["</s>"])  # listed before <eos>, so it wins
    (tmp_path / "ckpt").mkdir()
    backend.save(str(tmp_path / "ckpt" / "tokenizer.json"))
    for where in (tmp_path / "ckpt", tmp_path / "ckpt" / "tokenizer.json"):
        tokenizer = load_tokenizer(DataConfig(tokenizer=str(where)), [])
        assert tokenizer.eos_id == backend.token_to_id("</s>")
        assert tokenizer.vocab_size == backend.get_vocab_size()

    with pytest.raises(UserError, match="does not exist"):
        load_tokenizer(DataConfig(tokenizer=str(tmp_path / "nowhere")), [])
    plain = tokenizers.Tokenizer(tokenizers.models.BPE())
    plain.save(str(tmp_path / "plain.json"))
    with pytest.raises(UserError, match="none of the eos tokens"):
        load_tokenizer(DataConfig(tokenizer=str(tmp_path / "plain.json")), [])


# --- packing ----------------------------------------------------------------------------


def check_segments(batch, eos_id):
    """Positions, cu_seqlens and max_seqlen, each recomputed from scratch."""
    B, S = batch.input_ids.shape
    packed = batch.packed
    assert batch.input_ids.dtype == batch.labels.dtype == packed.position_ids_BS.dtype == torch.int64
    assert packed.cu_seqlens.dtype == torch.int32
    assert batch.num_tokens == B * S

    for row, positions in zip(batch.input_ids.tolist(), packed.position_ids_BS.tolist()):
        expected = [0]
        for previous in row[:-1]:
            expected.append(0 if previous == eos_id else expected[-1] + 1)
        assert positions == expected

    cu = packed.cu_seqlens.tolist()
    assert cu[0] == 0 and cu[-1] == B * S
    assert all(a < b for a, b in zip(cu, cu[1:]))
    assert set(range(0, B * S, S)) <= set(cu)  # every sample edge is a segment edge
    from_cu = [p for a, b in zip(cu, cu[1:]) for p in range(b - a)]
    assert from_cu == packed.position_ids_BS.flatten().tolist()
    assert packed.max_seqlen == max(b - a for a, b in zip(cu, cu[1:]))


def test_batch_from_windows_on_random_streams(rng):
    eos = 3
    for _ in range(20):
        B, S = rng.randint(1, 4), rng.randint(2, 40)
        windows = torch.tensor([[rng.choice([eos, 1, 2, 4, 5, 6]) for _ in range(S + 1)] for _ in range(B)])
        batch = batch_from_windows(windows, eos)
        check_segments(batch, eos)
        assert torch.equal(batch.input_ids, windows[:, :-1])
        expected_labels = torch.where(windows[:, :-1] == eos, -100, windows[:, 1:])
        assert torch.equal(batch.labels, expected_labels)


def test_packed_epoch_covers_true_windows(tmp_path, rng):
    documents = random_documents(rng, rng.randint(80, 150))
    seq_len, batch_size = rng.randint(8, 40), rng.randint(1, 6)
    cfg = DataConfig(dataset=str(write_jsonl(tmp_path / "d.jsonl", documents)), seq_len=seq_len,
                     tokenizer_vocab_size=300)
    packed = PackedData(cfg, batch_size=batch_size, rank=0, world_size=1, seed=rng.randrange(1000))
    eos = packed.tokenizer.eos_id

    # The stream is every document, in order, each closed by one eos.
    stream = packed.stream.tokens.tolist()
    assert stream[-1] == eos and stream.count(eos) == len(documents)
    ends = [i for i, t in enumerate(stream) if t == eos]
    pieces = [stream[a + 1 : b] for a, b in zip([-1] + ends, ends)]
    assert [packed.tokenizer.backend.decode(piece) for piece in pieces] == documents

    # Every sample is a window stream[i*S : i*S + S + 1], labels shifted by one, -100 after eos.
    windows = packed.stream.tokens.unfold(0, seq_len + 1, seq_len)
    assert packed.num_samples == len(windows)
    expected = Counter(
        (tuple(w[:-1]), tuple(-100 if t == eos else n for t, n in zip(w[:-1], w[1:]))) for w in windows.tolist()
    )
    seen = Counter()
    for step in range(packed.steps_per_epoch):
        (batch,) = packed.micro_batches(step)
        assert batch.input_ids.shape == (batch_size, seq_len)
        check_segments(batch, eos)
        seen.update(zip(map(tuple, batch.input_ids.tolist()), map(tuple, batch.labels.tolist())))
    # One epoch uses distinct true samples and drops fewer than one batch of them.
    assert seen <= expected
    assert packed.num_samples - seen.total() < batch_size


def concatenated(parts: list[packing.Batch]) -> packing.Batch:
    """One batch of the rows of `parts`, in order: what one process would have packed."""
    offsets = torch.tensor([0] + [p.num_tokens for p in parts]).cumsum(0)
    cu_seqlens = torch.cat([parts[0].packed.cu_seqlens[:1]] +
                           [p.packed.cu_seqlens[1:] + o for p, o in zip(parts, offsets)]).to(torch.int32)
    packed = type(parts[0].packed)(torch.cat([p.packed.position_ids_BS for p in parts]), cu_seqlens,
                                   max(p.packed.max_seqlen for p in parts))
    return packing.Batch(torch.cat([p.input_ids for p in parts]), torch.cat([p.labels for p in parts]), packed)


def test_sharding_and_micro_batches_match_one_process_and_epochs_reshuffle(tmp_path, rng):
    path = write_jsonl(tmp_path / "d.jsonl", random_documents(rng, 120))
    cfg = DataConfig(dataset=str(path), seq_len=rng.randint(8, 24), tokenizer_vocab_size=300)
    seed, batch_size = rng.randrange(1000), 4
    single = PackedData(cfg, batch_size, rank=0, world_size=1, seed=seed)
    assert single.steps_per_epoch >= 5
    steps = [0, 1, single.steps_per_epoch - 1, single.steps_per_epoch, 3 * single.steps_per_epoch + 2]
    for world, accum in ((2, 1), (4, 1), (1, 2), (2, 2), (1, 4)):
        ranks = [PackedData(cfg, batch_size, rank=r, world_size=world, seed=seed, grad_accum_steps=accum)
                 for r in range(world)]
        for step in steps:
            (whole,) = single.micro_batches(step)
            per_rank = [rank.micro_batches(step) for rank in ranks]
            assert all(len(micro) == accum for micro in per_rank)
            assert all(b.input_ids.shape[0] == batch_size // (world * accum) for micro in per_rank for b in micro)
            # Micro-batch by micro-batch, each the ranks' rows in rank order: the whole batch.
            merged = concatenated([per_rank[r][i] for i in range(accum) for r in range(world)])
            for name in ("input_ids", "labels"):
                assert torch.equal(getattr(whole, name), getattr(merged, name))
            assert torch.equal(whole.packed.position_ids_BS, merged.packed.position_ids_BS)
            assert torch.equal(whole.packed.cu_seqlens, merged.packed.cu_seqlens)
            assert whole.packed.max_seqlen == merged.packed.max_seqlen

    def epoch_rows(packed, epoch):
        steps = range(epoch * packed.steps_per_epoch, (epoch + 1) * packed.steps_per_epoch)
        return torch.cat([b.input_ids for step in steps for b in packed.micro_batches(step)])

    assert not torch.equal(epoch_rows(single, 0), epoch_rows(single, 1))
    again = PackedData(cfg, batch_size, rank=0, world_size=1, seed=seed)
    other_seed = PackedData(cfg, batch_size, rank=0, world_size=1, seed=seed + 1000)
    assert torch.equal(epoch_rows(again, 0), epoch_rows(single, 0))
    assert not torch.equal(epoch_rows(other_seed, 0), epoch_rows(single, 0))


def test_too_little_data_is_a_user_error(tmp_path):
    cfg = DataConfig(dataset=str(write_jsonl(tmp_path / "d.jsonl", ["a b c", "d e f"])), seq_len=64,
                     tokenizer_vocab_size=300)
    with pytest.raises(UserError, match=r"0 samples of 64 tokens.*needs 2"):
        PackedData(cfg, batch_size=2, rank=0, world_size=1, seed=0)


def test_batch_moves_to_a_device():
    batch = batch_from_windows(torch.tensor([[5, 0, 6, 7, 0]]), eos_id=0)
    moved = batch.to("cpu")
    assert torch.equal(moved.input_ids, batch.input_ids) and moved.packed.max_seqlen == batch.packed.max_seqlen == 2
    assert torch.equal(moved.packed.position_ids_BS, batch.packed.position_ids_BS)
    assert torch.equal(moved.packed.cu_seqlens, batch.packed.cu_seqlens)
    assert moved.num_tokens == 4

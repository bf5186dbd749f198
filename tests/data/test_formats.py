"""Every data format in the registry (te_mixtral/data/formats.py) reads the example data of
its kind into token ids and a mask of the trained tokens of the same shape."""

import pytest
from conftest import REPO

from te_mixtral.config import DataConfig
from te_mixtral.data.formats import FORMATS
from te_mixtral.data.sources import load_records

EXAMPLES = {
    "text": DataConfig(max_documents=8),
    "chat": DataConfig(dataset=str(REPO / "examples" / "chat.jsonl"), format="chat",
                       tokenizer=str(REPO / "examples" / "chat-tokenizer"), max_documents=8),
    "sharegpt": DataConfig(dataset=str(REPO / "examples" / "chat-sharegpt.jsonl"), format="sharegpt",
                           tokenizer=str(REPO / "examples" / "chat-tokenizer"), max_documents=8),
    "alpaca": DataConfig(dataset=str(REPO / "examples" / "chat-alpaca.json"), format="alpaca",
                         tokenizer=str(REPO / "examples" / "chat-tokenizer"), max_documents=8),
}


def test_every_format_has_an_example():
    assert set(EXAMPLES) == set(FORMATS)


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_a_format_returns_ids_and_a_mask_of_equal_length(name):
    cfg = EXAMPLES[name]
    fmt = FORMATS[name]
    records = load_records(cfg)
    tokenizer = fmt.tokenizer(cfg, records)
    (field,) = records.column_names
    ids, trained = fmt.encode(tokenizer, records[field], list(range(len(records))))
    assert len(ids) == len(records) and all(doc and doc[-1] == tokenizer.eos_id for doc in ids)
    if trained is None:  # every token is trained
        assert not fmt.masked
    else:
        assert fmt.masked
        assert [len(mask) for mask in trained] == [len(doc) for doc in ids]
        assert any(any(mask) for mask in trained)

"""Not a worker: `tokenize_once`, which tests/workers/train_and_save.py's shared launches and
tests/launch.py's `run_cli` wrap around `packing.token_stream`."""


def tokenize_once(token_stream):
    """`token_stream` (te_mixtral/data/packing.py), each distinct stream tokenized once in this
    process, keyed as `datasets` caches a file's (the records, the tokenizer, eos and what the
    format adds): most runs of the tests tokenize the same embedded text with the same
    tokenizer, which costs more than their few steps (0.2 of a 0.37 CPU-second five-step run).
    Each run packs its own share from the stream (copies: nothing is written back)."""
    streams = {}

    def cached(tokenizer, records, fmt):
        key = (records._fingerprint, tokenizer.backend.to_str(), tokenizer.eos_id, fmt.cache_key(tokenizer))
        if key not in streams:
            streams[key] = token_stream(tokenizer, records, fmt)
        return streams[key]

    return cached

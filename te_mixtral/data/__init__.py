"""Data: records in, packed batches of token ids out.

    formats.py     the data formats (text, chat, sharegpt, alpaca), each records -> token ids and
                   trained-token mask
    sources.py     where records come from: the embedded corpus, local files, the hub
    tokenizer.py   a Hugging Face checkpoint's tokenizer, a given tokenizer.json, or one
                   trained here
    chat.py        chat records through the tokenizer's chat template, loss on the
                   assistant's tokens only
    chat_layouts.py  ShareGPT, Alpaca and mapped layouts of chat data, read as {role, content}
                   conversations
    packing.py     the token stream, its fixed-length windows, the held-out split, and
                   sharding over ranks
    cache_key.py   the cache key of our `datasets.map` results
    cache_writes.py  a full disk under `datasets`' cache, said in one line naming it
"""

"""The cache key of a `datasets.map` over records, ours rather than `datasets`' own.

`datasets` names a map's result by a hash of its function, and hashes a function defined in a
module by its module and name, not its code (and a function holding a transformers tokenizer
by an object whose hash can change once it has been called). So a map's result would be handed
back to a later te_mixtral whose code makes it otherwise. The key here is the records' own
state (`_fingerprint`, `datasets`' name for it: no public name), a recipe that a change of the
map's code bumps, and whatever else the map's result depends on.
"""

import hashlib

import datasets


def map_fingerprint(recipe: str, records: datasets.Dataset, *depends_on: str) -> str:
    """`new_fingerprint` for a map over `records` made by `recipe`, its result depending on
    `depends_on` too."""
    text = "\0".join([recipe, records._fingerprint, *depends_on])
    return hashlib.sha256(text.encode()).hexdigest()[:32]

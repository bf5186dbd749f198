"""Names a run is given that may point at this machine or at the Hugging Face hub: `model_path`
and `data.dataset`. Hub ids look like paths (`owner/name`), so where each points is decided
here once, for the config's checks (config.py), the checkpoint's reading (model/hf_config.py)
and the data's (data/sources.py) alike; whether the hub can be reached at all, asked of it
once before either goes there (`hub_unreachable`); and the base model a checkpoint or an
adapter records (`base_model`), the same however `--model` spelled it.
"""

import socket
import urllib.parse
import urllib.request
from pathlib import Path

# The hub's clients retry an unreachable hub for half a minute before they fail; a connection
# not made in this long counts as none.
HUB_PROBE_TIMEOUT_S = 3.0


def local_path(name: str) -> Path | None:
    """The local path `name` (model_path, data.dataset) names, or None where it names a hub id.
    Hub ids look like paths (`owner/name`), so a name is local where it exists or is plainly a
    path (/, ., ~; config.load_config has made a `~` the home where there is one): a typo in a local
    path must not go to the hub."""
    path = Path(name)
    return path if path.exists() or name.startswith(("/", ".", "~")) else None


def base_model(model_path: str | None) -> str | None:
    """What `--model` names, the same however it is spelled: a local folder's resolved path,
    else the hub id as given (None: a base made from the seed). For a checkpoint's record of
    its base, and an adapter's. A checkpoint written before config.load_config expanded `~`
    may hold one: it is the home here too."""
    if model_path is None or not Path(model_path).expanduser().exists():
        return model_path
    return str(Path(model_path).expanduser().resolve())


def brings_tokenizer(model_path: str | None) -> bool:
    """Whether model_path's checkpoint has a tokenizer.json, which a run reads where
    data.tokenizer is unset (training/hf_checkpoint.py): a local folder where it has one, a hub
    id always (the published Mixtral checkpoints do; a run downloads it only as it starts)."""
    if model_path is None:
        return False
    folder = local_path(model_path)
    return folder is None or (folder / "tokenizer.json").is_file()


# The files a local data set may hold, by suffix, and the `datasets` builder that reads each
# (te_mixtral/data/sources.py).
LOCAL_DATA_BUILDERS = {".json": "json", ".jsonl": "json", ".txt": "text"}


def is_hub_dataset(name: str) -> bool:
    """Whether data.dataset `name` names a data set on the Hugging Face hub: not the embedded
    text, nor a local path (`local_path`), nor a name with a data file's suffix (a data file
    mistyped must not go to the hub either)."""
    return name != "embedded" and local_path(name) is None and Path(name).suffix not in LOCAL_DATA_BUILDERS


def hub_unreachable() -> str | None:
    """Why the Hugging Face hub cannot be reached, as a clause ('the Hugging Face hub (HOST)
    cannot be reached (WHY)'), by one connection to it of at most HUB_PROBE_TIMEOUT_S; None
    where it can, and where the probe does not apply: with HF_HUB_OFFLINE=1 (the clients read
    their caches alone then) or behind a proxy (only the client knows the way through)."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE or "https" in urllib.request.getproxies():
        return None
    endpoint = urllib.parse.urlsplit(constants.ENDPOINT)
    port = endpoint.port or (443 if endpoint.scheme == "https" else 80)
    try:
        socket.create_connection((endpoint.hostname, port), timeout=HUB_PROBE_TIMEOUT_S).close()
    except OSError as e:
        return f"the Hugging Face hub ({endpoint.netloc}) cannot be reached ({e.strerror or e})"
    return None

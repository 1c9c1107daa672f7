"""Names of models and datasets on the Hugging Face Hub, checked before anything loads them.

Where the Hub cannot be reached (HF_HUB_OFFLINE set, no network, a firewall), the Hugging Face libraries retry for
most of a minute before failing. Here a name that is not in the local cache fails at once, naming the setting and
what to do; a name that is cached loads from the cache, with the libraries told not to try the network.
"""

from __future__ import annotations

import functools
import os
import re
import socket
import threading
from pathlib import Path
from urllib.parse import urlparse

from finetune.errors import UserError
from finetune.hooks.huggingface_hub import stay_offline

TIMEOUT_S = 3.0


HUB_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?")


def looks_like_hub_name(name: str) -> bool:
    """`name` or `owner/name`, as the Hub spells repositories; anything else is a path."""
    return HUB_NAME.fullmatch(name) is not None and not name.endswith((".jsonl", ".json", ".csv", ".parquet"))


def check_available(name: str, key: str, kind: str = "model") -> None:
    """`name` (a Hub `owner/name`, for `key`) can be loaded: the Hub answers, or the name is in the local cache."""
    if reachable():
        return
    if _cached(name, kind):
        stay_offline()
        return
    from huggingface_hub import constants

    why = "HF_HUB_OFFLINE is set" if _offline_by_setting() else f"{constants.ENDPOINT} cannot be reached from here"
    download = f"hf download {name}" + (" --repo-type dataset" if kind == "dataset" else "")
    raise UserError(f"{key}: {name!r} is not a local {'folder' if kind == 'model' else 'file or folder'}, it is not "
                    f"in the local Hugging Face cache, and the Hub cannot be asked ({why}). Download it where there "
                    f"is network (`{download}`) and set {key} to the folder, or check the name")


@functools.cache
def reachable() -> bool:
    """Whether the Hub's server answers a connection within a few seconds (asked once per process)."""
    if _offline_by_setting():
        return False
    from huggingface_hub import constants

    url = urlparse(constants.ENDPOINT)
    answer: list[bool] = []

    def connect():  # in a thread: a name lookup has no timeout of its own
        try:
            with socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)),
                                          timeout=TIMEOUT_S):
                answer.append(True)
        except OSError:
            answer.append(False)

    probe = threading.Thread(target=connect, daemon=True)
    probe.start()
    probe.join(TIMEOUT_S + 1)
    return bool(answer and answer[0])


def _offline_by_setting() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")


def _cached(name: str, kind: str) -> bool:
    from huggingface_hub import CacheNotFound, constants, scan_cache_dir

    try:  # the cache named where the downloads read it: scan_cache_dir's default is a copy taken at its import
        return any(repo.repo_id == name and repo.repo_type == kind
                   for repo in scan_cache_dir(constants.HF_HUB_CACHE).repos)
    except CacheNotFound:
        return False


def cached_repo_id(folder: Path) -> str | None:
    """The Hub id of the model whose cached snapshot `folder` is (HF_CACHE/models--OWNER--NAME/snapshots/REVISION),
    as huggingface_hub's own cache scan reads it; None for a folder outside a Hugging Face cache."""
    from huggingface_hub import CacheNotFound, CorruptedCacheException, scan_cache_dir

    folder = folder.resolve()
    if folder.parent.name != "snapshots" or len(folder.parents) < 3:
        return None
    try:
        repos = scan_cache_dir(folder.parents[2]).repos
    except (CacheNotFound, CorruptedCacheException):
        return None
    return next((repo.repo_id for repo in repos if repo.repo_type == "model"
                 for revision in repo.revisions if revision.snapshot_path == folder), None)


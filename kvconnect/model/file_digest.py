"""The digest of a weights file, all of its bytes, remembered across restarts.

Chunk keys bind to the model fingerprint (`source.weights_identity`), and a chunk stored under
one set of weights must never load into another. A digest of samples (the first and last MiB,
as before) let a checkpoint whose middle changed in place load its old KV from the disk tier
(issue 34, finding 7). So the whole file is hashed: sha256, 1.6 GB/s on one core here (SHA-NI;
blake2b 0.75 GB/s), 60 ms for SmolLM2's 98 MB GGUF, about 0.7 s per GB from the page cache.

A restart does not hash again: the digest is kept in a small JSON file under the user's cache
directory, keyed by the file's resolved path and valid while its size, mtime, ctime, inode and
device are unchanged (ctime cannot be set back by a user: rewriting the bytes in place and
restoring the mtime still changes it). The cache is only a shortcut: an entry that does not
parse, or a cache that cannot be written, means hashing again, never a wrong digest.

    cache file   $XDG_CACHE_HOME/kvconnect/file-digests.json (default ~/.cache/...), mode 0600
    entry        "<resolved path>": [[size, mtime_ns, ctime_ns, inode, device], "<sha256 hex>"]
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

MAX_ENTRIES = 256
"""Files remembered at most (the oldest entries go first)."""
CACHE_NAME = "file-digests.json"


def cache_path() -> Path:
    """Where the digests are kept (the one place this module reads the environment)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvconnect" / CACHE_NAME


def file_digest(path: Path) -> str:
    """sha256 of every byte of `path`, from the cache if the file is unchanged since."""
    st = path.stat()
    stamp = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]
    key = str(path.resolve())
    cache = cache_path()
    entries = _read(cache)
    hit = entries.get(key)
    if isinstance(hit, list) and len(hit) == 2 and hit[0] == stamp and isinstance(hit[1], str):
        return hit[1]
    with path.open("rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    entries.pop(key, None)
    entries[key] = [stamp, digest]
    _write(cache, dict(list(entries.items())[-MAX_ENTRIES:]))
    return digest


def _read(cache: Path) -> dict[str, object]:
    try:
        entries = json.loads(cache.read_bytes())
    except (OSError, ValueError):
        return {}
    return entries if isinstance(entries, dict) else {}


def _write(cache: Path, entries: dict[str, object]) -> None:
    """Atomically (processes of one instance, its TP ranks, may write at once; the last
    write wins, and every write is a whole file)."""
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=cache.parent, prefix=".digests-")  # mode 0600
        with os.fdopen(fd, "w") as f:
            json.dump(entries, f)
        os.replace(tmp, cache)
    except OSError as e:  # a read-only home: hash again next time
        logger.debug("kvconnect: digest cache %s not written: %s", cache, e)

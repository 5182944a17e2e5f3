"""Local-disk tier: one file per chunk under a root directory, a byte budget, LRU.

File names are the SHA-256 of the key, so no key can name a path outside the root. Writes go
to a temporary file that is renamed into place (a reader never sees half a chunk). Each file
carries its key, its events' description and checksums of its header and payload; a file that
fails a check is deleted and reported. On start the tier reads the files it finds, so a
restarted engine keeps (and announces) what it had; what is unreadable, corrupt or of another
shape is dropped with a log line (it was never announced by this process), and the engine
starts whatever the directory holds.

Nothing outside the root is read or written: files are opened with O_NOFOLLOW (a planted
symlink is an error, not a path), temporary files with O_EXCL, and the scan takes only regular
files. A root another user owns or anyone may write to is refused at start.
"""

from __future__ import annotations

import hashlib
import logging
import os
import stat
from collections import OrderedDict
from pathlib import Path
from typing import BinaryIO, Self

import torch

from kvconnect.connector.offload.common import ChunkInfo, TierConfig
from kvconnect.connector.offload.kinds import TierKind
from kvconnect.connector.offload.tiers.base import (
    Evicted,
    Tier,
    TierError,
    TierPlacement,
    pack,
    peek_key,
    unpack,
)

logger = logging.getLogger(__name__)
SUFFIX = ".kvchunk"


class DiskTier(Tier):
    kind = TierKind.DISK

    @classmethod
    def from_config(cls, config: TierConfig, placement: TierPlacement) -> Self:
        # One directory per rank: a rank owns and announces only its own files. The configured
        # directory holds them: anyone may write there only if it is sticky (like /tmp), or
        # another user could swap a rank's directory.
        base = Path(config.path)
        if base.is_dir():
            mode = base.stat().st_mode
            if mode & stat.S_IWOTH and not mode & stat.S_ISVTX:
                raise ValueError(
                    f"disk tier: {base} is writable by every user and not sticky (mode "
                    f"{stat.S_IMODE(mode):o}); chmod o-w (or +t) it or use another directory"
                )
        root = base / f"tp{placement.world_size}-rank{placement.rank}"
        shape = placement.chunk_shape or None
        return cls(str(root), config.max_bytes, shape, placement.dtype if shape else None)

    def __init__(
        self,
        path: str,
        max_bytes: int,
        chunk_shape: tuple[int, ...] | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        self.root = Path(path).resolve()
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        check_root(self.root)
        self.max_bytes = max_bytes
        self.chunk_shape, self.dtype = chunk_shape, dtype
        """What every chunk here must be (when known): others are dropped at start."""
        self.used_bytes = 0
        self._index: OrderedDict[str, tuple[int, ChunkInfo]] = OrderedDict()
        self.num_corrupt = 0
        self._scan()

    def _path(self, key: str) -> Path:
        name = hashlib.sha256(key.encode()).hexdigest() + SUFFIX
        path = self.root / name
        assert path.parent == self.root  # a digest is never a path
        return path

    def _scan(self) -> None:
        found = []
        for f in self.root.iterdir():
            try:
                st = f.lstat()
            except OSError:
                continue
            if not f.name.endswith((SUFFIX, ".tmp")):
                continue
            if f.name.endswith(".tmp") or not stat.S_ISREG(st.st_mode):
                # A write that never finished, or a symlink or other planted entry.
                f.unlink(missing_ok=True)
                continue
            found.append((st.st_mtime, f))
        for _, f in sorted(found):
            try:
                blob = _read(f)
                key = peek_key(blob)
                if f != self._path(key):
                    raise TierError(f"holds {key}, which belongs in another file")
                info, data = unpack(blob, key)
                if self.chunk_shape is not None and (
                    tuple(data.shape) != self.chunk_shape or data.dtype != self.dtype
                ):
                    raise TierError(
                        f"a {data.dtype} chunk of shape {tuple(data.shape)}, not the "
                        f"{self.dtype} {self.chunk_shape} of this engine"
                    )
            except (TierError, OSError) as e:
                logger.warning("disk tier: dropping %s (%s)", f.name, e)
                self.num_corrupt += 1
                f.unlink(missing_ok=True)
                continue
            self._index[key] = (len(blob), info)
            self.used_bytes += len(blob)

    def contains(self, key: str) -> bool:
        return key in self._index

    def put(self, key: str, info: ChunkInfo, data: torch.Tensor) -> list[Evicted]:
        if key in self._index:
            self._index.move_to_end(key)
            return []
        parts = pack(key, info, data)
        size = sum(len(p) for p in parts)
        if size > self.max_bytes:
            raise TierError(f"disk tier: a {size} B chunk exceeds max_bytes={self.max_bytes}")
        evicted = []
        while self.used_bytes + size > self.max_bytes and self._index:
            old_key, (old_size, old_info) = self._index.popitem(last=False)
            self._path(old_key).unlink(missing_ok=True)
            self.used_bytes -= old_size
            evicted.append(Evicted(old_key, old_info, None))
        path = self._path(key)
        tmp = path.with_suffix(".tmp")
        try:
            with _create(tmp) as f:
                for p in parts:
                    f.write(p)
            os.replace(tmp, path)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            raise TierError(f"disk tier: cannot write chunk {key}: {e}") from e
        self._index[key] = (size, info)
        self.used_bytes += size
        return evicted

    def get(self, key: str) -> torch.Tensor | None:
        if key not in self._index:
            return None
        try:
            _, data = unpack(_read(self._path(key)), key)
        except (TierError, OSError) as e:
            self.num_corrupt += 1
            self.remove(key)
            raise TierError(f"disk tier: {e}") from e
        self._index.move_to_end(key)
        return data

    def remove(self, key: str) -> ChunkInfo | None:
        entry = self._index.pop(key, None)
        if entry is None:
            return None
        self._path(key).unlink(missing_ok=True)
        self.used_bytes -= entry[0]
        return entry[1]

    def clear(self) -> list[tuple[str, ChunkInfo]]:
        dropped = self.entries()
        for key, _ in dropped:
            self.remove(key)
        return dropped

    def entries(self) -> list[tuple[str, ChunkInfo]]:
        return [(k, info) for k, (_, info) in self._index.items()]

    def check_integrity(self) -> None:
        sizes = {self._path(k): size for k, (size, _) in self._index.items()}
        assert sum(sizes.values()) == self.used_bytes, "used_bytes disagrees with the index"
        assert self.used_bytes <= self.max_bytes, "over the byte budget"
        on_disk = {p: p.stat().st_size for p in self.root.glob("*" + SUFFIX)}
        assert on_disk == sizes, "the files on disk are not the indexed chunks"


def check_root(root: Path) -> None:
    """`ValueError` unless `root` is a directory of this user that no one else may write to:
    another user could otherwise plant or swap chunks under it."""
    st = root.lstat()
    if not stat.S_ISDIR(st.st_mode):
        raise ValueError(f"disk tier: {root} is not a directory")
    if st.st_uid != os.geteuid():
        raise ValueError(
            f"disk tier: {root} is owned by uid {st.st_uid}, not by this user "
            f"(uid {os.geteuid()}); use a directory of your own"
        )
    if st.st_mode & stat.S_IWOTH:
        raise ValueError(
            f"disk tier: {root} is writable by every user (mode {stat.S_IMODE(st.st_mode):o}); "
            f"chmod o-w it or use another directory"
        )


def _read(path: Path) -> bytearray:
    """The whole file at `path`, never through a symlink (ELOOP), into a bytearray (loads use
    it in place)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd, "rb") as f:
        blob = bytearray(os.fstat(fd).st_size)
        if f.readinto(blob) != len(blob):
            raise OSError(f"{path.name}: short read")
    return blob


def _create(path: Path) -> BinaryIO:
    """A new file at `path` for writing, owner-only; whatever sits at that name (a stale
    temporary file, a planted symlink) is removed first, never followed."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
    try:
        fd = os.open(path, flags, 0o600)
    except FileExistsError:
        path.unlink()
        fd = os.open(path, flags, 0o600)
    return os.fdopen(fd, "wb")

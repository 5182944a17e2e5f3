"""Local-disk tier: one file per chunk under a root directory, a byte budget, LRU.

Layout: `<path>/<model namespace digest>/tp<world>-rank<rank>/<sha256 of key>.kvchunk`. The
model's namespace (`common.key_namespace`) is part of the directory, so another model, dtype
or chunking under the same path has its own directory. File names are the SHA-256 of the key,
so no key can name a path outside the root. Writes go to a temporary file that is renamed into
place (a reader never sees half a chunk). Each file carries its key, its events' description,
checksums of its header and payload, and with `hmac_key_file` a signature.

One instance per root: the tier holds an exclusive `flock` on `<root>/.lock` while it lives,
and a second instance that names the same path, model and rank fails at start naming the pid
that holds it (two instances announcing and evicting one directory's files would each delete
what the other announced). Give each instance its own path.

On start the tier reads the files it finds, so a restarted engine keeps (and announces) what
it had. What it cannot use (unreadable, corrupt, unsigned under a key, of another shape,
temporary files) is left alone, never deleted, and named once in the log; only a file at one
of this tier's own key paths is ever replaced or removed, when that key is written or dropped.

Nothing outside the root is read or written: files are opened with O_NOFOLLOW (a planted
symlink is an error, not a path), temporary files with O_EXCL, and the scan takes only regular
files. A root another user owns or anyone may write to is refused at start.
"""

from __future__ import annotations

import fcntl
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
    IntegrityError,
    StoredChunk,
    Tier,
    TierError,
    TierPlacement,
    pack,
    peek_key,
    read_mac_key,
    tail_shape,
    unpack,
)

logger = logging.getLogger(__name__)
SUFFIX = ".kvchunk"
LOCK = ".lock"
MAX_NAMED = 5
"""Files the start-up log line names (then how many more)."""


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
        digest = hashlib.sha256(placement.namespace.encode()).hexdigest()[:16]
        model_dir = base / f"model-{digest}"
        # Checked like the rank's own directory: whoever may write in it could swap that.
        model_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        check_root(model_dir.resolve())
        root = model_dir / f"tp{placement.world_size}-rank{placement.rank}"
        shape = placement.chunk_shape or None
        mac_key = read_mac_key(config.hmac_key_file) if config.hmac_key_file else None
        return cls(str(root), config.max_bytes, shape, placement.dtype if shape else None, mac_key)

    def __init__(
        self,
        path: str,
        max_bytes: int,
        chunk_shape: tuple[int, ...] | None = None,
        dtype: torch.dtype | None = None,
        mac_key: bytes | None = None,
    ) -> None:
        self.root = Path(path).resolve()
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        check_root(self.root)
        self._lock_fd: int | None = lock_root(self.root)
        self.max_bytes = max_bytes
        self.chunk_shape, self.dtype = chunk_shape, dtype
        """What every chunk here must be (when known): others are left alone at start."""
        self.mac_key = mac_key
        self.used_bytes = 0
        self._index: OrderedDict[str, tuple[int, ChunkInfo]] = OrderedDict()
        self.foreign: set[Path] = set()
        """Files in the root that are not this tier's chunks: never deleted, never counted."""
        self.num_corrupt = 0
        self._scan()

    def _path(self, key: str) -> Path:
        name = hashlib.sha256(key.encode()).hexdigest() + SUFFIX
        path = self.root / name
        assert path.parent == self.root  # a digest is never a path
        return path

    def _scan(self) -> None:
        found, skipped = [], []
        for f in self.root.iterdir():
            if f.name == LOCK:
                continue
            try:
                st = f.lstat()
            except OSError:
                continue
            if f.name.endswith(SUFFIX) and stat.S_ISREG(st.st_mode):
                found.append((st.st_mtime, f))
            else:  # a write in progress or left by a crash, a symlink, anything else
                skipped.append((f, "not a chunk file"))
        for _, f in sorted(found):
            try:
                key, info, size = self._read_entry(f)
            except (TierError, OSError) as e:
                self.num_corrupt += 1
                skipped.append((f, str(e)))
                continue
            self._index[key] = (size, info)
            self.used_bytes += size
        self.foreign = {f for f, _ in skipped}
        if skipped:
            named = ", ".join(f"{f.name} ({why})" for f, why in skipped[:MAX_NAMED])
            more = len(skipped) - MAX_NAMED
            logger.warning(
                "disk tier %s: leaving %d file(s) that are not this engine's chunks alone: %s%s",
                self.root,
                len(skipped),
                named,
                f" and {more} more" if more > 0 else "",
            )

    def _read_entry(self, f: Path) -> tuple[str, ChunkInfo, int]:
        """The key, description and size of the chunk file `f`; `TierError` unless it is a
        whole, valid chunk of this engine's shape at its own key's path."""
        blob = _read(f)
        key = peek_key(blob)
        if f != self._path(key):
            raise TierError(f"holds {key}, which belongs in another file")
        info, data = unpack(blob, key, self.mac_key)
        if self.chunk_shape is not None:
            shape = tail_shape(self.chunk_shape, len(info.token_ids))
            if (
                tuple(data.shape) != shape
                or data.dtype != self.dtype
                or (len(info.token_ids) > self.chunk_shape[2])
            ):
                raise TierError(
                    f"a {data.dtype} chunk of shape {tuple(data.shape)}, not a "
                    f"{self.dtype} {shape} of this engine (chunks {self.chunk_shape})"
                )
        return key, info, len(blob)

    def contains(self, key: str) -> bool:
        return key in self._index

    def put(self, key: str, info: ChunkInfo, data: torch.Tensor) -> list[Evicted]:
        if key in self._index:
            self._index.move_to_end(key)
            return []
        parts = pack(key, info, data, self.mac_key)
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
            self.foreign.discard(path)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            raise TierError(f"disk tier: cannot write chunk {key}: {e}") from e
        self._index[key] = (size, info)
        self.used_bytes += size
        return evicted

    def load(self, key: str) -> StoredChunk | None:
        if key not in self._index:
            return None
        try:
            info, data = unpack(_read(self._path(key)), key, self.mac_key)
        except (TierError, OSError) as e:
            self.num_corrupt += 1
            self.remove(key)
            error = IntegrityError if isinstance(e, IntegrityError) else TierError
            raise error(f"disk tier: {e}") from e
        self._index.move_to_end(key)
        return StoredChunk(info, data)

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
        on_disk = {
            p: p.stat().st_size for p in self.root.glob("*" + SUFFIX) if p not in self.foreign
        }
        assert on_disk == sizes, "the files on disk are not the indexed chunks"
        assert self._lock_fd is not None, "the root's lock was released"

    def close(self) -> None:
        """Release the root's lock (another instance may then use it)."""
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None


def lock_root(root: Path) -> int:
    """An exclusive, non-blocking flock on `root/.lock`, its descriptor; `ValueError` naming
    the holder if another instance (any process, or another tier here) has it."""
    fd = os.open(root / LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise ValueError(
            f"disk tier: {root} is in use by another instance (pid {holder} holds "
            f"{root / LOCK}); give each instance its own disk tier path"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


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

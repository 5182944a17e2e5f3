"""Local-disk tier: one file per chunk under a root directory, a byte budget, LRU.

File names are the SHA-256 of the key, so no key can name a path outside the root. Writes go
to a temporary file that is renamed into place (a reader never sees half a chunk). Each file
carries its key, its events' description and a checksum of the payload; a file that fails the
check is deleted and reported. On start the tier reads the headers of the files it finds, so a
restarted engine keeps (and announces) what it had.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections import OrderedDict
from pathlib import Path
from typing import Self

import torch

from kvconnect.connector.offload.common import ChunkInfo, TierConfig
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
    kind, medium = "disk", "DISK"

    @classmethod
    def from_config(cls, config: TierConfig, placement: TierPlacement) -> Self:
        # One directory per rank: a rank owns and announces only its own files.
        root = Path(config.path) / f"tp{placement.world_size}-rank{placement.rank}"
        return cls(str(root), config.max_bytes)

    def __init__(self, path: str, max_bytes: int) -> None:
        self.root = Path(path).resolve()
        self.root.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
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
        files = sorted(self.root.glob("*" + SUFFIX), key=lambda p: p.stat().st_mtime)
        for f in files:
            try:
                blob = f.read_bytes()
                key = peek_key(blob)
                info, _ = unpack(blob, key)
            except (TierError, OSError, ValueError) as e:
                logger.warning("disk tier: dropping unreadable %s (%s)", f.name, e)
                self.num_corrupt += 1
                f.unlink(missing_ok=True)
                continue
            if f != self._path(key):
                f.unlink(missing_ok=True)
                continue
            self._index[key] = (len(blob), info)
            self.used_bytes += len(blob)
        for tmp in self.root.glob("*.tmp"):
            tmp.unlink(missing_ok=True)

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
            with open(tmp, "wb") as f:
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
            path = self._path(key)
            blob = bytearray(path.stat().st_size)
            with open(path, "rb") as f:
                f.readinto(blob)
            _, data = unpack(blob, key)
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

"""Host-memory tier: a preallocated buffer cut into fixed-size slots, one chunk per slot, LRU
(a tail, a chunk of fewer blocks, fills the first part of its slot).

A chunk under a lease (`leased(key)`, set by the worker: a decode instance will pull it,
peers/leases.py) is not evicted: the least recently used chunk not leased goes instead, and when
every slot is leased the put fails (`TierError`: the store is dropped and counted)."""

from __future__ import annotations

import mmap
from collections import OrderedDict
from collections.abc import Callable
from typing import Self

import torch

from kvconnect.connector.offload.common import ChunkInfo, TierConfig
from kvconnect.connector.offload.kinds import TierKind
from kvconnect.connector.offload.tiers.base import (
    Evicted,
    StoredChunk,
    Tier,
    TierError,
    TierPlacement,
    TierTooSmall,
    tail_shape,
)

POPULATE = getattr(mmap, "MAP_POPULATE", 0)
"""Linux: the kernel backs a mapping with pages when it is made (elsewhere: on first use)."""


class CpuTier(Tier):
    kind = TierKind.CPU

    @classmethod
    def from_config(cls, config: TierConfig, placement: TierPlacement) -> Self:
        return cls(config.max_bytes, placement.chunk_shape, placement.dtype)

    def __init__(self, max_bytes: int, chunk_shape: tuple[int, ...], dtype: torch.dtype) -> None:
        numel = 1
        for n in chunk_shape:
            numel *= n
        slot_bytes = numel * dtype.itemsize
        self.num_slots = max_bytes // slot_bytes
        if self.num_slots < 1:
            raise TierTooSmall(f"cpu tier: max_bytes={max_bytes} holds no chunk of {slot_bytes} B")
        self.chunk_shape = chunk_shape
        # Allocated once, and every page populated now (MAP_POPULATE, in one call): the first
        # write to a page faults, and those faults, paid by the stores and pulls that fill
        # the tier, cost ~100 ms per 12 MB chunk inside a vLLM worker on these machines (a
        # pulled 4k-token prompt took 1.7 s, 0.5 s with the pages populated). Pinned memory
        # is not available on CPU-only torch, so plain pages.
        self._memory = mmap.mmap(
            -1, self.num_slots * slot_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | POPULATE
        )
        self._buffer = torch.frombuffer(self._memory, dtype=dtype).view(
            self.num_slots, *chunk_shape
        )
        self.slot_bytes = slot_bytes
        self._free = list(range(self.num_slots - 1, -1, -1))
        self._index: OrderedDict[str, tuple[int, ChunkInfo]] = OrderedDict()
        self._reserved: set[int] = set()
        """Slots handed out by `reserve`, held by no chunk until `commit`."""
        self.leased: Callable[[str], bool] | None = None
        self.keep_evicted = True
        """Whether `put` returns an evicted chunk's data (a copy) or only its key and info."""

    def contains(self, key: str) -> bool:
        return key in self._index

    def put(self, key: str, info: ChunkInfo, data: torch.Tensor) -> list[Evicted]:
        if key in self._index:
            self._index.move_to_end(key)
            return []
        shape = tail_shape(self.chunk_shape, len(info.token_ids))
        if tuple(data.shape) != shape:
            raise TierError(f"cpu tier: {key}: data of shape {tuple(data.shape)}, not {shape}")
        evicted = self._make_room()
        slot = self._free.pop()
        self._view(slot, info).copy_(data)
        self._index[key] = (slot, info)
        return evicted

    def reserve(self, key: str) -> tuple[int, memoryview, list[Evicted]] | None:
        """A slot for whole chunk `key` to be written into in place (a pull receives into
        it): its number, its bytes, and what was evicted to free it, as `put` evicts. The
        slot holds nothing until `commit`; `unreserve` gives it back. None if `key` is held
        already, or every slot is leased or reserved."""
        if key in self._index:
            return None
        try:
            evicted = self._make_room()
        except TierError:
            return None
        slot = self._free.pop()
        self._reserved.add(slot)
        at = slot * self.slot_bytes
        return slot, memoryview(self._memory)[at : at + self.slot_bytes], evicted

    def commit(self, slot: int, key: str, info: ChunkInfo) -> None:
        """Reserved `slot`, written, now holds whole chunk `key`."""
        self._reserved.remove(slot)
        if len(info.token_ids) != self.chunk_shape[2] or key in self._index:
            self._free.append(slot)
            raise TierError(f"cpu tier: {key} is not a whole chunk to commit, or is held")
        self._index[key] = (slot, info)

    def unreserve(self, slot: int) -> None:
        self._reserved.remove(slot)
        self._free.append(slot)

    def _make_room(self) -> list[Evicted]:
        """Free a slot if none is: the least recently used chunk not leased goes."""
        if self._free:
            return []
        old_key = self._victim()
        slot, old_info = self._index.pop(old_key)
        kept = self._view(slot, old_info).clone() if self.keep_evicted else None
        self._free.append(slot)
        return [Evicted(old_key, old_info, kept)]

    def _view(self, slot: int, info: ChunkInfo) -> torch.Tensor:
        """The part of `slot` that holds `info`'s tokens (a tail fills a slot's first part)."""
        return self._buffer[slot, :, :, : len(info.token_ids)]

    def _victim(self) -> str:
        """The least recently used key not leased."""
        leased = self.leased
        for key in self._index:
            if leased is None or not leased(key):
                return key
        raise TierError(f"cpu tier: all {self.num_slots} slots hold leased chunks")

    def load(self, key: str) -> StoredChunk | None:
        entry = self._index.get(key)
        if entry is None:
            return None
        self._index.move_to_end(key)
        return StoredChunk(entry[1], self._view(*entry))

    def remove(self, key: str) -> ChunkInfo | None:
        entry = self._index.pop(key, None)
        if entry is None:
            return None
        self._free.append(entry[0])
        return entry[1]

    def clear(self) -> list[tuple[str, ChunkInfo]]:
        dropped = [(k, info) for k, (_, info) in self._index.items()]
        for key, _ in dropped:
            self.remove(key)
        return dropped

    def entries(self) -> list[tuple[str, ChunkInfo]]:
        return [(k, info) for k, (_, info) in self._index.items()]

    def check_integrity(self) -> None:
        used = [slot for slot, _ in self._index.values()]
        assert len(set(used)) == len(used), "two chunks share a slot"
        assert not set(used) & set(self._free), "a used slot is also free"
        assert not self._reserved & (set(used) | set(self._free)), "a reserved slot is in use"
        assert len(used) + len(self._free) + len(self._reserved) == self.num_slots, "slot lost"
        assert len(set(self._free)) == len(self._free), "a slot is free twice"

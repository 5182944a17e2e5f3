"""The state a KV event stream describes: which blocks are held where, as of a seq.

A publisher keeps one (`ZmqEventPublisher`, fed with every batch it publishes, in seq order) and
answers snapshot requests from it, so a consumer that joins late, lost batches the ring no
longer holds, or rebuilt its index can get the whole current state of the instance: its engine's
cached blocks and its tiers' contents, as BlockStored events, fenced by the seq they are current
at. Applying the stream's later batches to the snapshot gives the truth again.

Blocks are counted per (medium, locality, ownership, block hash): a disk and a Redis are both
STORAGE, one LOCAL and one REMOTE, and each holds its own copy; a secondary tier's events
(`ownership` set, vLLM 0.33's KVCR) are a residency of their own beside the engine's (vLLM's
offloading connector and its snapshot recorder key them so too), so its removal never takes the
engine's copy away. A BlockStored adds one per hash, a BlockRemoved
takes one away, AllBlocksCleared (vLLM's, unscoped) forgets everything. A snapshot re-emits each
still-held block with the fields of the BlockStored that first announced it, consecutive held
blocks of one event as one event, and a block held twice (two blocks with one hash) twice.
"""

from __future__ import annotations

import threading
from collections import Counter
from queue import SimpleQueue

import zmq
from msgspec.structs import replace

from kvconnect.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

_Where = tuple[str | None, str | None, str | None]
"""(medium, locality, ownership): a tier, and whose residency (None: the engine's own)."""


class StreamState:
    def __init__(self) -> None:
        self.seq = -1
        """The last seq applied (-1: none)."""
        self._media: dict[_Where, dict[int | bytes, BlockStored]] = {}
        """(medium, locality, ownership) -> hash -> the BlockStored that announced it (no
        allocation per block)."""
        self._extra: Counter[tuple[_Where, int | bytes]] = Counter()
        """(where, hash) held more than once: the copies beyond the first."""

    def __len__(self) -> int:
        return sum(len(held) for held in self._media.values())

    def apply(self, seq: int, batch: KVEventBatch) -> None:
        media, extra = self._media, self._extra
        for ev in batch.events:
            kind = type(ev)
            if kind is BlockStored:
                where = (ev.medium, ev.locality, ev.ownership)  # type: ignore[union-attr]
                held = media.get(where)
                if held is None:
                    held = media[where] = {}
                for h in ev.block_hashes:  # type: ignore[union-attr]
                    if h in held:
                        extra[(where, h)] += 1
                    else:
                        held[h] = ev  # type: ignore[assignment]
            elif kind is BlockRemoved:
                where = (ev.medium, ev.locality, ev.ownership)  # type: ignore[union-attr]
                held = media.get(where)
                if held is None:
                    continue
                for h in ev.block_hashes:  # type: ignore[union-attr]
                    if extra and (where, h) in extra:
                        key = (where, h)
                        extra[key] -= 1
                        if not extra[key]:
                            del extra[key]
                    else:
                        held.pop(h, None)
            elif kind is AllBlocksCleared:
                media.clear()
                extra.clear()
        self.seq = seq

    def events(self) -> list[BlockStored]:
        """The held blocks as BlockStored events (parents before children within an event)."""
        out: list[BlockStored] = []
        for where, held in self._media.items():
            by_event: dict[int, tuple[BlockStored, list[int | bytes]]] = {}
            for h, ev in held.items():
                by_event.setdefault(id(ev), (ev, []))[1].append(h)
            for ev, hashes in by_event.values():
                position = {h: i for i, h in enumerate(ev.block_hashes)}
                indices = sorted(position[h] for h in hashes)
                start = prev = indices[0]
                for i in indices[1:]:
                    if i != prev + 1:
                        out.append(_part(ev, start, prev + 1))
                        start = i
                    prev = i
                out.append(_part(ev, start, prev + 1))
            for (m, h), n in self._extra.items():
                if m == where and h in held:
                    ev = held[h]
                    i = ev.block_hashes.index(h)
                    out.extend(_part(ev, i, i + 1) for _ in range(n))
        return out

    def check_integrity(self) -> None:
        for where, held in self._media.items():
            for h, ev in held.items():
                assert (ev.medium, ev.locality, ev.ownership) == where and h in ev.block_hashes
        for (where, h), n in self._extra.items():
            assert n >= 1 and h in self._media.get(where, {}), "a copy of a block not held"


def _part(ev: BlockStored, start: int, end: int) -> BlockStored:
    """Blocks start..end-1 of `ev` as an event of their own."""
    if start == 0 and end == len(ev.block_hashes):
        return ev
    bs = ev.block_size
    return replace(
        ev,
        block_hashes=ev.block_hashes[start:end],
        parent_block_hash=ev.parent_block_hash if start == 0 else ev.block_hashes[start - 1],
        token_ids=ev.token_ids[start * bs : end * bs],
        extra_keys=None if ev.extra_keys is None else ev.extra_keys[start:end],
        lookahead_token_ids=(
            None if ev.lookahead_token_ids is None else ev.lookahead_token_ids[start:end]
        ),
    )


class StateServer:
    """Serves a stream's state on `sock` (bound by the caller) from a thread of its own until
    `stop()`: the publisher hands it each batch it published (`observe`, any thread), which the
    thread folds into `state` in seq order between answers. A subclass answers (`_loop`) and
    starts the thread at the end of its `__init__`."""

    def __init__(self, sock: zmq.Socket[bytes], thread_name: str) -> None:
        self._sock = sock
        self._published: SimpleQueue[tuple[int, KVEventBatch]] = SimpleQueue()
        self._stop = threading.Event()
        self.state = StreamState()
        """What the stream says is held (kept by the server's thread; read it only there or
        after stop)."""
        self._thread = threading.Thread(target=self._loop, name=thread_name, daemon=True)

    def observe(self, seq: int, batch: KVEventBatch) -> None:
        """`batch` was published as `seq` (any thread; folded on the server's, in seq order)."""
        self._published.put((seq, batch))

    def stop(self, timeout: float = 1.0) -> None:
        self._stop.set()
        self._thread.join(timeout)

    def _loop(self) -> None:
        raise NotImplementedError

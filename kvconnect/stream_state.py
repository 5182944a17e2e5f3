"""The state a KV event stream describes: which blocks are held where, as of a seq.

A publisher keeps one (`ZmqEventPublisher`, fed with every batch it publishes, in seq order) and
answers snapshot requests from it, so a consumer that joins late, lost batches the ring no
longer holds, or rebuilt its index can get the whole current state of the instance: its engine's
cached blocks and its tiers' contents, as BlockStored events, fenced by the seq they are current
at. Applying the stream's later batches to the snapshot gives the truth again.

Blocks are counted per (medium, block hash): a BlockStored adds one per hash, a BlockRemoved
takes one away, AllBlocksCleared (vLLM's, unscoped) forgets everything. A snapshot re-emits each
still-held block with the fields of the BlockStored that first announced it, consecutive held
blocks of one event as one event, and a block held twice (two blocks with one hash) twice.
"""

from __future__ import annotations

from msgspec.structs import replace

from kvconnect.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch


class StreamState:
    def __init__(self) -> None:
        self.seq = -1
        """The last seq applied (-1: none)."""
        self._blocks: dict[tuple[str | None, int | bytes], list[object]] = {}
        """(medium, hash) -> [count, the BlockStored that announced it, its index there]."""

    def __len__(self) -> int:
        return len(self._blocks)

    def apply(self, seq: int, batch: KVEventBatch) -> None:
        blocks = self._blocks
        for ev in batch.events:
            kind = type(ev)
            if kind is BlockStored:
                medium = ev.medium  # type: ignore[union-attr]
                for i, h in enumerate(ev.block_hashes):  # type: ignore[union-attr]
                    entry = blocks.get((medium, h))
                    if entry is None:
                        blocks[(medium, h)] = [1, ev, i]
                    else:
                        entry[0] += 1  # type: ignore[operator]
            elif kind is BlockRemoved:
                medium = ev.medium  # type: ignore[union-attr]
                for h in ev.block_hashes:  # type: ignore[union-attr]
                    entry = blocks.get((medium, h))
                    if entry is not None:
                        if entry[0] == 1:
                            del blocks[(medium, h)]
                        else:
                            entry[0] -= 1  # type: ignore[operator]
            elif kind is AllBlocksCleared:
                blocks.clear()
        self.seq = seq

    def events(self) -> list[BlockStored]:
        """The held blocks as BlockStored events (parents before children within an event)."""
        held: dict[int, tuple[BlockStored, list[int]]] = {}
        extra: list[BlockStored] = []
        for count, ev, i in self._blocks.values():
            assert isinstance(ev, BlockStored) and isinstance(i, int) and isinstance(count, int)
            held.setdefault(id(ev), (ev, []))[1].append(i)
            extra.extend(_part(ev, i, i + 1) for _ in range(count - 1))
        out: list[BlockStored] = []
        for ev, indices in held.values():
            indices.sort()
            start = prev = indices[0]
            for i in indices[1:]:
                if i != prev + 1:
                    out.append(_part(ev, start, prev + 1))
                    start = i
                prev = i
            out.append(_part(ev, start, prev + 1))
        return out + extra

    def check_integrity(self) -> None:
        for (medium, h), (count, ev, i) in self._blocks.items():
            assert isinstance(ev, BlockStored) and isinstance(i, int) and isinstance(count, int)
            assert count >= 1 and ev.medium == medium and ev.block_hashes[i] == h


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

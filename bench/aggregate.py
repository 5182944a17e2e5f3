"""Per-step cost of folding TP workers' outputs and releasing their events by quorum.

Prints one line: for TP = 2, 4, 8 and 0, 100, 1000 events per worker (every rank reports the
same BlockStored events, as TP ranks do), the time per step of `KVOutputAggregator.aggregate`
+ `EventQuorum.update` + `take_events`, beside the limit measured in the same run: a bare
loop that encodes every reported event and counts it in a dict (the least work any exact
cross-rank match must do).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import msgspec

from kvconnect.connector import KVConnectorOutput
from kvconnect.connector.aggregator import KVOutputAggregator
from kvconnect.connector.events import EventQuorum, KVEventsWorkerMetadata
from kvconnect.connector.events import KVEventsWorkerMetadata as Meta
from kvconnect.events import BlockStored, KVCacheEvent


def per_call_us(fn: Callable[[], object], min_time: float = 0.2) -> float:
    best = float("inf")
    for _ in range(3):
        n, start = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - start) < min_time:
            fn()
            n += 1
        best = min(best, elapsed / n * 1e6)
    return best


def main() -> None:
    encode = msgspec.msgpack.Encoder().encode
    cells: dict[int, list[str]] = {}
    for num_events in (0, 100, 1000):
        row = []
        for tp in (2, 4, 8):
            events: list[KVCacheEvent] = [
                BlockStored([i], None, list(range(16)), 16, None, "CPU", None)
                for i in range(num_events)
            ]
            outputs: list[KVConnectorOutput | None] = [
                KVConnectorOutput(
                    kv_connector_worker_meta=Meta.from_rank(r, events) if events else None
                )
                for r in range(tp)
            ]
            aggregator = KVOutputAggregator(tp)
            quorum = EventQuorum(tp)

            def one_step(
                aggregator: KVOutputAggregator = aggregator,
                quorum: EventQuorum = quorum,
                outputs: list[KVConnectorOutput | None] = outputs,
                num_events: int = num_events,
            ) -> None:
                out = aggregator.aggregate(outputs)
                meta = out.kv_connector_worker_meta
                assert meta is None or isinstance(meta, KVEventsWorkerMetadata)
                quorum.update(meta)
                assert len(quorum.take_events()) == num_events

            def bare(
                outputs: list[KVConnectorOutput | None] = outputs,
            ) -> None:
                counts: dict[bytes, int] = {}
                for out in outputs:
                    meta = out.kv_connector_worker_meta if out else None
                    for evs in meta.events_by_rank.values() if meta else ():  # type: ignore[attr-defined]
                        for e in evs:
                            key = encode(e)
                            counts[key] = counts.get(key, 0) + 1

            ours, limit = per_call_us(one_step), per_call_us(bare)
            row.append(f"{ours:.0f}/{limit:.0f}")
        cells[num_events] = row
    print(
        "aggregate (us per step, ours/bare-count limit, TP=2,4,8): "
        + "; ".join(f"{n} ev/worker: {' '.join(row)}" for n, row in cells.items())
    )


if __name__ == "__main__":
    main()

"""Folding the N tensor-parallel workers' outputs of a step into one (`KVOutputAggregator`).

Rules, as vLLM's:
- finished_sending / finished_recving: each id counts down from the expected count (every
  worker by default) across steps; it is emitted in the step its last report arrives. A
  positive `expected_finished_count` in an output changes the count for ids not yet tracked;
  ids already counting keep theirs.
- invalid_block_ids: union.
- kv_connector_stats: merged with `aggregate` in rank order.
- kv_connector_worker_meta: folded with `aggregate` in rank order, skipping None.
"""

from __future__ import annotations

from kvconnect.connector.base import KVConnectorBase
from kvconnect.messages import KVConnectorOutput, KVConnectorStats, KVConnectorWorkerMetadata


class KVOutputAggregator:
    """Stateful across steps: holds the remaining report counts of finished ids."""

    def __init__(self, expected_finished_count: int) -> None:
        if expected_finished_count < 1:
            raise ValueError(f"expected_finished_count must be >= 1, got {expected_finished_count}")
        self._expected_finished_count = expected_finished_count
        self._send_remaining: dict[str, int] = {}
        self._recv_remaining: dict[str, int] = {}

    @classmethod
    def from_connector(cls, connector: KVConnectorBase, world_size: int) -> KVOutputAggregator:
        return cls(connector.get_finished_count() or world_size)

    @property
    def expected_finished_count(self) -> int:
        return self._expected_finished_count

    @property
    def num_pending(self) -> int:
        """Ids reported by some but not yet all workers."""
        return len(self._send_remaining) + len(self._recv_remaining)

    def _count_down(self, ids: set[str] | None, remaining: dict[str, int], done: set[str]) -> None:
        for req_id in ids or ():
            left = remaining.get(req_id, self._expected_finished_count) - 1
            if left == 0:
                remaining.pop(req_id, None)
                done.add(req_id)
            else:
                remaining[req_id] = left

    def aggregate(self, outputs: list[KVConnectorOutput | None]) -> KVConnectorOutput:
        """One output for the step from the workers' outputs, in rank order (None: nothing)."""
        sending: set[str] = set()
        recving: set[str] = set()
        invalid: set[int] = set()
        stats: KVConnectorStats | None = None
        meta: KVConnectorWorkerMetadata | None = None
        for out in outputs:
            if out is None:
                continue
            if out.expected_finished_count > 0:
                self._expected_finished_count = out.expected_finished_count
            self._count_down(out.finished_sending, self._send_remaining, sending)
            self._count_down(out.finished_recving, self._recv_remaining, recving)
            invalid |= out.invalid_block_ids
            if out.kv_connector_stats is not None:
                if stats is None:
                    stats = out.kv_connector_stats
                elif type(stats) is not type(out.kv_connector_stats):
                    raise TypeError(
                        f"workers report different stats types: {type(stats).__name__} and "
                        f"{type(out.kv_connector_stats).__name__}"
                    )
                else:
                    stats = stats.aggregate(out.kv_connector_stats)
            if out.kv_connector_worker_meta is not None:
                meta = (
                    out.kv_connector_worker_meta
                    if meta is None
                    else meta.aggregate(out.kv_connector_worker_meta)
                )
        return KVConnectorOutput(
            finished_sending=sending or None,
            finished_recving=recving or None,
            kv_connector_stats=stats,
            kv_connector_worker_meta=meta,
            invalid_block_ids=invalid,
            expected_finished_count=self._expected_finished_count,
        )

"""The peer suite's world in one object: what conftest.py starts once per session and every
test talks to."""

from __future__ import annotations

from dataclasses import dataclass

from tests_peers.instances import Engine, Instance, Streams
from tests_peers.peers import Dynamo, VllmRouter
from tests_peers.support import wait_for


@dataclass
class Lab:
    """Everything the tests talk to (see conftest.py)."""

    a: Instance
    c: Instance
    d: Instance
    r: Instance
    engine: Engine
    streams: Streams
    router: VllmRouter
    dynamo: Dynamo
    engine_url: str
    """The name vllm-router knows the engine by (a second name of instance A)."""
    dynamo_ids: dict[str, int]
    """Dynamo's worker id of each instance (and of the engine)."""

    def dynamo_id(self, name: str) -> int:
        return self.dynamo_ids[name]

    def dynamo_caught_up(self) -> None:
        """Until Dynamo has applied every GPU store, removal and clear that this process has
        seen on the streams, by Dynamo's own counters (both sides recounted until they agree,
        so neither may lag). It applies a worker's events in stream order, so by then it has
        applied the tiers' events among them too."""
        seen: list[tuple[dict[str, int], dict[str, int]]] = []

        def caught_up() -> bool | None:
            self.dynamo.proc.check_running("Dynamo's indexer")
            seen[:] = [(self.streams.num_events(), self.dynamo.num_applied())]
            return True if seen[0][0] == seen[0][1] else None

        wait_for(
            "Dynamo to apply what the streams carried",
            caught_up,
            detail=lambda: f"(streams, Dynamo): {seen}; its faults: {self.dynamo.faults()}",
        )

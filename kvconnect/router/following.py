"""The instances' event streams, followed into the router's index on a thread of its own.

    follow = Follower(instances, index, lock, health, changes, curve)
    follow.start()                  the thread: every stream (with replay and snapshots) into
                                    the index, under `lock`; `changes` woken as it changes
    await follow.wait_synced()      until every instance in rotation is synced (its stream's
                                    snapshot and replay applied), once after the start
    follow.close()

The thread is the index's only writer but the stale marks (`Router.check_cached`); it keeps,
per instance, the seq its index state includes (`last_seq`) and whether its whole state has
come (`synced`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time

from kvconnect.router.changes import Changes
from kvconnect.router.health import HealthChecker
from kvconnect.router.index import BlockIndex
from kvconnect.router.instances import Instances
from kvconnect.stream.curve import CurveClientKeys
from kvconnect.stream.subscriber import KVEventSubscriber, ReceivedBatch, StreamSnapshot

logger = logging.getLogger(__name__)

SYNC_WAIT_S = 10.0
"""From the router's start, how long a request waits for every instance in rotation to be
synced (its stream's snapshot and replay applied: `wait_synced`): no decision is made
from a partial index unless an instance's state has not come by then."""
CONNECT_WAIT_S = 0.3
"""An instance whose event stream is not reached this long after the start (and after the
last handshake: they run one at a time) is not waited for: it connects later, or never (a
reachable publisher's connection is up in milliseconds)."""
SYNC_POLL_S = 0.1


class Follower:
    def __init__(
        self,
        instances: Instances,
        index: BlockIndex,
        lock: threading.Lock,
        health: HealthChecker,
        changes: Changes,
        curve: CurveClientKeys | None = None,
    ) -> None:
        """`curve`: keys for event streams with CURVE on (stream/curve.py); None reads
        plain ones."""
        self.instances = instances
        self.index = index
        """Applied to under `lock`, the lock the router scores under."""
        self.lock = lock
        self.health = health
        """Told when a stream's instance is heard from (or gone quiet)."""
        self.changes = changes
        """Woken after each batch applied (`Bursts` waits on it)."""
        self.curve = curve
        # The subscriber names a stream by the endpoint it reads; that maps to one instance.
        self._name_by_endpoint = {i.events_endpoint: i.name for i in instances}
        self.last_seq: dict[str, int] = {}
        """Per instance, the seq of the last batch (or snapshot) its index state includes."""
        self.synced: set[str] = set()
        """Instances whose stream state (snapshot, replay) the index has applied whole."""
        self.decisions_unsynced = 0
        """Decisions made while an instance in rotation was not synced (`SYNC_WAIT_S` over)."""
        self.subscriber: KVEventSubscriber | None = None
        self.started = 0.0
        self._thread: threading.Thread | None = None
        self._closing = False

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("Router.start() called twice")
        self.subscriber = KVEventSubscriber(
            [i.events_endpoint for i in self.instances],
            [i.replay_endpoint for i in self.instances],
            start_seq=0,
            snapshots=True,  # a router that (re)starts, or loses batches, gets the whole state
            curve=self.curve,
        )
        self.started = time.monotonic()
        self._thread = threading.Thread(target=self._follow, name="router-events", daemon=True)
        self._thread.start()

    def _follow(self) -> None:
        sub = self.subscriber
        assert sub is not None
        everyone = len(self.instances)
        while not self._closing:
            # Until every stream is synced, a handshake that queued nothing must be seen too
            # (for SYNC_WAIT_S: a stream never reached must not keep the thread waking up);
            # then the thread sleeps until a batch comes (no wake-ups of its own).
            syncing = len(self.synced) < everyone
            polling = syncing and time.monotonic() - self.started < SYNC_WAIT_S
            item = sub.recv(SYNC_POLL_S if polling else None)
            if item is not None:
                name = self._name_by_endpoint[item.stream.endpoint]
                with self.lock:
                    self.index.apply_item(name, item)
                    if isinstance(item, ReceivedBatch | StreamSnapshot):
                        self.last_seq[name] = item.seq
            if syncing and not sub.num_queued:  # all a handshake queued is applied
                fresh = {self._name_by_endpoint[e] for e in sub.caught_up} - self.synced
                if fresh:
                    with self.lock:
                        self.synced |= fresh
                    logger.info("router: synced with %s", ", ".join(sorted(fresh)))
                    self.changes.wake()
                    continue
            if item is not None and self.changes:
                self.changes.wake()

    def is_synced(self) -> bool:
        """Every instance in rotation is synced, or cannot be: its stream is not reached
        CONNECT_WAIT_S after the start (one that is down, or comes later, syncs from its
        first handshake)."""
        synced = self.synced
        if len(synced) == len(self.instances):
            return True
        sub = self.subscriber
        if sub is None:
            return False
        # handshakes run one after another: an endpoint not reached yet may be next in line
        quiet = time.monotonic() - max(self.started, sub.last_handshake)
        late = not sub.handshaking and quiet > CONNECT_WAIT_S
        return all(
            i.name in synced
            or not self.health.is_up(i.name)
            or (late and i.events_endpoint not in sub.connected)
            for i in self.instances
        )

    async def wait_synced(self) -> bool:
        """Until `is_synced` (True), or until SYNC_WAIT_S after the start (False, and the
        decision then made is counted: `decisions_unsynced`): a router that starts (or
        restarts) while traffic flows makes its first decision from the whole index."""
        while not self.is_synced():
            left = self.started + SYNC_WAIT_S - time.monotonic()
            if left <= 0:
                self.decisions_unsynced += 1
                return False
            future = self.changes.future()
            if self.is_synced():
                break
            # an instance leaving rotation ends the wait too: look again now and then
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(future, min(left, SYNC_POLL_S * 5))
        return True

    def close(self) -> None:
        self._closing = True
        if self.subscriber is not None:
            self.subscriber.close()
        if self._thread is not None:
            self._thread.join(timeout=2)

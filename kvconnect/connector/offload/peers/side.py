"""A worker rank's peer half: it serves the rank's local chunks to the same rank of other
instances, and pulls chunks from a configured source for the worker's loads.

    side = PeerSide(config, keys, placement, world_size, namespace, served)   serving now
    for data in side.pull(source, wanted, into):   each chunk checked, or None (counted):
        ... scatter data ...                       a chunk's memory is valid until the next
    side.release(source, lease_id)                 P/D: the lease at the source ends
    side.close()

Threads and locks. The server runs on threads of its own (tcp.py: an accept thread and one
per connection; curve.py: one) and calls `served`, the worker's callbacks, which hold the
worker's tier locks themselves. `pull` and `release` run on the caller's thread: the worker's
pull threads, never its step thread or its I/O thread, so a slow or hostile source holds one
pull thread for one pull's deadline (`timeout_s` plus its bytes at `min_rate_mib_s`) and
nothing else. Each calling thread has its own clients (one per source: a client is not
thread-safe) and its own receive buffers. A chunk's payload is read straight into a cpu-tier
slot `into` reserves (not evictable, read by no one, until `into.keep` commits it after the
caller has used it), else into those buffers; a chunk that fails its checks gives its slot
back, so a forging peer gets nothing into the tier.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Generator
from typing import Protocol

import torch

from kvconnect.connector.offload.common import ChunkInfo, PeerConfig
from kvconnect.connector.offload.peers.protocol import (
    REPLY_SLACK,
    Deadline,
    Hello,
    PeerClient,
    RecvBuffers,
    Served,
    payload_bytes,
)
from kvconnect.connector.offload.peers.transport import PeerKeys, PeerServer, connect, serve
from kvconnect.connector.offload.tiers.base import (
    IntegrityError,
    StoredChunk,
    TierError,
    TierPlacement,
)
from kvconnect.transfer_params import endpoint

logger = logging.getLogger(__name__)


class PullTarget(Protocol):
    """Where pulled chunks go: the worker's first local tier, and its counters."""

    def take(self, key: str, n: int) -> memoryview | None:
        """A slot of `n` bytes reserved for chunk `key` to be received into, or None."""
        ...

    def keep(self, key: str, info: ChunkInfo, data: torch.Tensor) -> None:
        """Chunk `key`, checked and used, is now the tier's (its slot committed, or put)."""
        ...

    def drop(self, key: str) -> None:
        """Chunk `key` failed: its slot, if one was reserved, goes back."""
        ...

    def count(self, name: str, n: int = 1) -> None: ...


class PeerSide:
    def __init__(
        self,
        config: PeerConfig,
        keys: PeerKeys,
        placement: TierPlacement,
        namespace: str,
        served: Served,
    ) -> None:
        self.config, self.keys, self.placement, self.namespace = config, keys, placement, namespace
        self.rank, self.world_size = placement.rank, placement.world_size
        self.chunk_bytes = payload_bytes(placement)
        hello = Hello(placement.world_size, placement.rank, namespace)
        self.server: PeerServer = serve(config, hello, served, keys)
        self.make_buffers: Callable[[int], RecvBuffers] = RecvBuffers
        """Each pull thread's receive buffers, made on its first pull."""
        self._mine = threading.local()  # each pull thread's clients and buffers
        self._clients: list[PeerClient] = []  # every thread's, to close at the end
        self._lock = threading.Lock()

    def _client(self, source: tuple[str, int]) -> PeerClient:
        clients: dict[tuple[str, int], PeerClient] | None = getattr(self._mine, "clients", None)
        if clients is None:
            clients = self._mine.clients = {}
            self._mine.buffers = self.make_buffers(self.chunk_bytes)
        client = clients.get(source)
        if client is None:  # one per configured source this thread pulls from
            client = clients[source] = connect(
                self.config,
                source,
                self.rank,
                self.world_size,
                self.namespace,
                self.keys,
                self.chunk_bytes,
            )
            with self._lock:
                self._clients.append(client)
        return client

    def pull(
        self,
        source: tuple[str, int],
        wanted: list[tuple[str, ChunkInfo]],
        into: PullTarget,
    ) -> Generator[torch.Tensor | None]:
        """Each of `wanted` from this rank's counterpart at `source`, in order, a few requests
        ahead, each checked as a shared tier's entry is; None for one that failed (logged,
        counted: it is recomputed). A source that stops answering is logged once a pull."""
        client = self._client(source)
        sink = _Sink(into, self._mine.buffers)
        deadline = Deadline.for_bytes(
            self.config.timeout_s,
            len(wanted) * (self.chunk_bytes + REPLY_SLACK),
            self.config.min_rate_mib_s,
        )
        pulls = client.fetch_many(wanted, self.placement, deadline, sink)
        logged: TierError | None = None
        name = endpoint(source)
        try:
            for (key, info), got in zip(wanted, pulls, strict=True):
                if isinstance(got, StoredChunk):
                    data = got.data
                    into.count("peer_hits")
                    into.count("peer_bytes_loaded", data.numel() * data.element_size())
                    yield data  # used by the caller before it asks for the next
                    sink.reserved.discard(key)
                    into.keep(key, info, data)
                    continue
                sink.reserved.discard(key)
                into.drop(key)
                if isinstance(got, IntegrityError):
                    logger.warning("offload: peer %s: integrity miss: %s", name, got)
                    into.count("num_integrity_misses")
                    into.count("num_peer_integrity_misses")
                elif isinstance(got, TierError):
                    if got is not logged:
                        logger.warning("offload: peer %s: %s", name, got)
                        logged = got
                    into.count("num_peer_errors")
                else:
                    into.count("num_peer_misses")
                yield None
        finally:
            pulls.close()
            for key in sink.reserved:  # a pull abandoned half-way: its slots go back
                into.drop(key)

    def release(self, source: tuple[str, int], lease_id: str) -> None:
        """End lease `lease_id` at `source` (after the load is reported: nothing waits for
        this); a failure only lets the lease expire there."""
        try:
            self._client(source).release(lease_id, Deadline(self.config.timeout_s))
        except TierError as e:
            logger.info("offload: peer %s: release of %r: %s", endpoint(source), lease_id, e)

    def close(self) -> None:
        """Stop serving, then close every pull thread's clients (call once they are done)."""
        self.server.close()
        with self._lock:
            clients, self._clients = self._clients, []
        for client in clients:
            client.close()


class _Sink:
    """A pull's `PayloadSink`: a whole chunk into a slot `into` reserves, else the thread's
    receive buffers. Remembers the slots not yet kept or dropped."""

    def __init__(self, into: PullTarget, buffers: RecvBuffers) -> None:
        self.into, self.buffers = into, buffers
        self.reserved: set[str] = set()

    def take(self, key: str, n: int) -> memoryview | None:
        view = self.into.take(key, n)
        if view is None:
            return self.buffers.take(key, n)
        self.reserved.add(key)
        return view

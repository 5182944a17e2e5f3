"""The scheduler half's view of peers: which peer a request names, and how much of its prefix
that peer holds (asked off the step thread, as a shared tier is: `lookup.PrefixLookup`).

    kv_transfer_params = {"remote_kv_source": {"host": "10.0.0.7", "port": 7100}}
    peers.source_of(request)      ("10.0.0.7", 7100), or None: none named, or not allowed
    peers.ask(request_id, start, chunks, source)   as PrefixLookup.ask, at that peer
    peers.forget(request_id)

A request may name only a host listed in the peer config's `sources` (as it is written
there): anything else is not contacted, logged once per host, and the prompt is computed.
Every rank of the source must hold a chunk for it to count (rank r serves on port + r), and a
source of another TP size is refused with a line naming both.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from kvconnect.connector.base import ConnectorRequest
from kvconnect.connector.offload.common import PeerConfig
from kvconnect.connector.offload.lookup import PrefixLookup
from kvconnect.connector.offload.tiers.base import TierError
from kvconnect.connector.offload.tiers.peer import PeerClient

logger = logging.getLogger(__name__)

MAX_PEERS = 16
"""Peers asked at once; the least recently asked one's lookup closes beyond this."""


def named_source(params: dict[str, Any] | None) -> tuple[str, int] | None:
    """`remote_kv_source`'s (host, port) in a request's `kv_transfer_params` (checked at the
    HTTP boundary; an engine's caller in code gets a ValueError for a malformed one)."""
    if not params or params.get("remote_kv_source") is None:
        return None
    source = params["remote_kv_source"]
    host = source.get("host") if isinstance(source, dict) else None
    port = source.get("port") if isinstance(source, dict) else None
    if not isinstance(host, str) or not host or not isinstance(port, int) or not 0 < port < 65536:
        raise ValueError(f"kv_transfer_params.remote_kv_source {source!r}: needs host and port")
    return host, port


class PeerHolder:
    """A peer asked, per chunk, whether every one of its ranks holds it."""

    def __init__(
        self,
        host: str,
        port: int,
        world_size: int,
        namespace: str,
        config: PeerConfig,
        mac_key: bytes | None,
    ) -> None:
        self.clients = [
            PeerClient(
                f"tcp://{host}:{port + r}",
                world_size,
                r,
                namespace,
                mac_key=mac_key,
                timeout_s=config.timeout_s,
            )
            for r in range(world_size)
        ]
        self._greeted = False

    def num_held_prefix(self, chunks: Sequence[Sequence[str]]) -> int:
        if not self._greeted:
            for client in self.clients:
                try:
                    client.hello()
                except ValueError as e:  # another TP size or model: never a source
                    raise TierError(str(e)) from None
            self._greeted = True
        num = len(chunks)
        for r, client in enumerate(self.clients):
            num = min(num, client.held_prefix([keys[r] for keys in chunks[:num]]))
            if num == 0:
                break
        return num

    def close(self) -> None:
        for client in self.clients:
            client.close()


class PeerSources:
    def __init__(
        self, config: PeerConfig, world_size: int, namespace: str, mac_key: bytes | None
    ) -> None:
        self.config = config
        self.world_size, self.namespace, self.mac_key = world_size, namespace, mac_key
        self._lookups: OrderedDict[tuple[str, int], PrefixLookup] = OrderedDict()
        self._refused: set[str] = set()
        self._lock = threading.Lock()

    def source_of(self, request: ConnectorRequest) -> tuple[str, int] | None:
        """The peer `request` names, if it may be asked."""
        source = named_source(request.kv_transfer_params)
        if source is None:
            return None
        if source[0] not in self.config.sources:
            if source[0] not in self._refused and len(self._refused) < 1024:
                self._refused.add(source[0])
                logger.warning(
                    "offload: remote_kv_source host %r is not in the peer config's sources "
                    "%s: not contacted, its requests compute their prompts",
                    source[0],
                    list(self.config.sources),
                )
            return None
        return source

    def ask(
        self,
        request_id: str,
        start: int,
        chunks: Sequence[Sequence[str]],
        source: tuple[str, int],
    ) -> int | None:
        lookup = self._lookups.get(source)
        if lookup is None:
            holder = PeerHolder(*source, self.world_size, self.namespace, self.config, self.mac_key)
            lookup = self._lookups[source] = PrefixLookup(
                holder, what=f"peer {source[0]}:{source[1]}"
            )
            if len(self._lookups) > MAX_PEERS:
                _, old = self._lookups.popitem(last=False)
                _close(old)
        self._lookups.move_to_end(source)
        return lookup.ask(request_id, start, chunks)

    def forget(self, request_id: str) -> None:
        for lookup in self._lookups.values():
            lookup.forget(request_id)

    def drain(self, timeout: float = 10.0) -> bool:
        return all(lookup.drain(timeout) for lookup in self._lookups.values())

    def shutdown(self) -> None:
        for lookup in self._lookups.values():
            _close(lookup)
        self._lookups.clear()


def _close(lookup: PrefixLookup) -> None:
    lookup.shutdown()
    lookup.tier.close()

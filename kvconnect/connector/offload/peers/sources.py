"""The scheduler half's view of peers: which configured peer a request names, and how much of
its prefix every rank there holds, asked off the step thread (`lookup.PrefixLookup`, as a
shared tier is asked).

    peers = PeerSources(peer_config, world_size, namespace, keys)
    peers.source_of(request)    a `Named` (the peer, the lease to release, the chunks a
                                prefill listed), or None: none named, not a configured peer,
                                or malformed (logged once; the prompt is computed)
    peers.ask(request_id, start, chunks, source)   as PrefixLookup.ask, at that peer
    peers.forget(request_id)
    peers.shutdown()

A request names peers, never endpoints: only the peer config's `sources` are ever contacted
(`transfer_params.check_source`). Each configured peer gets one lookup (its own thread) the
first time it is named, kept until shutdown, so nothing is ever joined on the step thread and
the threads are bounded by the config. A lookup asks every rank of the source (rank r on port
+ r) within one deadline, `timeout_s`, for its greeting and its answers together; a chunk
counts only if every rank holds it. A source that does not answer in time is backed off
(tiers/backoff.py): its next questions answer 0 at once until a probe gets through, so
requests naming a dead peer compute at once instead of each waiting out the timeout.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from kvconnect.connector.base import ConnectorRequest
from kvconnect.connector.offload.common import PeerConfig
from kvconnect.connector.offload.lookup import PrefixLookup
from kvconnect.connector.offload.peers.protocol import Deadline
from kvconnect.connector.offload.peers.transport import PeerKeys, connect
from kvconnect.connector.offload.tiers.backoff import Backoff
from kvconnect.connector.offload.tiers.base import TierError, TierUnavailable
from kvconnect.transfer_params import Named, check_source, endpoint, parse, source_of

logger = logging.getLogger(__name__)

BACKOFF_S = 0.5
"""After a source did not answer: questions to it answer 0 at once for this long, then one
probes (doubling while it fails, up to MAX_BACKOFF_S)."""
MAX_BACKOFF_S = 30.0
MAX_LOGGED = 1024
"""Distinct refusals logged (each once)."""


class PeerHolder:
    """A configured peer asked, per chunk, whether every one of its ranks holds it."""

    def __init__(
        self,
        config: PeerConfig,
        addr: tuple[str, int],
        world_size: int,
        namespace: str,
        keys: PeerKeys,
    ) -> None:
        self.timeout_s = config.timeout_s
        self.name = endpoint(addr)
        self.clients = [
            connect(config, addr, r, world_size, namespace, keys) for r in range(world_size)
        ]
        self.backoff = Backoff(BACKOFF_S, MAX_BACKOFF_S)

    def num_held_prefix(self, chunks: Sequence[Sequence[str]]) -> int:
        if not self.backoff.allow():
            raise TierUnavailable(f"peer {self.name} did not answer lately: not asked")
        deadline = Deadline(self.timeout_s)  # every rank's greeting and answer together
        num = len(chunks)
        try:
            for r, client in enumerate(self.clients):
                num = min(num, client.held_prefix([keys[r] for keys in chunks[:num]], deadline))
                if num == 0:
                    break
        except TierUnavailable as e:  # a silent peer: logged (a warning) once, then backed off
            self.backoff.failed()
            raise TierError(str(e)) from None
        self.backoff.succeeded()
        return num

    def close(self) -> None:
        for client in self.clients:
            client.close()


class PeerSources:
    def __init__(self, config: PeerConfig, world_size: int, namespace: str, keys: PeerKeys) -> None:
        self.config = config
        self.world_size, self.namespace, self.keys = world_size, namespace, keys
        self.sources = config.source_addrs
        self._lookups: dict[tuple[str, int], PrefixLookup] = {}
        self._refused: set[str] = set()

    def source_of(self, request: ConnectorRequest) -> Named | None:
        """The configured peer `request` names, if any: anything else is logged once and its
        prompt computed (vLLM's server passes kv_transfer_params on unchecked)."""
        params = request.kv_transfer_params
        if not params:
            return None
        try:
            named = source_of(parse(params, strict=False), self.config.pd)
            if named is not None:
                check_source(named, self.sources)
        except ValueError as e:
            if len(self._refused) < MAX_LOGGED and str(e) not in self._refused:
                self._refused.add(str(e))
                logger.warning(
                    "offload: request %s: %s; computing its prompt", request.request_id, e
                )
            return None
        return named

    def ask(
        self,
        request_id: str,
        start: int,
        chunks: Sequence[Sequence[str]],
        source: tuple[str, int],
    ) -> int | None:
        """As `PrefixLookup.ask`, at configured peer `source`."""
        lookup = self._lookups.get(source)
        if lookup is None:
            if source not in self.sources:
                raise ValueError(f"peer {endpoint(source)} is not configured")
            holder = PeerHolder(self.config, source, self.world_size, self.namespace, self.keys)
            lookup = self._lookups[source] = PrefixLookup(holder, what=f"peer {holder.name}")
        return lookup.ask(request_id, start, chunks)

    def forget(self, request_id: str) -> None:
        for lookup in self._lookups.values():
            lookup.forget(request_id)

    def drain(self, timeout: float = 10.0) -> bool:
        return all(lookup.drain(timeout) for lookup in self._lookups.values())

    def shutdown(self) -> None:
        for lookup in self._lookups.values():
            lookup.shutdown()
            lookup.tier.close()
        self._lookups.clear()

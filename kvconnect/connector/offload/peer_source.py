"""The scheduler half's view of peers: which peer a request names, and how much of its prefix
that peer holds (asked off the step thread, as a shared tier is: `lookup.PrefixLookup`).

    kv_transfer_params = {"remote_kv_source": {"host": "10.0.0.7", "port": 7100}}
      or, from a prefill instance's answer (P/D, NixlConnector's handshake):
    kv_transfer_params = {"do_remote_prefill": True, "remote_host": "10.0.0.7",
                          "remote_port": 7100, "remote_request_id": "...",
                          "remote_chunk_hashes": ["9f..", ...], ...}
    peers.source_of(request)      a Named: (host, port), the lease to release, the chunks
                                  the source says it holds; None: none named, not allowed,
                                  or malformed (logged; the prompt is computed)
    peers.ask(request_id, start, chunks, source)   as PrefixLookup.ask, at that peer
    peers.forget(request_id)

A request may name only a host listed in the peer config's `sources` (as it is written
there): anything else is not contacted, logged once per host, and the prompt is computed.
Every rank of the source must hold a chunk for it to count (rank r serves on port + r), and a
source of another TP size is refused with a line naming both.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence

from kvconnect.connector.base import ConnectorRequest
from kvconnect.connector.offload.common import PeerConfig
from kvconnect.connector.offload.lookup import PrefixLookup
from kvconnect.connector.offload.tiers.base import TierError, TierUnavailable
from kvconnect.connector.offload.tiers.peer import PeerClient, shared_curve
from kvconnect.transfer_params import Named, check_source, parse, source_of

logger = logging.getLogger(__name__)

MAX_PEERS = 16
"""Peers asked at once; the least recently asked one's lookup closes beyond this."""


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
        keys = shared_curve(config.curve_secret_key_file)
        curve = keys[1] if keys else None
        self.clients = [
            PeerClient(
                f"tcp://{host}:{port + r}",
                world_size,
                r,
                namespace,
                mac_key=mac_key,
                timeout_s=config.timeout_s,
                curve=curve,
            )
            for r in range(world_size)
        ]
        self._greeted = False

    def num_held_prefix(self, chunks: Sequence[Sequence[str]]) -> int:
        try:
            return self._num_held_prefix(chunks)
        except TierUnavailable as e:  # a silent peer: no back-off logged it, so warn
            raise TierError(str(e)) from None

    def _num_held_prefix(self, chunks: Sequence[Sequence[str]]) -> int:
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
        shared_curve(config.curve_secret_key_file)  # a wrong file fails at start, named
        self.sources = config.source_addrs
        self._lookups: OrderedDict[tuple[str, int], PrefixLookup] = OrderedDict()
        self._refused: set[str] = set()

    def source_of(self, request: ConnectorRequest) -> Named | None:
        """The configured peer `request` names, if any (anything else is logged once and its
        prompt computed: vLLM's server passes kv_transfer_params on unchecked)."""
        params = request.kv_transfer_params
        if not params:
            return None
        try:
            named = source_of(parse(params, strict=False), self.config.pd)
            if named is not None:
                check_source(named, self.sources)
        except ValueError as e:
            if len(self._refused) < 1024 and str(e) not in self._refused:
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

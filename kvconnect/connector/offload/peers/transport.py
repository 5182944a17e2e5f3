"""Which transport a peer config speaks, and the one surface both give their users.

    keys = PeerKeys.from_config(offload_config)   the deployment's peer secrets, read once
    server = serve(peer_config, hello, served, keys)      tcp.py, or curve.py with CURVE
    client = connect(peer_config, (host, port), rank, world_size, namespace, keys, payload)
    client.held_prefix(keys, deadline) / client.release(lease, deadline)
    client.fetch_many(wanted, placement, deadline, sink) / client.close()

Signing. Peer traffic is signed (connections prove the key, chunks carry an HMAC) whenever the
deployment has a secret for it: the peer config's `hmac_key_file`, else a tier's (the same
deployment secret, on every instance), else one derived from the CURVE certificate every peer
holds. Without any, chunks are checked against what was asked for but a peer that can reach
the port can serve forged KV under the right tokens: the scheduler half warns at start.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Protocol

from kvconnect.connector.offload.common import OffloadConfig, PeerConfig
from kvconnect.connector.offload.peers.curve import CurvePeerClient, CurvePeerServer, shared_curve
from kvconnect.connector.offload.peers.protocol import Hello, PeerClient, Served
from kvconnect.connector.offload.peers.tcp import TcpPeerClient, TcpPeerServer
from kvconnect.connector.offload.tiers.base import (
    read_mac_key,
)
from kvconnect.stream.curve import CurveClientKeys, CurveServerKeys


class PeerServer(Protocol):
    endpoint: str
    port: int

    def close(self) -> None: ...


@dataclass(frozen=True)
class PeerKeys:
    """The deployment's secrets for peer traffic."""

    mac: bytes | None
    """Signs connections and chunks (None: unsigned)."""
    curve: tuple[CurveServerKeys, CurveClientKeys] | None
    """The shared CURVE certificate (None: plain TCP)."""

    @classmethod
    def from_config(cls, config: OffloadConfig) -> PeerKeys:
        """Read (and checked: `ValueError` naming the file) from `config`'s peer settings."""
        peer = config.peer
        if peer is None:
            return cls(None, None)
        curve = shared_curve(peer.curve_secret_key_file)
        tier_keys = [t.hmac_key_file for t in config.tiers if t.hmac_key_file]
        if peer.hmac_key_file:
            mac: bytes | None = read_mac_key(peer.hmac_key_file)
        elif tier_keys:
            mac = read_mac_key(tier_keys[0])
        elif curve is not None:  # every peer holds the certificate's secret: key it off that
            mac = hashlib.sha256(b"kvconnect-peer-hmac\0" + curve[0].secret).digest()
        else:
            mac = None
        return cls(mac, curve)


def serve(config: PeerConfig, hello: Hello, served: Served, keys: PeerKeys) -> PeerServer:
    """Rank `hello.rank`'s server, on the peer port + rank (`ValueError` naming the address
    if it cannot bind)."""
    port = config.port + hello.rank
    if keys.curve is not None:
        return CurvePeerServer(config.host, port, hello, served, keys.curve[0], config.timeout_s)
    return TcpPeerServer(
        config.host,
        port,
        hello,
        served,
        keys.mac,
        config.timeout_s,
        config.min_rate_mib_s,
        config.max_connections,
    )


def connect(
    config: PeerConfig,
    addr: tuple[str, int],
    rank: int,
    world_size: int,
    namespace: str,
    keys: PeerKeys,
    max_payload: int = 1 << 30,
) -> PeerClient:
    """A client of rank `rank` of the peer at `addr` (its host and rank 0's port): nothing is
    sent until it is used."""
    host, port = addr[0], addr[1] + rank
    if keys.curve is not None:
        return CurvePeerClient(
            host, port, world_size, rank, namespace, keys.mac, keys.curve[1], max_payload
        )
    return TcpPeerClient(host, port, world_size, rank, namespace, keys.mac, max_payload)

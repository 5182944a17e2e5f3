"""`kv_transfer_params`: a request's instructions to the KV connector, as vLLM carries them, and
what kvconnect reads and writes there. One place for the keys, their types and bounds: serve
checks a request's at its HTTP boundary, the router builds and checks what it sends and what a
prefill answers, and the offload connector reads them again (vLLM's server passes them on
unchecked).

    {"remote_kv_source": {"host": "10.0.0.7", "port": 7100}}
        pull the longest prefix that peer holds (one of the instance's configured peers: its
        host and rank 0's peer port, `peer.sources`), compute the rest
    P/D in NixlConnector's handshake (vLLM's toy proxy, llm-d's sidecar, kvconnect's router):
        to P   TO_PREFILL: {"do_remote_decode": true, "do_remote_prefill": false, ...null}
        P's answer, passed to D unchanged, `to_decode(...)`: {"do_remote_prefill": true,
               "remote_host": ..., "remote_port": ..., "remote_request_id": the lease,
               "remote_chunk_hashes": [...], ...}

    parse(params, strict)  -> KVTransferParams (ValueError naming the key); `strict` refuses
                              keys kvconnect does not know (serve's boundary), else they are
                              left for other connectors (NixlConnector's beside this one)
    source_of(params)      -> Named | None: the peer they name, in either form
    check_source(named, peers)   ValueError naming the key unless it is a configured peer

`kv_transfer_params` belong to whoever sends the request to the instance: a proxy, never an end
user (vLLM's view). kvconnect's router drops a client's unless told to trust them
(`--trust-client-kv-params`), and an instance pulls only from its configured peers.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Annotated, Any

import msgspec

MAX_CHUNK_HASHES = 4096
MAX_LEASE_ID = 256

Host = Annotated[str, msgspec.Meta(min_length=1, max_length=253, pattern=r"^[A-Za-z0-9.:_-]+$")]
Port = Annotated[int, msgspec.Meta(ge=1, le=65535)]
LeaseId = Annotated[
    str, msgspec.Meta(min_length=1, max_length=MAX_LEASE_ID, pattern=r"^[\x21-\x7e]+$")
]
ChunkHash = Annotated[str, msgspec.Meta(min_length=2, max_length=128, pattern=r"^([0-9a-f]{2})+$")]

TO_PREFILL: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
"""What a P/D proxy sends the prefill instance (NixlConnector's handshake, step 1)."""


def to_decode(
    *,
    peer: tuple[str, int],
    lease: str,
    engine_id: str,
    tp_size: int,
    num_tokens: int,
    expires_at: float,
    chunk_hashes: list[str],
) -> dict[str, Any]:
    """What a prefill instance answers for the decode instance (step 2): pull the leased
    chunks (`chunk_hashes`, `num_tokens` of the prompt) from its peer tier at `peer` until
    `expires_at`, then release `lease`. Every key NixlConnector's answer has, so a proxy
    passes it on unchanged."""
    host, port = peer
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": engine_id,
        "remote_request_id": lease,
        "remote_host": host,
        "remote_port": port,
        "remote_block_ids": None,
        "tp_size": tp_size,
        "remote_num_tokens": num_tokens,
        "remote_blocks_expiry_time": expires_at,
        "remote_chunk_hashes": chunk_hashes,
    }


class RemoteKVSource(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """A peer instance to pull the prompt's KV from: its host and rank 0's peer port (rank r
    serves on port + r), exactly as the instance's `peer.sources` lists it."""

    host: Host
    port: Port


class KVTransferParams(msgspec.Struct, omit_defaults=True):
    """The keys kvconnect's offload connector reads and writes."""

    remote_kv_source: RemoteKVSource | None = None
    """Pull the longest prefix this peer holds in its tiers, compute the rest."""
    do_remote_decode: bool = False
    """P/D, to the prefill instance: lease the prompt's chunks, answer where they are."""
    do_remote_prefill: bool = False
    """P/D, to the decode instance: pull from remote_host:remote_port, compute the rest."""
    remote_host: Host | None = None
    remote_port: Port | None = None
    remote_engine_id: Annotated[str, msgspec.Meta(max_length=256)] | None = None
    remote_request_id: LeaseId | None = None
    """The prefill's lease, released once pulled."""
    remote_block_ids: Annotated[list[Any], msgspec.Meta(max_length=1 << 16)] | None = None
    """NixlConnector's; kvconnect names chunks by `remote_chunk_hashes` and ignores it."""
    tp_size: Annotated[int, msgspec.Meta(ge=1, le=1024)] | None = None
    remote_num_tokens: Annotated[int, msgspec.Meta(ge=0)] | None = None
    remote_blocks_expiry_time: float | None = None
    remote_chunk_hashes: (
        Annotated[list[ChunkHash], msgspec.Meta(max_length=MAX_CHUNK_HASHES)] | None
    ) = None
    """The last block hash (hex) of each chunk the prefill instance leased, from the first."""

    def __post_init__(self) -> None:
        if self.do_remote_prefill and (self.remote_host is None or self.remote_port is None):
            raise msgspec.ValidationError(
                "do_remote_prefill needs remote_host and remote_port (the prefill answer's)"
            )
        if self.do_remote_prefill and self.do_remote_decode:
            raise msgspec.ValidationError("do_remote_prefill and do_remote_decode are exclusive")


KEYS = frozenset(KVTransferParams.__struct_fields__)
LEASE_OWNER = "lease_owner"
"""Added by `kvconnect serve` to a `do_remote_decode` request's params: which client (a digest
of its API key) the lease is for, so that lease quotas count per client. Not one of `KEYS`: a
client that sends it is refused."""


def parse(params: Any, strict: bool = True) -> KVTransferParams:
    """`params` (a JSON object's builtins) checked; `ValueError` naming the key that is wrong.
    Not `strict`: keys kvconnect does not read are left alone (another connector's)."""
    if not isinstance(params, dict):
        raise ValueError("kv_transfer_params: expected an object")
    if strict:
        unknown = sorted(set(params) - KEYS)
        if unknown:
            raise ValueError(f"kv_transfer_params: unknown key(s) {unknown}")
    ours = {k: v for k, v in params.items() if k in KEYS}
    try:
        return msgspec.convert(ours, KVTransferParams, strict=True)
    except msgspec.ValidationError as e:
        where = str(e).replace("`$.", "`kv_transfer_params.").replace("`$`", "kv_transfer_params")
        raise ValueError(where) from None


@dataclass(frozen=True)
class Named:
    """The peer a request names, and what a prefill instance's answer said with it."""

    addr: tuple[str, int]
    """(host, rank 0's peer port)."""
    lease: str | None = None
    """P/D: the lease to release at the source once pulled (`remote_request_id`)."""
    chunk_hashes: tuple[bytes, ...] | None = None
    """P/D: the last block hash of each chunk the source leased, from the first."""
    field: str = "kv_transfer_params.remote_kv_source"
    """The key that named it, for a refusal."""


def source_of(params: KVTransferParams, pd: bool = True) -> Named | None:
    """The peer `params` name, if any. `do_remote_prefill` counts only with `pd` and only from
    a kvconnect prefill (its answer lists `remote_chunk_hashes`): another connector's
    (NixlConnector's, beside this one in a MultiConnector) names a port that speaks another
    protocol."""
    if params.do_remote_prefill:
        if not pd or params.remote_chunk_hashes is None:
            return None
        assert params.remote_host is not None and params.remote_port is not None
        hashes = tuple(bytes.fromhex(h) for h in params.remote_chunk_hashes)
        addr = (params.remote_host, params.remote_port)
        field = "kv_transfer_params.remote_host/remote_port"
        return Named(addr, params.remote_request_id, hashes, field)
    source = params.remote_kv_source
    return None if source is None else Named((source.host, source.port))


def check_source(named: Named, peers: Collection[tuple[str, int]]) -> None:
    """`ValueError` naming the key unless `named` is one of `peers` (an instance's configured
    peers, `peer.sources`): a request names peers, never endpoints."""
    if named.addr not in peers:
        listed = ", ".join(sorted(endpoint(a) for a in peers)) or "none configured"
        raise ValueError(
            f"{named.field}: {endpoint(named.addr)} is not one of this instance's peers "
            f"(peer.sources: {listed})"
        )


def endpoint(addr: tuple[str, int]) -> str:
    """`host:port` as `peer.sources` lists it (an IPv6 host in brackets)."""
    host, port = addr
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def parse_endpoint(text: str, what: str) -> tuple[str, int]:
    """`HOST:PORT` (`[v6]:PORT`) as (host, port): where an instance's peer tier serves (rank
    0's port; `endpoint` writes it back). `ValueError` naming `what` if it is not one."""
    host, sep, port = text.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(
            f"{what}={text!r} is not HOST:PORT, a peer's host and rank 0's peer port (1-65535; "
            "a bare host would let a request name any port of it)"
        )
    return host, int(port)

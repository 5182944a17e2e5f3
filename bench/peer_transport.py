"""Peer pulls (`peers/tcp.py`, the default transport) beside a bare TCP copy of the same
bytes between the same two processes (the limit).

Prints one line: the rate at which one client pulls N chunks of SmolLM2-135M's size (30
layers, K and V, 128 tokens, 3 KV heads of 64, fp32: 5.9 MB) from a `PeerServer` in another
process, each checked as the connector checks it (`unpack`: checksum or HMAC, the key; then
`mismatch`), unsigned and signed (with the connection's key proof), all within one pull
deadline; and the rate of the same payload bytes sent with `sendall`
and taken with `recv_into` into one preallocated buffer over one loopback TCP connection.
The server serialises each chunk when asked (`pack`'s parts, sent as frames without a copy,
as a worker does); the client checks the parts in place (`unpack_parts`). Best of 3 rounds
each; the bare TCP figure itself varies by about 30% from run to run on this machine.
"""

from __future__ import annotations

import multiprocessing as mp
import socket
import time
from typing import Any

import torch

from kvconnect.connector.offload.common import ChunkInfo, chunk_key
from kvconnect.connector.offload.peers.protocol import Deadline, Hello, Served
from kvconnect.connector.offload.peers.tcp import TcpPeerClient, TcpPeerServer
from kvconnect.connector.offload.tiers.base import TierPlacement, pack

SHAPE = (30, 2, 128, 3, 64)
NUM_CHUNKS = 32
ROUNDS = 3
NS = "smollm2@bench"
MAC = b"m" * 32


def info(i: int) -> ChunkInfo:
    return ChunkInfo(i.to_bytes(32, "big"), tuple(range(4 * i, 4 * i + 4)), None, (7,) * 128, 32)


def key(i: int) -> str:
    return chunk_key(NS, 1, 0, info(i).last_block_hash)


def chunks() -> dict[str, tuple[ChunkInfo, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return {key(i): (info(i), torch.randn(SHAPE, generator=g)) for i in range(NUM_CHUNKS)}


def serve(ready: Any, stop: Any, tcp_port: Any) -> None:
    held = chunks()
    servers = []
    for mac in (None, MAC):

        def read(k: str, mac: bytes | None = mac) -> list[bytes] | None:
            found = held.get(k)
            return None if found is None else list(pack(k, *found, mac))  # type: ignore[arg-type]

        served = Served(lambda ks: len(ks), read, lambda _: False)
        servers.append(TcpPeerServer("127.0.0.1", 0, Hello(1, 0, NS), served, mac, 30, 64, 8))
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    ready.put([s.port for s in servers] + [listener.getsockname()[1]])
    payloads = [memoryview(data.numpy()).cast("B") for _, data in held.values()]
    while True:
        conn, _ = listener.accept()
        with conn:
            if conn.recv(2, socket.MSG_WAITALL) != b"go":  # one round each; else: stop
                break
            for p in payloads:
                conn.sendall(p)
    for s in servers:
        s.close()


def pull(port: int, mac: bytes | None) -> float:
    placement = TierPlacement(1, 0, SHAPE, torch.float32, NS)
    client = TcpPeerClient("127.0.0.1", port, 1, 0, NS, mac, 64 << 20)
    try:
        client.held_prefix([key(0)], Deadline(30))  # connected and greeted, as a lookup leaves it
        start = time.perf_counter()
        wanted = [(key(i), info(i)) for i in range(NUM_CHUNKS)]
        for found in client.fetch_many(wanted, placement, Deadline(60)):
            assert found is not None and not isinstance(found, Exception), found
        return time.perf_counter() - start
    finally:
        client.close()


def bare(port: int, num_bytes: int) -> float:
    buf = bytearray(num_bytes)
    view = memoryview(buf)
    with socket.create_connection(("127.0.0.1", port)) as s:
        start = time.perf_counter()
        s.sendall(b"go")
        got = 0
        while got < num_bytes:
            n = s.recv_into(view[got:])
            assert n
            got += n
        return time.perf_counter() - start


def main() -> None:
    ctx = mp.get_context("spawn")
    ready: Any = ctx.Queue()
    proc = ctx.Process(target=serve, args=(ready, None, None), daemon=True)
    proc.start()
    plain, signed, port = ready.get(timeout=120)
    nbytes = NUM_CHUNKS * torch.Size(SHAPE).numel() * 4
    best = {"plain": 1e9, "hmac": 1e9, "tcp": 1e9}
    for _ in range(ROUNDS):
        best["plain"] = min(best["plain"], pull(plain, None))
        best["hmac"] = min(best["hmac"], pull(signed, MAC))
        best["tcp"] = min(best["tcp"], bare(port, nbytes))
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(b"xx")
    proc.join(30)
    gbs = {k: nbytes / v / 1e9 for k, v in best.items()}
    print(
        f"peer_transport ({NUM_CHUNKS} chunks of {nbytes / NUM_CHUNKS / 1e6:.1f} MB, "
        f"SmolLM2-135M chunk 128 fp32): pull+verify {gbs['plain']:.2f} GB/s "
        f"({gbs['plain'] / gbs['tcp']:.2f}x bare TCP), with HMAC {gbs['hmac']:.2f} GB/s "
        f"({gbs['hmac'] / gbs['tcp']:.2f}x); bare TCP sendall/recv_into {gbs['tcp']:.2f} GB/s"
    )


if __name__ == "__main__":
    main()

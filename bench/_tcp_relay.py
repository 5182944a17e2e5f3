"""A byte relay from loopback TCP ports to Unix sockets: `python bench/_tcp_relay.py PORT=PATH ...`.

What `bench/routers.py` puts between `vllm serve`'s KV event publisher and the routers: vLLM
connects (does not bind) a `tcp://HOST:PORT` event endpoint unless HOST is `*`, which would
bind every interface, so the engine binds `ipc://PATH` and this relay listens on
127.0.0.1:PORT, forwarding every connection, bytes unchanged both ways, to PATH. ZMTP (ZMQ's
wire protocol) is the same over ipc:// and tcp://, so a subscriber connecting
`tcp://127.0.0.1:PORT` (vllm-router takes only tcp:// sources) holds a ZMQ session with the
engine's PUB socket itself. The reverse of tests_peers/relay.py.

It prints `ready` once every port listens, and runs until killed. Not a benchmark itself.
"""

from __future__ import annotations

import asyncio
import sys
from asyncio import StreamReader, StreamWriter
from collections.abc import Awaitable, Callable


async def _pipe(reader: StreamReader, writer: StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        writer.close()


def _forward_to(path: str) -> Callable[[StreamReader, StreamWriter], Awaitable[None]]:
    async def handle(reader: StreamReader, writer: StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_unix_connection(path)
        except OSError:
            writer.close()
            return
        await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))

    return handle


async def main(pairs: list[str]) -> None:
    servers = []
    for pair in pairs:
        port, path = pair.split("=", 1)
        servers.append(await asyncio.start_server(_forward_to(path), "127.0.0.1", int(port)))
    print("ready", flush=True)
    await asyncio.gather(*(s.serve_forever() for s in servers))


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1:]))

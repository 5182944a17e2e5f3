"""A byte relay from Unix sockets to loopback TCP ports: `python relay.py PATH=PORT ...`.

Each Unix socket `PATH` it listens on forwards every connection, bytes unchanged both ways, to
`127.0.0.1:PORT` of the network namespace the relay runs in. A Unix socket is a file, so it
crosses network namespaces: this is how the suite reaches into (and out of) the private
namespace Dynamo's indexer runs in (see conftest.py). ZMTP (ZMQ's wire protocol) is the same
over ipc:// and tcp://, so a ZMQ peer connecting `ipc://PATH` talks to the TCP socket behind it
as if directly; so does an HTTP client.

It prints `ready` once every path listens, and runs until killed.
"""

from __future__ import annotations

import asyncio
import os
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


def _forward_to(port: int) -> Callable[[StreamReader, StreamWriter], Awaitable[None]]:
    async def handle(reader: StreamReader, writer: StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            writer.close()
            return
        await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))

    return handle


async def main(pairs: list[str]) -> None:
    servers = []
    for pair in pairs:
        path, port = pair.rsplit("=", 1)
        if os.path.exists(path):
            os.unlink(path)
        servers.append(await asyncio.start_unix_server(_forward_to(int(port)), path))
    print("ready", flush=True)
    await asyncio.gather(*(s.serve_forever() for s in servers))


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1:]))

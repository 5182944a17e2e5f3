"""A byte relay between Unix sockets and loopback TCP ports: `python relay.py LISTEN=TARGET ...`.

An end is a port number (127.0.0.1:PORT of the network namespace the relay runs in) or the path
of a Unix socket. Every connection to LISTEN is forwarded to TARGET, bytes unchanged both ways.
ZMTP (ZMQ's wire protocol) is the same over ipc:// and tcp://, so a ZMQ peer on one side talks
to the socket on the other as if directly; so does an HTTP client. Two uses:

- `PATH=PORT`: a Unix socket is a file, so it crosses network namespaces; this is how the suite
  reaches into (and out of) the private namespace Dynamo's indexer runs in (see conftest.py).
- `PORT=PATH`: what `bench/routers.py` puts between `vllm serve`'s KV event publisher and the
  routers. vLLM connects (does not bind) a `tcp://HOST:PORT` event endpoint unless HOST is `*`,
  which binds every interface, so the engine binds `ipc://PATH` and the relay listens on
  loopback (vllm-router takes only tcp:// sources).

It prints `ready` once every end listens, and runs until killed.
"""

from __future__ import annotations

import asyncio
import os
import sys
from asyncio import StreamReader, StreamWriter
from collections.abc import Awaitable, Callable

Handler = Callable[[StreamReader, StreamWriter], Awaitable[None]]


async def _pipe(reader: StreamReader, writer: StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        writer.close()


async def _open(end: str) -> tuple[StreamReader, StreamWriter]:
    if end.isdigit():
        return await asyncio.open_connection("127.0.0.1", int(end))
    return await asyncio.open_unix_connection(end)


def _forward_to(target: str) -> Handler:
    async def handle(reader: StreamReader, writer: StreamWriter) -> None:
        try:
            up_reader, up_writer = await _open(target)
        except OSError:
            writer.close()
            return
        await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))

    return handle


async def _listen(end: str, handle: Handler) -> asyncio.Server:
    if end.isdigit():
        return await asyncio.start_server(handle, "127.0.0.1", int(end))
    if os.path.exists(end):
        os.unlink(end)
    return await asyncio.start_unix_server(handle, end)


def _split(pair: str) -> tuple[str, str]:
    """LISTEN=TARGET; a path may hold '=', a port never does."""
    head, _, rest = pair.partition("=")
    if head.isdigit():
        return head, rest
    listen, _, target = pair.rpartition("=")
    if not target.isdigit():
        raise SystemExit(f"relay: {pair!r}: one end must be a port number")
    return listen, target


async def main(pairs: list[str]) -> None:
    servers = []
    for pair in pairs:
        listen, target = _split(pair)
        servers.append(await _listen(listen, _forward_to(target)))
    print("ready", flush=True)
    await asyncio.gather(*(s.serve_forever() for s in servers))


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1:]))

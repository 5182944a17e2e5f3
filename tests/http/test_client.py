"""The router's upstream client (`http/client.py`) against a real HTTP/1.1 server on loopback:
framing (length, chunked with trailers, to the end of the connection), connection reuse, an
instance that closed a pooled connection, refused connections and bodies cut short."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import pytest

from kvconnect.http.client import (
    Unreachable,
    UpstreamBroken,
    UpstreamPool,
    UpstreamTimeout,
)
from kvconnect.http.client_connection import MAX_BUFFERED

Reply = Callable[[bytes], bytes]


@asynccontextmanager
async def server(reply: Reply, close_after: int | None = None) -> AsyncIterator[dict[str, int]]:
    """A server answering each request with `reply(body)`; counts connections and requests;
    closes a connection after `close_after` answers on it."""
    seen = {"connections": 0, "requests": 0}

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen["connections"] += 1
        answered = 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    int(line.split(b":")[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length:")
                )
                body = await reader.readexactly(length)
                seen["requests"] += 1
                writer.write(reply(body))
                await writer.drain()
                answered += 1
                if close_after is not None and answered >= close_after:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()

    srv = await asyncio.start_server(handle, "127.0.0.1", 0)
    seen["port"] = srv.sockets[0].getsockname()[1]
    async with srv:
        yield seen


def length_reply(body: bytes) -> bytes:
    out = b'{"echo": ' + body + b"}"
    return (
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
        % (len(out))
        + out
    )


def chunked_reply(body: bytes) -> bytes:
    parts = [b"data: 1\n\n", body, b"data: [DONE]\n\n"]
    framed = b"".join(b"%x;ext=1\r\n" % len(p) + p + b"\r\n" for p in parts)
    return (
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
        + framed
        + b"0\r\nX-Trailer: t\r\n\r\n"
    )


def run(coro: object) -> None:
    asyncio.run(coro)  # type: ignore[arg-type]


def test_known_length_answers_reuse_one_connection() -> None:
    async def main() -> None:
        pool = UpstreamPool()
        async with server(length_reply) as seen:
            url = f"http://127.0.0.1:{seen['port']}"
            for i in range(5):
                resp = await pool.post(url, "/v1/completions", b"%d" % i)
                assert (resp.status, resp.content_length) == (200, len(b'{"echo": 0}'))
                assert resp.headers["content-type"] == "application/json"
                assert await resp.read() == b'{"echo": %d}' % i
                resp.release()
            assert seen == {"connections": 1, "requests": 5, "port": seen["port"]}
        await pool.close()

    run(main())


def test_chunked_answers_come_piece_by_piece_with_their_trailer_consumed() -> None:
    async def main() -> None:
        pool = UpstreamPool()
        async with server(chunked_reply) as seen:
            url = f"http://127.0.0.1:{seen['port']}"
            for _ in range(3):  # the trailer is read: the next answer starts clean
                resp = await pool.post(url, "/v1/completions", b"middle")
                assert resp.chunked and resp.content_length is None
                assert [p async for p in resp.iter_body()] == [
                    b"data: 1\n\n",
                    b"middle",
                    b"data: [DONE]\n\n",
                ]
                resp.release()
            assert seen["connections"] == 1
        await pool.close()

    run(main())


def test_a_pooled_connection_the_instance_closed_is_retried_on_a_new_one() -> None:
    async def main() -> None:
        pool = UpstreamPool()
        async with server(length_reply, close_after=1) as seen:
            url = f"http://127.0.0.1:{seen['port']}"
            for i in range(3):
                resp = await pool.post(url, "/x", b"%d" % i)
                assert await resp.read() == b'{"echo": %d}' % i
                resp.release()
            assert seen["connections"] == 3 and seen["requests"] == 3
        await pool.close()

    run(main())


def test_a_refused_connection_is_unreachable() -> None:
    async def main() -> None:
        async with server(length_reply) as seen:
            port = seen["port"]
        with pytest.raises(Unreachable):
            await UpstreamPool().post(f"http://127.0.0.1:{port}", "/x", b"1")

    run(main())


def test_an_answer_that_is_not_http_on_a_fresh_connection_is_unreachable() -> None:
    async def main() -> None:
        async with server(lambda _: b"SSH-2.0-nope\r\n\r\n") as seen:
            with pytest.raises(Unreachable, match="malformed answer: Expected HTTP"):
                await UpstreamPool().post(f"http://127.0.0.1:{seen['port']}", "/x", b"1")

    run(main())


def test_a_body_cut_short_is_broken_and_its_connection_not_reused() -> None:
    def cut(_: bytes) -> bytes:
        return b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly this"

    async def main() -> None:
        pool = UpstreamPool()
        async with server(cut, close_after=1) as seen:
            url = f"http://127.0.0.1:{seen['port']}"
            resp = await pool.post(url, "/x", b"1")
            with pytest.raises(UpstreamBroken, match="early"):
                await resp.read()
            resp.release()
            assert pool._take(f"127.0.0.1:{seen['port']}") is None  # closed, not pooled
        await pool.close()

    run(main())


def test_an_unread_answer_closes_its_connection() -> None:
    async def main() -> None:
        pool = UpstreamPool()
        async with server(length_reply) as seen:
            url = f"http://127.0.0.1:{seen['port']}"
            resp = await pool.post(url, "/x", b"1")
            resp.release()  # body never read: the connection cannot carry another answer
            again = await pool.post(url, "/x", b"2")
            assert await again.read() == b'{"echo": 2}'
            again.release()
            assert seen["connections"] == 2
        await pool.close()

    run(main())


@asynccontextmanager
async def silent_server() -> AsyncIterator[dict[str, object]]:
    """A server that takes each request's head and never answers; it notes each head and
    when the client closes its connection."""
    seen: dict[str, object] = {"heads": [], "head": asyncio.Event(), "closed": asyncio.Event()}

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen["heads"].append(await reader.readuntil(b"\r\n\r\n"))  # type: ignore[attr-defined]
        seen["head"].set()  # type: ignore[attr-defined]
        await reader.read()  # until the client closes
        seen["closed"].set()  # type: ignore[attr-defined]
        writer.close()

    srv = await asyncio.start_server(handle, "127.0.0.1", 0)
    seen["url"] = f"http://127.0.0.1:{srv.sockets[0].getsockname()[1]}"
    async with srv:
        yield seen


def test_an_instance_silent_past_the_read_timeout_is_a_timeout_and_its_connection_closed() -> None:
    async def main() -> None:
        pool = UpstreamPool(read_timeout=0.2)
        async with silent_server() as seen:
            with pytest.raises(UpstreamTimeout, match=r"no answer for 0\.2 s"):
                await pool.post(str(seen["url"]), "/v1/completions", b"{}")
            await asyncio.wait_for(seen["closed"].wait(), 10)  # type: ignore[attr-defined]
        await pool.close()

    run(main())


def test_an_instance_silent_mid_body_is_a_timeout() -> None:
    async def main() -> None:
        pool = UpstreamPool(read_timeout=0.2)

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc")
            await reader.read()
            writer.close()

        srv = await asyncio.start_server(handle, "127.0.0.1", 0)
        async with srv:
            url = f"http://127.0.0.1:{srv.sockets[0].getsockname()[1]}"
            resp = await pool.post(url, "/v1/completions", b"{}")
            with pytest.raises(UpstreamTimeout):
                await resp.read()
            resp.release()
        await pool.close()

    run(main())


def test_a_cancelled_request_closes_its_connection_and_authorization_is_sent() -> None:
    """The client went away while the instance works: the instance must see the disconnect
    (so that it aborts the generation)."""

    async def main() -> None:
        pool = UpstreamPool()
        async with silent_server() as seen:
            task = asyncio.create_task(
                pool.post(str(seen["url"]), "/v1/completions", b"{}", authorization="Bearer k")
            )
            await asyncio.wait_for(seen["head"].wait(), 10)  # type: ignore[attr-defined]
            task.cancel()
            await asyncio.wait_for(seen["closed"].wait(), 10)  # type: ignore[attr-defined]
            assert b"\r\nAuthorization: Bearer k\r\n" in seen["heads"][0]  # type: ignore[index]
        await pool.close()

    run(main())


def test_a_large_answer_is_held_at_most_max_buffered_while_its_reader_lags() -> None:
    """Streamed piece by piece, a body far over MAX_BUFFERED pauses reading from the instance
    (not all in the router's memory) and still arrives whole; read() whole takes one of over
    MAX_BUFFERED at once."""
    size = 32 << 20
    body = bytes(range(256)) * (size // 256)
    done = asyncio.Event()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                await reader.readuntil(b"\r\n\r\n")
                await reader.readexactly(1)
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % size + body)
                await writer.drain()
                done.set()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()

    async def main() -> None:
        pool = UpstreamPool()
        srv = await asyncio.start_server(handle, "127.0.0.1", 0)
        async with srv:
            url = f"http://127.0.0.1:{srv.sockets[0].getsockname()[1]}"
            resp = await pool.post(url, "/x", b"1")
            conn = resp._conn
            assert conn is not None
            pieces = resp.iter_body()
            got = [await anext(pieces)]
            while not (conn._paused or done.is_set()):  # the instance writes, we lag
                await asyncio.sleep(0.01)
            assert conn._paused and not done.is_set()
            assert conn._held <= MAX_BUFFERED + (1 << 20)
            got += [data async for data in pieces]
            assert b"".join(got) == body
            resp.release()
            done.clear()
            again = await pool.post(url, "/x", b"2")  # the same connection, read whole
            assert await again.read() == body
            again.release()
        await pool.close()

    run(main())


@asynccontextmanager
async def over_cap() -> AsyncIterator[int]:
    """A server that answers every connection at once with a 503 and closes it, before any
    request (as kvconnect's own listener does over its --max-connections)."""

    async def handle(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\n\r\n")
        writer.close()

    srv = await asyncio.start_server(handle, "127.0.0.1", 0)
    async with srv:
        yield srv.sockets[0].getsockname()[1]


def test_a_connection_closed_before_the_request_is_written_is_closed_not_a_crash() -> None:
    """On uvloop (the router's loop) writing to a closed transport raised RuntimeError, which
    escaped every caller: it ended the router's health checks for good, leaving an instance
    out of rotation. The write is refused as a closed connection instead, and a fresh
    connection closed so is Unreachable."""
    import uvloop

    from kvconnect.http.client_connection import Closed, Connection

    async def main() -> None:
        loop = asyncio.get_running_loop()
        async with over_cap() as port:
            _, conn = await loop.create_connection(lambda: Connection(5.0), "127.0.0.1", port)
            await conn.wait_closed()
            with pytest.raises(Closed):
                conn.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            pool = UpstreamPool()
            for _ in range(20):  # the close may come before or after the write
                try:
                    resp = await pool.get(f"http://127.0.0.1:{port}", "/health")
                except Unreachable:
                    continue
                assert resp.status == 503
                resp.release()
            await pool.close()

    uvloop.run(main())

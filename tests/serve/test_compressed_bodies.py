"""Compressed request bodies on a real `kvconnect serve --api-key` (issue 34, finding 1).

serve's aiohttp inflated gzip/deflate bodies itself (`auto_decompress`) on its event loop, as
they arrived, whatever their size, and went on after it had answered 401 or 413 (draining the
body before the next request). Now aiohttp hands the body over as sent, and
`http/content_encoding.py` decodes it after auth, route and size checks, capped at the body
limit, in pieces:

    a 1 GiB gzip bomb (1 MiB on the wire) without a key     401, nothing inflated
    the same bomb with the key                              413 naming the limit, at most
                                                            the limit inflated
    a small gzip'd / deflated completion request            the answer of the plain one
    bytes that do not decode (garbage, cut, trailing)       400 naming the problem
    br, or an unknown coding                                415 naming it

What serve spent on a bomb is read from /proc (its CPU time and VmRSS) once a request sent
behind the bomb on the same connection is answered: aiohttp takes that request only after it
has drained the bomb's body, so by then every byte of it has been dealt with.
"""

from __future__ import annotations

import gzip
import json
import os
import socket
import struct
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvconnect.api.protocol import MAX_BODY_BYTES
from tests.serving import Serve, request

pytestmark = pytest.mark.slow

KEY = "sk-compressed-bodies"
AUTH = {"Authorization": f"Bearer {KEY}"}
BOMB_MIB = 1024
CPU_BUDGET_S = 0.5
"""What serve may spend on a bomb: inflating it whole costs ~2.5 s of CPU here; reading 1 MiB
and inflating the 4 MiB limit, a few ms."""
RSS_BUDGET_KIB = 32 << 10
HEALTH_BUDGET_S = 1.0
COMPLETION = {"prompt": "Hello", "max_tokens": 5, "temperature": 0, "ignore_eos": True}


def gzip_of_zeros(mib: int) -> bytes:
    """A valid gzip member of `mib` MiB of zeros, about 1 KiB per MiB: each MiB is deflated
    once after a full flush (which resets the window), so its bytes repeat as they are."""
    zeros = bytes(1 << 20)
    c = zlib.compressobj(9, zlib.DEFLATED, -15)
    first = c.compress(zeros) + c.flush(zlib.Z_FULL_FLUSH)
    again = c.compress(zeros) + c.flush(zlib.Z_FULL_FLUSH)
    end = c.flush()
    crc = 0
    for _ in range(mib):
        crc = zlib.crc32(zeros, crc)
    head = b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\xff"
    trailer = struct.pack("<II", crc, (mib << 20) & 0xFFFFFFFF)
    return head + first + again * (mib - 1) + end + trailer


@pytest.fixture(scope="module")
def bomb() -> bytes:
    data = gzip_of_zeros(BOMB_MIB)
    assert len(data) < MAX_BODY_BYTES  # on the wire it is a small body
    return data


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Serve]:
    s = Serve(tmp_path_factory.mktemp("compressed"), "--api-key", KEY)
    s.start()
    try:
        yield s
    finally:
        assert s.stop() == 0, s.logs()


class Conn:
    """One keep-alive connection, requests written by hand (any header, any body)."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=30)
        self.buf = b""

    def send(
        self, path: str, body: bytes | None = None, headers: dict[str, str] | None = None
    ) -> None:
        method = "GET" if body is None else "POST"
        lines = [f"{method} {path} HTTP/1.1", "Host: x"]
        lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
        if body is not None:
            lines += ["Content-Type: application/json", f"Content-Length: {len(body)}"]
        self.sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode() + (body or b""))

    def answer(self) -> tuple[int, Any]:
        while b"\r\n\r\n" not in self.buf:
            self._more()
        head, self.buf = self.buf.split(b"\r\n\r\n", 1)
        lines = head.decode("latin-1").split("\r\n")
        fields = {k.lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:])}
        size = int(fields["content-length"])
        while len(self.buf) < size:
            self._more()
        body, self.buf = self.buf[:size], self.buf[size:]
        return int(lines[0].split(" ")[1]), json.loads(body)

    def exchange(
        self, path: str, body: bytes | None = None, headers: dict[str, str] | None = None
    ) -> tuple[int, Any]:
        self.send(path, body, headers)
        return self.answer()

    def _more(self) -> None:
        data = self.sock.recv(1 << 16)
        assert data, "the server closed the connection"
        self.buf += data

    def close(self) -> None:
        self.sock.close()


def usage_of(pid: int) -> tuple[float, int]:
    """The process's CPU seconds (all its threads) and its resident KiB."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    rss = next(
        int(line.split()[1])
        for line in Path(f"/proc/{pid}/status").read_text().splitlines()
        if line.startswith("VmRSS:")
    )
    return cpu, rss


def send_bomb(server: Serve, bomb: bytes, headers: dict[str, str]) -> tuple[int, Any]:
    """The bomb on one connection; /health on another while serve has it; then /health behind
    the bomb on its own connection. Returns the bomb's answer; checks what serve spent."""
    cpu0, rss0 = usage_of(server.pid)
    a, b = Conn(server.port), Conn(server.port)
    try:
        a.send("/v1/completions", bomb, {"Content-Encoding": "gzip", **headers})
        start = time.monotonic()
        assert b.exchange("/health") == (200, {"status": "ok"})
        health_s = time.monotonic() - start
        status, answer = a.answer()
        start = time.monotonic()
        assert a.exchange("/health") == (200, {"status": "ok"})  # after the bomb's body
        behind_s = time.monotonic() - start
    finally:
        a.close()
        b.close()
    cpu1, rss1 = usage_of(server.pid)
    spent = {
        "cpu_s": round(cpu1 - cpu0, 2),
        "rss_growth_kib": rss1 - rss0,
        "health_s": round(health_s, 3),
        "health_behind_s": round(behind_s, 3),
    }
    print(status, spent)
    assert cpu1 - cpu0 < CPU_BUDGET_S, spent
    assert rss1 - rss0 < RSS_BUDGET_KIB, spent
    assert health_s < HEALTH_BUDGET_S and behind_s < HEALTH_BUDGET_S, spent
    return status, answer


def test_a_gzip_bomb_without_a_key_is_a_401_and_nothing_is_inflated(
    server: Serve, bomb: bytes
) -> None:
    status, answer = send_bomb(server, bomb, {})
    assert status == 401 and answer["error"]["code"] == "invalid_api_key", answer


def test_an_authorized_gzip_bomb_is_a_413_naming_the_limit_and_inflates_no_more(
    server: Serve, bomb: bytes
) -> None:
    status, answer = send_bomb(server, bomb, AUTH)
    assert status == 413 and str(MAX_BODY_BYTES) in answer["error"]["message"], answer


@pytest.mark.parametrize(
    ("coding", "compress"),
    [
        ("gzip", gzip.compress),
        ("deflate", zlib.compress),
        ("deflate", lambda b: zlib.compress(b, wbits=-15)),  # raw, as some clients send it
        ("GZip ", gzip.compress),  # case and spaces do not matter
        ("identity", lambda b: b),
    ],
    ids=["gzip", "deflate-zlib", "deflate-raw", "gzip-case-space", "identity"],
)
def test_a_compressed_completion_gets_the_answer_of_the_plain_one(
    server: Serve, coding: str, compress: Any
) -> None:
    plain = json.dumps(COMPLETION).encode()
    conn = Conn(server.port)
    try:
        status, expected = conn.exchange("/v1/completions", plain, AUTH)
        assert status == 200, expected
        status, answer = conn.exchange(
            "/v1/completions", compress(plain), {"Content-Encoding": coding, **AUTH}
        )
    finally:
        conn.close()
    assert status == 200, answer
    assert answer["choices"] == expected["choices"] and answer["usage"] == expected["usage"]


VALID = gzip.compress(json.dumps(COMPLETION).encode())


@pytest.mark.parametrize(
    ("coding", "body"),
    [
        ("gzip", b"\x1f\x8b not really compressed"),
        ("gzip", b'{"prompt": "not compressed at all"}'),
        ("gzip", VALID[:-6]),  # cut inside its trailer
        ("gzip", VALID[: len(VALID) // 2]),  # cut inside its data
        ("gzip", VALID + b"tail"),  # bytes after the member
        ("deflate", b"\x78\x9c garbage"),
    ],
    ids=["garbage", "plain", "cut-trailer", "cut-data", "trailing-bytes", "deflate-garbage"],
)
def test_a_body_that_does_not_decode_is_a_400_naming_the_coding(
    server: Serve, coding: str, body: bytes
) -> None:
    status, answer, _ = request(
        server.url + "/v1/completions", body, {"Content-Encoding": coding, **AUTH}
    )
    assert status == 400, answer
    assert answer["error"]["message"] == f"the body does not decode (Content-Encoding: {coding})"


@pytest.mark.parametrize("coding", ["br", "zstd", "x-unknown", "gzip, gzip"])
def test_an_unsupported_coding_is_a_415_naming_it(server: Serve, coding: str) -> None:
    body = json.dumps(COMPLETION).encode()  # plain JSON: taken as it is, it would be served
    status, answer, _ = request(
        server.url + "/v1/completions", body, {"Content-Encoding": coding, **AUTH}
    )
    assert status == 415, answer
    assert f"Content-Encoding {coding!r} is not supported" in answer["error"]["message"]

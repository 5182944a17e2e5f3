"""What a router takes from its replicas' /kv/load (replicas.py): their counts, summed while
fresh; an answer of another shape, or naming an instance this router does not route to, is
refused whole with a line that says why."""

import asyncio
import json

import msgspec
import pytest

from kvconnect.http.h1_server import Request
from kvconnect.model.tokenizer import load_tokenizer
from kvconnect.router.core import Router, Usage, _Details
from kvconnect.router.index import BlockIndex, PrefixScore
from kvconnect.router.instances import Instance
from kvconnect.router.replicas import (
    REPLICA_STALE_S,
    Measured,
    ReplicaLoads,
    load_after,
    replica_url,
)
from kvconnect.router.server import RouterOptions, RouterServer

X, Y = "http://127.0.0.1:8001", "http://127.0.0.1:8002"
R1, R2 = "http://127.0.0.1:9001", "http://127.0.0.1:9002"


def answer(measured: list[list[object]] | None = None, **loads: tuple[int, int]) -> bytes:
    names = {"x": X, "y": Y, "z": "http://elsewhere:1"}
    body = {names[k]: {"in_flight": n, "pending": p} for k, (n, p) in loads.items()}
    return json.dumps({"instances": body, "version": 9, "measured": measured or []}).encode()


GOOD = [7, X, 0.5, 300, 1, None, 0, 2]


def test_fresh_answers_are_summed_and_stale_ones_drop_out() -> None:
    loads = ReplicaLoads([R1, R2], [X, Y])
    loads.update(R1, answer(x=(2, 300)), now=100.0)
    loads.update(R2, answer(x=(1, 50), y=(1, 7)), now=100.5)
    assert loads.totals(now=100.6) == ({X: 3, Y: 1}, {X: 350, Y: 7})
    assert loads.totals(now=100.0 + REPLICA_STALE_S + 0.1) == ({X: 1, Y: 1}, {X: 50, Y: 7})
    assert loads.totals(now=200.0) == ({}, {})


@pytest.mark.parametrize(
    ("body", "why"),
    [
        (b"[1, 2]", "not a /kv/load answer"),
        (b'{"instances": {"' + X.encode() + b'": {"in_flight": 1}}}', "not a /kv/load answer"),
        (answer(x=(-1, 0)), "out of range"),
        (answer(x=(1, 2**41)), "out of range"),
        (answer(z=(1, 1)), "is not one this router routes to"),
        (b" " * (2 << 20), "bytes, at most"),
        (answer([[7, "http://elsewhere:1", 0.5, 300, 1, None, 0, 2]]), "does not route to"),
        (answer([[7, X, 0.5, 300, 1, "http://elsewhere:1", 10, 2]]), "does not route to"),
        (answer([[7, X, -0.5, 300, 1, None, 0, 2]]), "elapsed_s"),
        (answer([[7, X, 0.5, -3, 1, None, 0, 2]]), "out of range"),
        (answer([[7, X, 0.5, 300, 1, None]]), "not a /kv/load answer"),
        (answer([GOOD] * 257), "measurements, at most"),
    ],
)
def test_a_bad_answer_is_refused_whole_and_what_came_before_drops(body: bytes, why: str) -> None:
    taken: list[Measured] = []
    loads = ReplicaLoads([R1], [X, Y], taken.append)
    loads.update(R1, answer(x=(4, 400)), now=1.0)
    with pytest.raises(ValueError, match=why):
        loads.update(R1, body, now=1.1)
    assert loads.totals(now=1.2) == ({}, {}) and taken == []


def test_a_replicas_measurements_are_handed_on_once_each() -> None:
    taken: list[Measured] = []
    loads = ReplicaLoads([R1], [X, Y], taken.append)
    pulled = [8, Y, 0.25, 40, 1, X, 2000, 0]
    loads.update(R1, answer([GOOD, pulled], x=(1, 10)), now=1.0)
    assert taken == [
        Measured(7, X, 0.5, 300, 1, None, 0, 2),
        Measured(8, Y, 0.25, 40, 1, X, 2000, 0),
    ]


@pytest.mark.parametrize(
    "bad", ["10.0.0.2:9000", "https://a:1", "http://a", "http://a:1/x", "http://a:1?q", "ftp://a:1"]
)
def test_a_replica_is_http_host_port(bad: str) -> None:
    assert replica_url("http://10.0.0.2:9000/") == "http://10.0.0.2:9000"
    with pytest.raises(ValueError, match="--replica"):
        replica_url(bad)


def kv_load(query: str) -> Request:
    return Request("GET", "/kv/load", query, {})


def test_kv_load_after_a_version_is_answered_at_the_next_change() -> None:
    """A replica's read names the version it has: the answer waits for the next change
    (a long poll), so the other replicas learn of a request as it is sent."""

    async def run() -> None:
        router = Router([Instance(X, "tcp://127.0.0.1:9")], BlockIndex(4), load_tokenizer("tiny"))
        handlers = RouterServer(router, RouterOptions())
        try:
            now = msgspec.json.decode((await handlers.kv_load(kv_load(""))).body)
            assert now["instances"] == {X: {"in_flight": 0, "pending": 0}}
            held = asyncio.create_task(handlers.kv_load(kv_load(f"after={now['version']}")))
            await asyncio.sleep(0)  # the handler runs until it waits
            assert not held.done()
            router.loads.sent(X, 100)
            got = msgspec.json.decode((await held).body)
            assert got["version"] > now["version"]
            assert got["instances"] == {X: {"in_flight": 1, "pending": 100}}
            past = await handlers.kv_load(kv_load(f"after={now['version']}"))  # at once
            assert msgspec.json.decode(past.body) == got
            assert got["measured"] == []  # no answer measured yet
            # an answer it measures goes to the replicas too, under the next version
            router.learn(X, PrefixScore(), None, 0.5, Usage(300, 1, _Details(64)), queued=2)
            after = got["version"]
            got = msgspec.json.decode((await handlers.kv_load(kv_load(f"after={after}"))).body)
            assert got["measured"] == [[after + 1, X, 0.5, 236, 1, None, 0, 2]]
            bad = await handlers.kv_load(kv_load("after=soon"))
            assert bad.status == 400 and b"after" in bad.body
        finally:
            await handlers.close()

    asyncio.run(run())


@pytest.mark.parametrize(
    "query", ["after=", "after=-1", "after=1e3", "since=3", "after=" + "9" * 30]
)
def test_kv_load_takes_only_after_a_version(query: str) -> None:
    assert load_after("") is None and load_after("after=42") == 42
    with pytest.raises(ValueError, match="after"):
        load_after(query)

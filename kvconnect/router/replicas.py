"""Router replicas that share their load: each counts only the requests it sent, so without
this two replicas in front of the same instances see different loads and choose differently
under traffic (as Dynamo's routers share their active sequences between replicas).

    kvconnect router ... --replica http://10.0.0.2:9000 --replica http://10.0.0.3:9000

    GET /kv/load?after=V
        {"instances": {"<url>": {"in_flight": 3, "pending": 1536}, ...}, "version": 8,
         "measured": [[7, "<url>", 0.41, 300, 1, null, 0, 2], ...]}
        this replica's own count per instance: requests in flight there and the prompt
        tokens they have still to compute (`loads.Loads.pending`); `version` counts its changes.
        With `after`, the answer waits until the version is past V, or LOAD_HOLD_S.
        `measured`: the answers this replica measured after version V (all it keeps, without
        `after`), each [version, instance, elapsed s, computed, completion, source or null,
        pulled, queued]: `CostModel.observe`'s arguments.

A replica learns its costs from the answers it relays (costs.py); followers feed the answers
their replicas measured into their own fits too, so replicas that share traffic fit the same
costs and, under load, make the same choices (each from its half of the answers, two
replicas agreed on 10 of 12 hot-prefix decisions).

Each replica's /kv/load is read in a loop, each read naming the version the last one
answered (a long poll: a change at one replica reaches the others within a round trip, where
a poll every 0.1 s left them deciding six requests of a burst on old counts), with the admin
token, or the API key, this router is given (replicas of one deployment share them); it is
added to this router's own count when it chooses (`loads.Loads.of`). An answer older than
REPLICA_STALE_S no longer counts: a replica that stops answering stops adding load. An
answer that is not this shape, or that names an instance this router does not route to, is
refused whole (logged once per replica until it answers well again).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from urllib.parse import urlsplit

import msgspec

from kvconnect.http.client import Unreachable, UpstreamBroken, UpstreamPool

logger = logging.getLogger(__name__)

LOAD_HOLD_S = 0.5
"""How long a /kv/load?after=V waits for a change before answering as it is."""
REPLICA_STALE_S = LOAD_HOLD_S + 1.0
REPLICA_MIN_INTERVAL_S = 0.002
"""Between two reads of one replica, at least (a replica that changes all the time, or
answers `after` at once, is not read in a busy loop)."""
MAX_VERSION = 1 << 62
MEASURED_KEPT = 256
"""Answers a router keeps to give its replicas (the last ones)."""
MAX_ELAPSED_S = 1e6
MAX_COUNT = 1 << 40
MAX_ANSWER_BYTES = 1 << 20


class _Load(msgspec.Struct, forbid_unknown_fields=True):
    in_flight: int
    pending: int


class Measured(msgspec.Struct, array_like=True, frozen=True):
    """One answer a router measured (`CostModel.observe`'s arguments), under its version."""

    version: int
    instance: str
    elapsed_s: float
    computed: int
    completion: int
    source: str | None
    pulled: int
    queued: int


class _Loads(msgspec.Struct):
    instances: dict[str, _Load]
    version: int = 0
    measured: list[Measured] = []


_decode = msgspec.json.Decoder(_Loads).decode


def replica_url(value: str) -> str:
    """`--replica`'s value, checked: http://HOST:PORT (no path); `ValueError` naming it."""
    parts = urlsplit(value)
    try:
        port = parts.port
    except ValueError:
        port = None
    if parts.scheme != "http" or not parts.hostname or port is None or parts.path.strip("/"):
        raise ValueError(f"--replica {value!r}: not http://HOST:PORT")
    if parts.query or parts.fragment or parts.username or parts.password:
        raise ValueError(f"--replica {value!r}: not http://HOST:PORT")
    return f"http://{parts.netloc}"


def load_after(query: str) -> int | None:
    """/kv/load's query, checked: `after=V` (a version, 0 <= V < 2**62) or nothing;
    `ValueError` naming what is wrong."""
    if not query:
        return None
    name, eq, value = query.partition("=")
    if name != "after" or not eq or not value.isascii() or not value.isdigit():
        raise ValueError(f"/kv/load takes ?after=VERSION (an integer), not {query[:100]!r}")
    after = int(value)  # isdigit and ascii: at most a few hundred digits (the head's bound)
    if after >= MAX_VERSION:
        raise ValueError(f"after={value[:30]}: a version is below 2**62")
    return after


@dataclass
class _Seen:
    at: float
    in_flight: dict[str, int]
    pending: dict[str, int]


class ReplicaLoads:
    """What each replica last said of its load (thread-safe enough: replaced whole)."""

    def __init__(
        self,
        replicas: Iterable[str],
        instances: Iterable[str],
        measured: Callable[[Measured], None] = lambda _: None,
    ) -> None:
        """`measured`: called with each answer a replica measured, once (the router feeds
        it to its cost model)."""
        self.replicas = list(replicas)
        self._names = frozenset(instances)
        self._seen: dict[str, _Seen] = {}
        self._refused: set[str] = set()
        self._measured = measured
        self._versions: dict[str, int] = {}
        """Per replica, the version of its last answer taken: kept when it stops answering,
        so its measurements are not taken twice when it answers again."""

    def update(self, replica: str, body: bytes, now: float | None = None) -> None:
        """`replica`'s /kv/load answer; `ValueError` naming what is wrong with it (then
        what it said before no longer counts, and none of its measurements is taken)."""
        self._seen.pop(replica, None)
        if len(body) > MAX_ANSWER_BYTES:
            raise ValueError(f"{len(body)} bytes, at most {MAX_ANSWER_BYTES}")
        try:
            loads = _decode(body)
        except msgspec.DecodeError as e:
            raise ValueError(f"not a /kv/load answer: {e}") from None
        if not 0 <= loads.version < MAX_VERSION:
            raise ValueError("version out of range")
        if len(loads.measured) > MEASURED_KEPT:
            raise ValueError(f"{len(loads.measured)} measurements, at most {MEASURED_KEPT}")
        for m in loads.measured:
            self._check(m)
        for name, load in loads.instances.items():
            if name not in self._names:
                raise ValueError(f"instance {name[:200]!r} is not one this router routes to")
            if not (0 <= load.in_flight < MAX_COUNT and 0 <= load.pending < MAX_COUNT):
                raise ValueError(f"instance {name}: counts out of range")
        at = time.monotonic() if now is None else now
        self._seen[replica] = _Seen(
            at,
            {n: x.in_flight for n, x in loads.instances.items()},
            {n: x.pending for n, x in loads.instances.items()},
        )
        self._versions[replica] = loads.version
        for m in loads.measured:
            self._measured(m)

    def _check(self, m: Measured) -> None:
        if m.instance not in self._names or (m.source is not None and m.source not in self._names):
            raise ValueError("a measurement names an instance this router does not route to")
        if not (math.isfinite(m.elapsed_s) and 0 <= m.elapsed_s < MAX_ELAPSED_S):
            raise ValueError(f"a measurement's elapsed_s {m.elapsed_s!r} is out of range")
        counts = (m.computed, m.completion, m.pulled, m.queued)
        if not (0 <= m.version < MAX_VERSION and all(0 <= n < MAX_COUNT for n in counts)):
            raise ValueError("a measurement's counts are out of range")

    def forget(self, replica: str) -> None:
        self._seen.pop(replica, None)

    def totals(self, now: float | None = None) -> tuple[dict[str, int], dict[str, int]]:
        """Requests in flight and their pending prompt tokens per instance, summed over the
        replicas whose answer is fresh."""
        at = time.monotonic() if now is None else now
        in_flight: dict[str, int] = {}
        pending: dict[str, int] = {}
        for seen in list(self._seen.values()):
            if at - seen.at > REPLICA_STALE_S:
                continue
            for name, n in seen.in_flight.items():
                in_flight[name] = in_flight.get(name, 0) + n
            for name, n in seen.pending.items():
                pending[name] = pending.get(name, 0) + n
        return in_flight, pending

    async def follow(self, pool: UpstreamPool, authorization: str | None) -> None:
        """Follow every replica's /kv/load, forever (cancel to stop)."""
        await asyncio.gather(*(self._follow(pool, r, authorization) for r in self.replicas))

    async def _follow(self, pool: UpstreamPool, replica: str, authorization: str | None) -> None:
        while True:
            started = time.monotonic()
            if not await self._read(pool, replica, authorization):
                await asyncio.sleep(LOAD_HOLD_S)  # down or refused: tried again, not hammered
            wait = REPLICA_MIN_INTERVAL_S - (time.monotonic() - started)
            await asyncio.sleep(max(0.0, wait))

    async def _read(self, pool: UpstreamPool, replica: str, authorization: str | None) -> bool:
        """One read of `replica`'s load, after the version last seen; whether it counts."""
        version = self._versions.get(replica)
        path = "/kv/load" if version is None else f"/kv/load?after={version}"
        try:
            async with asyncio.timeout(REPLICA_STALE_S):
                resp = await pool.get(replica, path, authorization)
                try:
                    body = await resp.read()
                finally:
                    resp.release()
            if resp.status != 200:
                raise ValueError(f"answered {resp.status}")
            self.update(replica, body)
        except (Unreachable, UpstreamBroken, TimeoutError, ValueError) as e:
            self.forget(replica)
            if replica not in self._refused:
                self._refused.add(replica)
                logger.warning("router: replica %s: its load is not counted: %s", replica, e)
            return False
        if replica in self._refused:
            self._refused.discard(replica)
            logger.info("router: replica %s: its load is counted again", replica)
        return True

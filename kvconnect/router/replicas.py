"""Router replicas that share their load: each counts only the requests it sent, so without
this two replicas in front of the same instances see different loads and choose differently
under traffic (as Dynamo's routers share their active sequences between replicas).

    kvconnect router ... --replica http://10.0.0.2:9000 --replica http://10.0.0.3:9000

    GET /kv/load    {"instances": {"<url>": {"in_flight": 3, "pending": 1536}, ...}}
                    this replica's own count per instance: requests in flight there and the
                    prompt tokens they have still to compute (`Router.pending`)

Every REPLICA_POLL_S each replica's /kv/load is read (with the admin token, or the API key,
this router is given: replicas of one deployment share them) and added to this router's own
count when it chooses (`Router.loads`). An answer older than REPLICA_STALE_S no longer
counts: a replica that stops answering stops adding load. An answer that is not this shape,
or that names an instance this router does not route to, is refused whole (logged once per
replica until it answers well again).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass
from urllib.parse import urlsplit

import msgspec

from kvconnect.http.client import Unreachable, UpstreamBroken, UpstreamPool

logger = logging.getLogger(__name__)

REPLICA_POLL_S = 0.1
REPLICA_STALE_S = 1.0
MAX_COUNT = 1 << 40
MAX_ANSWER_BYTES = 1 << 20


class _Load(msgspec.Struct, forbid_unknown_fields=True):
    in_flight: int
    pending: int


class _Loads(msgspec.Struct):
    instances: dict[str, _Load]


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


@dataclass
class _Seen:
    at: float
    in_flight: dict[str, int]
    pending: dict[str, int]


class ReplicaLoads:
    """What each replica last said of its load (thread-safe enough: replaced whole)."""

    def __init__(self, replicas: Iterable[str], instances: Iterable[str]) -> None:
        self.replicas = list(replicas)
        self._names = frozenset(instances)
        self._seen: dict[str, _Seen] = {}
        self._refused: set[str] = set()

    def update(self, replica: str, body: bytes, now: float | None = None) -> None:
        """`replica`'s /kv/load answer; `ValueError` naming what is wrong with it (then
        what it said before no longer counts)."""
        self._seen.pop(replica, None)
        if len(body) > MAX_ANSWER_BYTES:
            raise ValueError(f"{len(body)} bytes, at most {MAX_ANSWER_BYTES}")
        try:
            loads = _decode(body)
        except msgspec.DecodeError as e:
            raise ValueError(f"not a /kv/load answer: {e}") from None
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
        """Read every replica's /kv/load, forever (cancel to stop)."""
        while True:
            await asyncio.gather(*(self._read(pool, r, authorization) for r in self.replicas))
            await asyncio.sleep(REPLICA_POLL_S)

    async def _read(self, pool: UpstreamPool, replica: str, authorization: str | None) -> None:
        try:
            async with asyncio.timeout(REPLICA_STALE_S):
                resp = await pool.get(replica, "/kv/load", authorization)
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
            return
        if replica in self._refused:
            self._refused.discard(replica)
            logger.info("router: replica %s: its load is counted again", replica)

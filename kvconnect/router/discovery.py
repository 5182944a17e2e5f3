"""Where an instance's KV event streams are, asked of the instance at the router's start.

    --instance URL[,peer=HOST:PORT]              discovered: GET URL/kv_event_sources
    --instance URL,EVENTS[,REPLAY][,peer=...]    given (`Instance.parse`): nothing is asked

    specs = [parse_instance(s) for s in flags]   Instance, or Undiscovered (URL and peer only)
    instances = discover(specs, authorization, timeout)    every one an Instance, or ValueError

The answer is vLLM's (PR #55844, `stream/wire.py`'s `KVEventSource`): a JSON list, one
`{data_parallel_rank, endpoint, replay_endpoint, topic}` per DP rank. vLLM 0.32 and 0.33 (as
released) answer the same path with a map of DP rank to their `KVEventsConfig`
(`{"0": {"endpoint": ..., "replay_endpoint": ..., "topic": ..., ...}}`); both are read.
A wildcard host in an endpoint (`tcp://*:5557`, as configured) is the instance's own host.

Until `timeout` an instance that is not up yet (refused, reset, 503) is asked again every
`RETRY_S`; whatever else it answers is final: a 404 (a server without discovery: name its
addresses), 401 (the router's `--instance-api-key`), an answer of another shape, no stream
(events off), several DP ranks (the router follows one stream per instance). Each refusal is
a `ValueError` naming the instance, which the command prints as its one error line.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import msgspec

from kvconnect.http.client import Unreachable, UpstreamBroken, UpstreamPool
from kvconnect.router.instances import Instance, check_url, parse_peer
from kvconnect.stream.wire import KVEventSource, with_host

DISCOVERY_PATH = "/kv_event_sources"
DISCOVERY_TIMEOUT_S = 60.0
"""The router's default `--discovery-timeout`: how long an instance may take to come up."""
RETRY_S = 0.2
MAX_ANSWER_BYTES = 1 << 20
"""A discovery answer is a few hundred bytes per DP rank; more is not read."""


@dataclass(frozen=True)
class Undiscovered:
    """An instance named by its URL alone: its streams are asked of it (`discover`)."""

    url: str
    peer: tuple[str, int] | None = None


def parse_instance(spec: str) -> Instance | Undiscovered:
    """`--instance`: `URL[,peer=HOST:PORT]` (to discover) or the explicit form with event
    addresses (`Instance.parse`); `ValueError` naming `spec` otherwise."""
    head, sep, last = spec.rpartition(",")
    if "," not in spec or (sep and "," not in head and last.startswith("peer=")):
        url = head if sep else spec
        peer = parse_peer(spec, last.removeprefix("peer=")) if sep else None
        if "://" not in url:
            raise ValueError(
                f"--instance {spec!r}: expected URL[,EVENTS_ENDPOINT[,REPLAY_ENDPOINT]]"
                "[,peer=HOST:PORT] (e.g. http://127.0.0.1:8001)"
            )
        check_url(url)
        return Undiscovered(url.rstrip("/"), peer)
    return Instance.parse(spec)


def discover(
    specs: list[Instance | Undiscovered],
    authorization: str | None = None,
    timeout: float = DISCOVERY_TIMEOUT_S,
) -> list[Instance]:
    """Every spec as an `Instance`, the undiscovered ones asked (all at once) within
    `timeout` seconds; `ValueError` naming the first instance that could not be."""
    if all(isinstance(s, Instance) for s in specs):
        return [s for s in specs if isinstance(s, Instance)]
    return asyncio.run(_discover_all(specs, authorization, timeout))


async def _discover_all(
    specs: list[Instance | Undiscovered], authorization: str | None, timeout: float
) -> list[Instance]:
    pool = UpstreamPool(connect_timeout=min(timeout, 5.0), read_timeout=min(timeout, 10.0))
    deadline = time.monotonic() + timeout
    try:
        found = await asyncio.gather(
            *(
                _instance(pool, s, authorization, deadline, timeout)
                for s in specs
                if isinstance(s, Undiscovered)
            ),
            return_exceptions=True,
        )
    finally:
        await pool.close()
    for result in found:
        if isinstance(result, BaseException):
            raise result
    discovered = iter(found)
    return [s if isinstance(s, Instance) else next(discovered) for s in specs]  # type: ignore[misc]


async def _instance(
    pool: UpstreamPool,
    spec: Undiscovered,
    authorization: str | None,
    deadline: float,
    timeout: float,
) -> Instance:
    where = f"--instance {spec.url}: GET {DISCOVERY_PATH}"
    last = "no answer"
    while True:
        try:
            resp = await pool.get(spec.url, DISCOVERY_PATH, authorization)
            body = await resp.read() if (resp.content_length or 0) <= MAX_ANSWER_BYTES else b""
            resp.release()
            status = resp.status
        except (Unreachable, UpstreamBroken, OSError) as e:
            status, body, last = 0, b"", str(e) or type(e).__name__
        if status == 200:
            return _resolve(spec, where, body)
        if status not in (0, 502, 503, 504):
            raise ValueError(_refusal(where, status))
        if status:
            last = f"status {status}"
        if time.monotonic() + RETRY_S > deadline:
            raise ValueError(
                f"{where}: no answer within {timeout:g}s (last: {last}); is the instance up? "
                "(--discovery-timeout)"
            )
        await asyncio.sleep(RETRY_S)


def _refusal(where: str, status: int) -> str:
    if status in (404, 405):
        return (
            f"{where} answered {status}: the instance does not name its KV event streams; "
            "give them: --instance URL,EVENTS_ENDPOINT[,REPLAY_ENDPOINT]"
        )
    if status in (401, 403):
        return f"{where} answered {status}: the instance wants a key (--instance-api-key)"
    return f"{where} answered status {status}"


def _resolve(spec: Undiscovered, where: str, body: bytes) -> Instance:
    """The instance from its answer (`parse_sources`), wildcard hosts made the URL's."""
    try:
        sources = parse_sources(body)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    if not sources:
        raise ValueError(f"{where}: the instance publishes no KV events (events are off)")
    if len(sources) > 1:
        ranks = ", ".join(str(s.data_parallel_rank) for s in sources)
        raise ValueError(
            f"{where}: {len(sources)} data-parallel ranks ({ranks}); the router follows one "
            "stream per instance"
        )
    source = sources[0]
    host = urlsplit(spec.url).hostname or "127.0.0.1"
    replay = source.replay_endpoint
    return Instance(
        spec.url,
        with_host(source.endpoint, host),
        with_host(replay, host) if replay else None,
        spec.peer,
    )


_LIST = msgspec.json.Decoder(list[KVEventSource])
_ANY = msgspec.json.Decoder()
_ENDPOINT_SCHEMES = ("tcp://", "ipc://", "inproc://")


def parse_sources(body: bytes) -> list[KVEventSource]:
    """The sources in a `/kv_event_sources` answer, by DP rank: vLLM's list (PR #55844), or
    the map of DP rank to `KVEventsConfig` that vLLM 0.32/0.33 answer (its null publisher
    omitted). `ValueError` saying what is wrong otherwise."""
    try:
        raw: Any = _ANY.decode(body)
    except msgspec.DecodeError as e:
        raise ValueError(f"not JSON ({e})") from None
    if isinstance(raw, list):
        try:
            sources = _LIST.decode(body)
        except msgspec.ValidationError as e:
            raise ValueError(f"not a list of event sources: {e}") from None
    elif isinstance(raw, dict):
        configs = [_from_config(rank, cfg) for rank, cfg in raw.items()]
        sources = [s for s in configs if s is not None]
    else:
        raise ValueError(f"expected a JSON list of event sources, got {type(raw).__name__}")
    for s in sources:
        for endpoint in (s.endpoint, s.replay_endpoint):
            if endpoint is not None and not endpoint.startswith(_ENDPOINT_SCHEMES):
                raise ValueError(f"rank {s.data_parallel_rank}: endpoint {endpoint!r} is not ZMQ")
    ranks = [s.data_parallel_rank for s in sources]
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"a data-parallel rank named twice: {sorted(ranks)}")
    return sorted(sources, key=lambda s: s.data_parallel_rank)


def _from_config(rank: str, config: Any) -> KVEventSource | None:
    """One entry of vLLM 0.32/0.33's map: DP rank -> its publisher's `KVEventsConfig`."""
    if not rank.isdigit() or not isinstance(config, dict):
        raise ValueError(f"expected a map of DP rank to event config, got key {rank!r}")
    if config.get("publisher", "zmq") != "zmq" or config.get("enable_kv_cache_events") is False:
        return None
    endpoint, replay, topic = (config.get(k) for k in ("endpoint", "replay_endpoint", "topic"))
    if not isinstance(endpoint, str) or not isinstance(replay, str | None):
        raise ValueError(f"rank {rank}: endpoint and replay_endpoint must be strings")
    return KVEventSource(int(rank), endpoint, replay, topic if isinstance(topic, str) else "")


__all__ = [
    "DISCOVERY_PATH",
    "DISCOVERY_TIMEOUT_S",
    "Undiscovered",
    "discover",
    "parse_instance",
    "parse_sources",
]

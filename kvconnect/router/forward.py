"""The relay: one request to the chosen instance, its answer (streamed or not) back.

Before the answer begins, a refused or failed connection is `Unreachable` and the request may
go to another instance; once it has begun, nothing can move it: an instance dying mid-answer
cuts the answer short (logged), a client going away just ends the relay.
"""

from __future__ import annotations

import logging

import aiohttp
from aiohttp import web

from kvconnect.router.core import Instance, Router, StaleCheck
from kvconnect.router.index import PrefixScore

logger = logging.getLogger(__name__)

MAX_CHECKED_BODY = 1 << 20
"""Answers up to this size are kept to check their usage against the index."""


class Unreachable(Exception):
    """The instance failed before answering: the request may go to another one."""


async def post(session: aiohttp.ClientSession, url: str, raw: bytes) -> aiohttp.ClientResponse:
    """The upstream response (headers read). A refused or timed-out connect is `Unreachable`
    at once; a failure on a pooled keep-alive connection (the instance closed it as it was
    reused) is retried, up to twice, before it is."""
    for attempt in range(3):
        try:
            return await session.post(url, data=raw, headers={"Content-Type": "application/json"})
        except (aiohttp.ClientConnectorError, TimeoutError) as e:
            raise Unreachable(str(e) or type(e).__name__) from None
        except aiohttp.ClientConnectionError as e:
            if attempt == 2:
                raise Unreachable(str(e) or type(e).__name__) from None
            logger.debug("router: %s: %s on a pooled connection; retrying", url, e)
    raise AssertionError("unreachable")


async def forward(
    http: web.Request,
    session: aiohttp.ClientSession,
    instance: Instance,
    raw: bytes,
    router: Router,
    score: PrefixScore,
    check: StaleCheck | None = None,
) -> web.StreamResponse:
    """Relay one request and its answer; a whole JSON answer's usage is checked against the
    index (`Router.check_cached`)."""
    upstream = await post(session, instance.url + http.path, raw)
    async with upstream:
        router.record(instance.name, score)
        headers = {
            "Content-Type": upstream.headers.get("Content-Type", "application/json"),
            "x-kvconnect-instance": instance.name,
        }
        response = web.StreamResponse(status=upstream.status, headers=headers)
        keep = check is not None and upstream.status == 200 and score.num_tokens > 0
        keep = keep and headers["Content-Type"].startswith("application/json")
        body: list[bytes] = []
        size = 0
        try:
            await response.prepare(http)
            async for data in upstream.content.iter_any():
                await response.write(data)
                if keep and size < MAX_CHECKED_BODY:
                    body.append(data)
                    size += len(data)
            await response.write_eof()
            if keep and check is not None and size < MAX_CHECKED_BODY:
                router.check_cached(instance.name, score, check, b"".join(body))
        except aiohttp.ClientPayloadError as e:
            logger.warning("router: %s failed mid-answer: %s", instance.name, e)
        except (ConnectionError, aiohttp.ClientConnectionError) as e:
            if http.transport is None or http.transport.is_closing():
                logger.info("router: client went away during the answer from %s", instance.name)
            else:
                logger.warning("router: %s failed mid-answer: %s", instance.name, e)
        return response

"""The relay: one request to the chosen instance, its answer (streamed or not) back.

Before the answer begins, a refused or failed connection is `upstream.Unreachable` and the
request may go to another instance; once it has begun, nothing can move it: an instance dying
mid-answer cuts the answer short (logged), a client going away just ends the relay (and closes
the upstream connection, so that the instance aborts the request too). An instance that took
the request and then stays silent past the pool's read timeout is a 504 for the client (or a
cut stream) and leaves rotation until its health check answers again.
"""

from __future__ import annotations

import logging

from aiohttp import web

from kvconnect.router.core import Instance, Router, StaleCheck
from kvconnect.router.index import PrefixScore
from kvconnect.router.upstream import (
    UpstreamBroken,
    UpstreamPool,
    UpstreamResponse,
    UpstreamTimeout,
)

logger = logging.getLogger(__name__)

MAX_WHOLE_BODY = 8 << 20
"""Answers of a known length up to this size are relayed whole (and their usage checked
against the index); longer or streamed ones chunk by chunk."""


async def forward(
    http: web.Request,
    pool: UpstreamPool,
    instance: Instance,
    raw: bytes,
    router: Router,
    score: PrefixScore,
    check: StaleCheck | None = None,
    authorization: str | None = None,
) -> web.StreamResponse:
    """Relay one request and its answer; a whole JSON answer's usage is checked against the
    index (`Router.check_cached`). `authorization` goes to the instance as that header."""
    try:
        upstream = await pool.post(instance.url, http.path, raw, authorization=authorization)
    except UpstreamTimeout as e:
        raise _timed_out(router, instance, e) from None
    try:
        router.record(instance.name, score)
        content_type = upstream.headers.get("content-type", "application/json")
        headers = {"Content-Type": content_type, "x-kvconnect-instance": instance.name}
        retry_after = upstream.headers.get("retry-after")
        if retry_after is not None:  # an overloaded instance's 503 says when to come back
            headers["Retry-After"] = retry_after
        if upstream.content_length is not None and upstream.content_length <= MAX_WHOLE_BODY:
            return await _relay_whole(upstream, headers, instance, router, score, check)
        return await _relay_stream(http, upstream, headers, instance, router)
    finally:
        upstream.release()


def _timed_out(router: Router, instance: Instance, e: UpstreamTimeout) -> web.HTTPException:
    router.mark_down(instance.name, f"stalled: {e}")
    return web.HTTPGatewayTimeout(
        text='{"error": {"message": "the instance did not answer in time", '
        '"type": "timeout", "param": null, "code": 504}}',
        content_type="application/json",
    )


async def _relay_whole(
    upstream: UpstreamResponse,
    headers: dict[str, str],
    instance: Instance,
    router: Router,
    score: PrefixScore,
    check: StaleCheck | None,
) -> web.StreamResponse:
    """An answer of known length: read whole, sent in one write (no chunked framing, one
    syscall), its usage checked."""
    try:
        body = await upstream.read()
    except UpstreamTimeout as e:
        raise _timed_out(router, instance, e) from None
    except UpstreamBroken as e:
        logger.warning("router: %s failed mid-answer: %s", instance.name, e)
        raise web.HTTPBadGateway(
            text='{"error": {"message": "the instance failed mid-answer", '
            '"type": "bad_gateway", "param": null, "code": 502}}',
            content_type="application/json",
        ) from None
    if (
        check is not None
        and upstream.status == 200
        and score.num_tokens > 0
        and headers["Content-Type"].startswith("application/json")
        and b'"prompt_tokens_details"' in body  # absent: the instance does not say its hits
    ):
        router.check_cached(instance.name, score, check, body)
    return web.Response(body=body, status=upstream.status, headers=headers)


async def _relay_stream(
    http: web.Request,
    upstream: UpstreamResponse,
    headers: dict[str, str],
    instance: Instance,
    router: Router,
) -> web.StreamResponse:
    """A streamed answer, piece by piece as it comes. Once begun it cannot move: an instance
    dying mid-answer cuts it short (logged), a client going away ends the relay."""
    response = web.StreamResponse(status=upstream.status, headers=headers)
    try:
        await response.prepare(http)
        async for data in upstream.iter_body():
            await response.write(data)
        await response.write_eof()
    except UpstreamBroken as e:
        logger.warning("router: %s failed mid-answer: %s", instance.name, e)
        if isinstance(e, UpstreamTimeout):
            router.mark_down(instance.name, f"stalled mid-answer: {e}")
    except ConnectionError:
        logger.info("router: client went away during the answer from %s", instance.name)
    return response

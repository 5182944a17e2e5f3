"""What every kvconnect HTTP server shares: OpenAI-shaped errors, a bounded body, access logs.

Imports no engine (the router uses it too).
"""

from __future__ import annotations

import asyncio
import logging
import time

from aiohttp import web
from aiohttp.typedefs import Handler

from kvconnect.api.protocol import MAX_BODY_BYTES, ApiError

logger = logging.getLogger(__name__)
access_log = logging.getLogger("kvconnect.access")


def error_response(e: ApiError) -> web.Response:
    return web.json_response(e.body(), status=e.status)


async def read_body(http: web.Request) -> bytes:
    try:
        return await http.read()
    except web.HTTPRequestEntityTooLarge:
        raise ApiError(
            f"request body is over the limit of {MAX_BODY_BYTES} bytes", status=413
        ) from None


@web.middleware
async def access_and_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """One log line per request; an unexpected exception is a 500 in OpenAI's shape."""
    start = time.monotonic()
    status = 500
    try:
        response = await handler(request)
        status = response.status
        return response
    except web.HTTPException as e:
        status = e.status
        raise
    except asyncio.CancelledError:
        status = 499  # the client went away first (nginx's code for it)
        raise
    except Exception:
        logger.exception("%s %s failed", request.method, request.path)
        return web.json_response(
            ApiError("internal error", status=500, type_="internal_error").body(), status=500
        )
    finally:
        if access_log.isEnabledFor(logging.INFO):
            _log_access(request, status, start)


def _log_access(request: web.Request, status: int, start: float) -> None:
    where = request.get("instance")
    access_log.info(
        "%s %s %d %.1fms%s",
        request.method,
        request.path,
        status,
        (time.monotonic() - start) * 1000,
        f" -> {where}" if where else "",
    )

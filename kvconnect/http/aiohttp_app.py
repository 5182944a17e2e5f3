"""What `kvconnect serve`'s aiohttp app runs its requests through: OpenAI-shaped errors, a
bounded body (decoded by `content_encoding.py`, never by aiohttp), the access log
(`access_log.py`'s line, the router's too) with a 500 for the unexpected. The router's server
does the same in `h1_server.py`.

Imports no engine.
"""

from __future__ import annotations

import asyncio
import logging
import time

from aiohttp import web
from aiohttp.typedefs import Handler
from aiohttp.web_protocol import RequestPayloadError

from kvconnect.api.protocol import MAX_BODY_BYTES, ApiError
from kvconnect.http.access_log import access_log, log_access
from kvconnect.http.aiohttp_listener import BODY_TIMEOUT
from kvconnect.http.content_encoding import EncodingError, decode
from kvconnect.http.limits import BODY_TIMEOUT_S

logger = logging.getLogger(__name__)


def error_response(e: ApiError) -> web.Response:
    return web.json_response(e.body(), status=e.status)


async def read_body(http: web.Request) -> bytes:
    """The body, at most MAX_BODY_BYTES: a declared length over it is a 413 before anything is
    read (no waiting for a body that may never come); a body that does not arrive within the
    app's body deadline is a 408. Then its Content-Encoding is undone by `content_encoding`
    (aiohttp's `auto_decompress` is off: `aiohttp_listener.py`), at most MAX_BODY_BYTES again
    (413), in pieces; a coding other than gzip or deflate is a 415, data that does not decode
    a 400. Handlers call it after auth and routing: a refused request is never inflated."""
    declared = http.content_length
    if declared is not None and declared > MAX_BODY_BYTES:
        raise ApiError(
            f"request body of {declared} bytes is over the limit of {MAX_BODY_BYTES}", status=413
        )
    if http.content.is_eof():  # the whole body came with the head: nothing to wait for
        body = await _read(http)
    else:
        deadline = http.config_dict.get(BODY_TIMEOUT, BODY_TIMEOUT_S)
        try:
            async with asyncio.timeout(deadline):
                body = await _read(http)
        except TimeoutError:
            raise ApiError(
                f"the request body did not arrive within {deadline:g} s", status=408
            ) from None
    codings = http.headers.getall("Content-Encoding", None)
    try:
        return decode(None if codings is None else ", ".join(codings), body)
    except EncodingError as e:
        raise ApiError(str(e), status=e.status) from None


async def _read(http: web.Request) -> bytes:
    """The body as it came (still encoded); its size and framing errors as `ApiError`s."""
    try:
        return await http.read()
    except web.HTTPRequestEntityTooLarge:
        raise ApiError(
            f"request body is over the limit of {MAX_BODY_BYTES} bytes", status=413
        ) from None
    except (RequestPayloadError, web.HTTPBadRequest) as e:
        raise ApiError(f"the body could not be read: {e}") from None


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
    log_access(request.method, request.path, status, start, request.get("instance"))

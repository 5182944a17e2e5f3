"""The access log of both HTTP servers: one line per request on the `kvconnect.access` logger.

    POST /v1/completions 200 12.3ms -> http://127.0.0.1:8001     (the router names the instance)

`kvconnect serve` writes it from `aiohttp_app.access_and_errors`, the router from
`h1_server.py`; both call `log_access`, so the two read alike.
"""

from __future__ import annotations

import logging
import time

access_log = logging.getLogger("kvconnect.access")


def log_access(method: str, path: str, status: int, start: float, where: str | None) -> None:
    """The access-log line of both servers; `start` from `time.monotonic()`."""
    access_log.info(
        "%s %s %d %.1fms%s",
        method,
        path,
        status,
        (time.monotonic() - start) * 1000,
        f" -> {where}" if where else "",
    )


__all__ = ["access_log", "log_access"]

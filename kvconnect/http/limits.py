"""What both HTTP servers bound, and how they refuse a connection over the cap.

    ConnectionLimits    max_connections, header_timeout, body_timeout (the flags
                        --max-connections, --header-timeout, --body-timeout of serve and router),
                        write_timeout (the router's --write-timeout)
    BUSY_RESPONSE       the 503 (with Retry-After) a connection over the cap gets before its close

`kvconnect serve` enforces them in `aiohttp_listener.py` and `aiohttp_app.py`, `kvconnect
router` in `h1_server.py`'s own loop: the same limits, the same answers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

MAX_CONNECTIONS = 1024
HEADER_TIMEOUT_S = 10.0
BODY_TIMEOUT_S = 30.0
WRITE_TIMEOUT_S = 30.0
RETRY_AFTER_S = 1

_BUSY_BODY = json.dumps(
    {
        "error": {
            "message": "too many open connections; retry later",
            "type": "service_unavailable",
            "param": None,
            "code": None,
        }
    }
).encode()
BUSY_RESPONSE = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
    + f"Retry-After: {RETRY_AFTER_S}\r\nContent-Length: {len(_BUSY_BODY)}\r\n".encode()
    + b"Connection: close\r\n\r\n"
    + _BUSY_BODY
)


@dataclass(frozen=True)
class ConnectionLimits:
    max_connections: int = MAX_CONNECTIONS
    """Open connections at most; one more is answered 503 and closed."""
    header_timeout: float = HEADER_TIMEOUT_S
    """Seconds a connection has to deliver a whole request head (after opening, or after its
    previous answer)."""
    body_timeout: float = BODY_TIMEOUT_S
    """Seconds a request has to deliver its whole body (serve: `aiohttp_app.read_body`; the
    router: `h1_server.py`)."""
    write_timeout: float = WRITE_TIMEOUT_S
    """Seconds an answer may wait on a client that takes none of it (the router's server; a
    stream's relay ends with it): clients that never read cannot hold every connection."""

    def __post_init__(self) -> None:
        if self.max_connections < 1:
            raise ValueError(f"max_connections={self.max_connections}: must be at least 1")
        for name in ("header_timeout", "body_timeout", "write_timeout"):
            value = getattr(self, name)
            if not 0 < value < float("inf"):
                raise ValueError(f"{name}={value}: must be a positive number of seconds")


__all__ = [
    "BODY_TIMEOUT_S",
    "BUSY_RESPONSE",
    "HEADER_TIMEOUT_S",
    "MAX_CONNECTIONS",
    "RETRY_AFTER_S",
    "WRITE_TIMEOUT_S",
    "ConnectionLimits",
]

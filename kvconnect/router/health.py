"""Which instances take traffic: active health checks, and failures seen while forwarding.

Every `interval` seconds each instance's `/health` is asked, with a `timeout`: anything but a
200 in time takes it out of rotation, and so does a refused connection while forwarding; the
next 200 brings it back. A dead instance therefore leaves rotation within interval + timeout
(1.5 s by default), and rejoins within `interval` of answering again.

    state   up ---- check fails / forward refused ----> down
            down -------------- check answers 200 ----> up

Used from the router's event loop only.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from kvconnect.http.client import Unreachable, UpstreamBroken, UpstreamPool

logger = logging.getLogger(__name__)

CHECK_INTERVAL_S = 0.5
CHECK_TIMEOUT_S = 1.0


@dataclass
class InstanceHealth:
    up: bool = True
    """Until the first check says otherwise, an instance is given the benefit of the doubt."""
    reason: str = "not checked yet"
    since: float = 0.0
    num_down: int = 0
    """How often it left rotation."""


class HealthChecker:
    def __init__(
        self,
        urls: list[str],
        interval: float = CHECK_INTERVAL_S,
        timeout: float = CHECK_TIMEOUT_S,
    ) -> None:
        self.interval, self.timeout = interval, timeout
        self.states = {url: InstanceHealth(since=time.monotonic()) for url in urls}

    def is_up(self, url: str) -> bool:
        return self.states[url].up

    def mark(self, url: str, up: bool, reason: str) -> None:
        state = self.states[url]
        if state.up != up:
            state.up, state.since = up, time.monotonic()
            if up:
                logger.info("router: %s is back in rotation", url)
            else:
                state.num_down += 1
                logger.warning("router: %s leaves rotation: %s", url, reason)
        state.reason = reason

    async def check(self, pool: UpstreamPool, url: str) -> None:
        try:
            async with asyncio.timeout(self.timeout):
                resp = await pool.get(url, "/health")
                try:
                    await resp.read()
                finally:
                    resp.release()
        except (Unreachable, UpstreamBroken, TimeoutError) as e:
            self.mark(url, False, f"/health failed: {type(e).__name__} {e}".strip())
            return
        if resp.status == 200:
            self.mark(url, True, "healthy")
        else:
            self.mark(url, False, f"/health answered {resp.status}")

    async def run(self, pool: UpstreamPool) -> None:
        """Check every instance, forever (cancel to stop), over the relay's own lean
        connections (a check's CPU is taken from the requests it meets). A check that fails
        in a way not foreseen takes its instance out of rotation (logged); the checks go on."""
        while True:
            urls = list(self.states)
            checks = (self.check(pool, url) for url in urls)
            done = await asyncio.gather(*checks, return_exceptions=True)
            for url, result in zip(urls, done, strict=True):
                if isinstance(result, Exception):
                    logger.error("router: checking %s failed", url, exc_info=result)
                    self.mark(url, False, f"/health check failed: {type(result).__name__}")
            await asyncio.sleep(self.interval)

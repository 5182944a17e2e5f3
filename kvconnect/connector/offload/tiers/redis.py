"""Redis tier: chunks as values in a Redis server that several engine instances share.

Values are the same self-checking records as the disk tier's. Redis evicts by its own policy
(maxmemory), invisibly to us, so this tier announces stores only; a GET that misses or fails a
check is a load error and the engine recomputes. A server that is down turns into errors that
are logged and counted, never into a stuck step.
"""

from __future__ import annotations

import logging
from typing import Any

import redis
import torch

from kvconnect.connector.offload.common import ChunkInfo
from kvconnect.connector.offload.tiers.base import Evicted, Tier, TierError, pack, unpack

logger = logging.getLogger(__name__)
KEY_PREFIX = "kvconnect:"


def redact(url: str) -> str:
    """The URL without its password, for logs."""
    scheme, sep, rest = url.partition("://")
    return f"{scheme}{sep}{rest.rpartition('@')[2]}" if sep else url


def connect(url: str) -> redis.Redis:
    """A client for `url` (password and rediss:// TLS as in the URL) with short timeouts."""
    return redis.Redis.from_url(url, socket_timeout=2.0, socket_connect_timeout=2.0)


class RedisTier(Tier):
    kind, medium = "redis", "EXTERNAL"
    shared = True

    def __init__(self, url: str) -> None:
        self.url = redact(url)
        self._client: Any = connect(url)
        self.num_errors = 0

    def contains(self, key: str) -> bool:
        try:
            return bool(self._client.exists(KEY_PREFIX + key))
        except redis.RedisError as e:
            self._failed("exists", e)
            return False

    def put(self, key: str, info: ChunkInfo, data: torch.Tensor) -> list[Evicted]:
        value = b"".join(pack(key, info, data))
        try:
            self._client.set(KEY_PREFIX + key, value)
        except redis.RedisError as e:
            raise TierError(self._failed("set", e)) from e
        return []

    def get(self, key: str) -> torch.Tensor | None:
        try:
            blob = self._client.get(KEY_PREFIX + key)
        except redis.RedisError as e:
            raise TierError(self._failed("get", e)) from e
        if blob is None:
            return None
        return unpack(blob, key)[1]

    def remove(self, key: str) -> ChunkInfo | None:
        return None  # shared entries are not ours to delete

    def clear(self) -> list[tuple[str, ChunkInfo]]:
        return []

    def _failed(self, op: str, e: Exception) -> str:
        self.num_errors += 1
        msg = f"redis tier {self.url}: {op} failed: {e}"
        logger.warning(msg)
        return msg

    def close(self) -> None:
        self._client.close()

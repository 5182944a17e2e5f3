"""Redis tier: chunks as values in a Redis server that several engine instances share.

Layout: one string value per chunk and rank, under `kvconnect:<chunk key>` (see
`common.chunk_key`), holding the same self-checking record as a disk tier file, with an expiry
when the tier has `ttl_s`. With `"cluster": true` the URL is any node of a Redis Cluster: the
chunk key's hash tag puts every rank's key of a chunk in one slot (one EXISTS per chunk), the
client follows slot moves and failovers, and what a failed master had not yet replicated is a
load miss, recomputed. Workers announce what they store; what Redis drops on its own (its
maxmemory policy, expiry) the scheduler half learns from Redis's keyspace notifications and
announces (`redis_watch.py`). A GET that misses or fails a check is a load error and the engine
recomputes. A server that is down turns into errors that are logged and counted, never into a
stuck step.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Self

import redis
import torch

from kvconnect.connector.offload.common import ChunkInfo, TierConfig
from kvconnect.connector.offload.kinds import TierKind
from kvconnect.connector.offload.tiers.base import (
    Evicted,
    RankKeys,
    RemovalWatcher,
    StoredChunk,
    Tier,
    TierError,
    TierPlacement,
    pack,
    read_mac_key,
    read_secret,
    unpack,
)
from kvconnect.connector.offload.tiers.redis_client import (
    ERRORS,
    KEY_PREFIX,
    connect,
    redact,
    with_password,
)
from kvconnect.connector.offload.tiers.redis_watch import RedisWatcher

logger = logging.getLogger(__name__)


class RedisTier(Tier):
    kind = TierKind.REDIS

    @classmethod
    def from_config(cls, config: TierConfig, placement: TierPlacement) -> Self:
        mac_key = read_mac_key(config.hmac_key_file) if config.hmac_key_file else None
        url = config.url
        if config.password_file:
            password = read_secret(config.password_file, "password_file").decode()
            url = with_password(url, password)
        return cls(url, config.ttl_s, config.cluster, config.watch, mac_key)

    def __init__(
        self,
        url: str,
        ttl_s: float | None = None,
        cluster: bool = False,
        watch: bool = True,
        mac_key: bytes | None = None,
    ) -> None:
        self.url = redact(url)
        self.mac_key = mac_key
        """Chunks are signed with it and must be (see `hmac_key_file`)."""
        self._raw_url = url
        self.ttl_ms = None if ttl_s is None else max(1, round(ttl_s * 1000))
        self.cluster = cluster
        self.watch = watch
        """Follow what the server drops (`watch_removals`)."""
        self._client: Any = None
        self.num_errors = 0
        try:
            self._client = connect(url, cluster)
        except ERRORS as e:  # a cluster client asks its nodes at once
            self._failed("connect", e)

    def _conn(self) -> Any:
        """The client; a cluster client that could not be made at start is tried again."""
        if self._client is None:
            try:
                self._client = connect(self._raw_url, self.cluster)
            except ERRORS as e:
                raise TierError(self._failed("connect", e)) from e
        return self._client

    def check_reachable(self) -> None:
        """`ValueError` naming the URL unless the server answers (checked at start)."""
        try:
            if self._client is None:
                raise redis.ConnectionError("no node of the cluster answered")
            self._client.ping()
        except ERRORS as e:
            what = "redis cluster tier" if self.cluster else "redis tier"
            if isinstance(e, redis.AuthenticationError | redis.exceptions.NoPermissionError):
                raise ValueError(
                    f"{what} {self.url} refused the URL's credentials ({e}); give "
                    f"redis://user:password@host:port/db (or redis://:password@... for "
                    f"requirepass)"
                ) from None
            raise ValueError(f"{what} {self.url} is unreachable: {e}") from None

    def contains(self, key: str) -> bool:
        try:
            return bool(self._conn().exists(KEY_PREFIX + key))
        except ERRORS as e:
            self._failed("exists", e)
            return False
        except TierError:
            return False

    def put(self, key: str, info: ChunkInfo, data: torch.Tensor) -> list[Evicted]:
        value = b"".join(pack(key, info, data, self.mac_key))
        try:
            self._conn().set(KEY_PREFIX + key, value, px=self.ttl_ms)
        except ERRORS as e:
            raise TierError(self._failed("set", e)) from e
        return []

    def load(self, key: str) -> StoredChunk | None:
        try:
            blob = self._conn().get(KEY_PREFIX + key)
        except ERRORS as e:
            raise TierError(self._failed("get", e)) from e
        if blob is None:
            return None
        return StoredChunk(*unpack(blob, key, self.mac_key))

    def num_held_prefix(self, chunks: Sequence[Sequence[str]]) -> int:
        """One pipelined round trip: an EXISTS of every rank's key per chunk."""
        try:
            # Each chunk's keys share a hash slot (see chunk_key): one EXISTS, also on a cluster.
            pipe = self._conn().pipeline(transaction=False)
            for keys in chunks:
                pipe.exists(*[KEY_PREFIX + k for k in keys])
            counts = pipe.execute()
        except ERRORS as e:
            raise TierError(self._failed("exists", e)) from e
        num = 0
        while num < len(chunks) and counts[num] == len(chunks[num]):
            num += 1
        return num

    def remove(self, key: str) -> ChunkInfo | None:
        return None  # shared entries are not ours to delete

    def clear(self) -> list[tuple[str, ChunkInfo]]:
        return []

    def check_integrity(self) -> None:
        return None  # no local bookkeeping: the server holds the entries

    def _failed(self, op: str, e: Exception) -> str:
        self.num_errors += 1
        msg = f"redis tier {self.url}: {op} failed: {e}"
        logger.warning(msg)
        return msg

    def watch_removals(
        self, key_prefix: str, world_size: int, rank_keys: RankKeys
    ) -> RemovalWatcher | None:
        """A `RedisWatcher` on the server's keyspace notifications, unless the tier's config
        says not to follow them or it is a cluster (whose notifications are per node)."""
        if not self.watch:
            return None
        if self.cluster:
            logger.warning(
                "offload: the redis cluster tier does not follow evictions; what the "
                "cluster drops is found by a load miss and recomputed"
            )
            return None
        return RedisWatcher(self._raw_url, key_prefix, world_size, rank_keys)

    def close(self) -> None:
        if self._client is not None:
            self._client.close()

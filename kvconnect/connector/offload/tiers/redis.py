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
stuck step; one that stops answering (down, paused, hung) makes the tier back off
(`backoff.py`): its operations fail at once, counted in `num_fast_failures`, and one probes
the server now and then (after `backoff_s`, doubling up to `max_backoff_s`) until it answers.
On a cluster the back-off covers every node: a failover stops the whole tier for a moment.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, Self, TypeVar

import redis
import torch

from kvconnect.connector.offload.common import ChunkInfo, TierConfig
from kvconnect.connector.offload.kinds import TierKind
from kvconnect.connector.offload.tiers.backoff import Backoff
from kvconnect.connector.offload.tiers.base import (
    Evicted,
    RankKeys,
    RemovalWatcher,
    StoredChunk,
    Tier,
    TierError,
    TierPlacement,
    TierUnavailable,
    pack,
    read_mac_key,
    read_secret,
    unpack,
)
from kvconnect.connector.offload.tiers.redis_client import (
    ERRORS,
    KEY_PREFIX,
    UNREACHABLE,
    connect,
    redact,
    with_password,
)
from kvconnect.connector.offload.tiers.redis_watch import RedisWatcher

logger = logging.getLogger(__name__)
T = TypeVar("T")


class RedisTier(Tier):
    kind = TierKind.REDIS

    @classmethod
    def from_config(cls, config: TierConfig, placement: TierPlacement) -> Self:
        mac_key = read_mac_key(config.hmac_key_file) if config.hmac_key_file else None
        url = config.url
        if config.password_file:
            password = read_secret(config.password_file, "password_file").decode()
            url = with_password(url, password)
        return cls(
            url,
            config.ttl_s,
            config.cluster,
            config.watch,
            mac_key,
            config.backoff_s,
            config.max_backoff_s,
        )

    def __init__(
        self,
        url: str,
        ttl_s: float | None = None,
        cluster: bool = False,
        watch: bool = True,
        mac_key: bytes | None = None,
        backoff_s: float = 0.5,
        max_backoff_s: float = 30.0,
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
        self.backoff = Backoff(backoff_s, max_backoff_s)
        """Whether operations go to the server now (see the module docstring)."""
        self.num_errors = 0
        """Operations that failed, fast ones included."""
        try:
            self._client = connect(url, cluster)
        except ERRORS as e:  # a cluster client asks its nodes at once
            self.backoff.failed()
            self._failed("connect", e)

    @property
    def num_fast_failures(self) -> int:
        """Operations that failed without being tried: the tier was backing off."""
        return self.backoff.num_fast_failures

    def _run(self, op: str, call: Callable[[Any], T]) -> T:
        """`call(client)`, unless the tier is backing off (`TierUnavailable`, nothing sent).
        No answer (`UNREACHABLE`) opens or lengthens the back-off, an answer ends it; either
        failure is a `TierError`, logged and counted. A cluster client that could not be made
        at start is made here."""
        if not self.backoff.allow():
            self.num_errors += 1
            raise TierUnavailable(f"redis tier {self.url}: {op} not tried: backing off")
        try:
            if self._client is None:
                self._client = connect(self._raw_url, self.cluster)
            result = call(self._client)
        except UNREACHABLE as e:
            self.backoff.failed()
            raise TierError(self._failed(op, e)) from e
        except ERRORS as e:
            self.backoff.succeeded()
            raise TierError(self._failed(op, e)) from e
        self.backoff.succeeded()
        return result

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
            return bool(self._run("exists", lambda c: c.exists(KEY_PREFIX + key)))
        except TierError:
            return False

    def put(self, key: str, info: ChunkInfo, data: torch.Tensor) -> list[Evicted]:
        value = b"".join(pack(key, info, data, self.mac_key))
        self._run("set", lambda c: c.set(KEY_PREFIX + key, value, px=self.ttl_ms))
        return []

    def load(self, key: str) -> StoredChunk | None:
        blob = self._run("get", lambda c: c.get(KEY_PREFIX + key))
        if blob is None:
            return None
        return StoredChunk(*unpack(blob, key, self.mac_key))

    def num_held_prefix(self, chunks: Sequence[Sequence[str]]) -> int:
        """One pipelined round trip: an EXISTS of every rank's key per chunk."""

        def exists_each(client: Any) -> list[int]:
            # Each chunk's keys share a hash slot (see chunk_key): one EXISTS, also on a cluster.
            pipe = client.pipeline(transaction=False)
            for keys in chunks:
                pipe.exists(*[KEY_PREFIX + k for k in keys])
            return list(pipe.execute())

        counts = self._run("exists", exists_each)
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
        if self.backoff.is_open:
            msg += f" (backing off: the next try in {self.backoff.delay_s:.1f} s)"
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

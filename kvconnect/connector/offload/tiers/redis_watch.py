"""What Redis drops on its own, announced: the scheduler half's follower of Redis's keyspace
notifications for the chunks this instance announced in the redis tier.

Redis evicts keys (its maxmemory policy) and expires them (the tier's `ttl_s`) without telling
its clients. With `notify-keyspace-events` holding `E` (keyevent channels) and `e`, `x`
(evicted, expired), it publishes each such key on `__keyevent@<db>__:evicted` and
`__keyevent@<db>__:expired`. The watcher enables those flags (CONFIG SET, merged with what is
set), subscribes, and turns a dropped key of an announced chunk into one removal:

    announce(last block hash, block hashes)   the scheduler released this chunk's
                                              BlockStored(STORAGE/REMOTE): watch it, and check
                                              it still exists (Redis may have dropped it
                                              between the write and the announcement)
    watcher thread                            a key of a watched chunk (any rank's) evicted
                                              or expired -> the chunk is queued as removed,
                                              once, and no longer watched
    (re)connect                               enable, subscribe, then resync: EXISTS of every
                                              rank's key of every watched chunk, and what is
                                              missing is removed (nothing dropped while the
                                              connection was down goes unannounced)
    take_removed()                            [(last block hash, block hashes)] to announce

One owner per event: each instance announces removals of what it announced itself, in its own
stream. A chunk several instances wrote is announced, and removed, by each of them; a router's
index keeps STORAGE/REMOTE entries per announcing instance (counted for every instance when
scoring), so each stream balances on its own and no instance needs to know of the others.

The watcher needs no CONFIG rights. Where the tier's user may not run CONFIG (managed Redis,
an ACL user such as `~kvconnect:* &__keyevent@* +get +set +exists +ping +subscribe`), the
operator sets `notify-keyspace-events` to include `Eex` on the server (redis.conf, or
`CONFIG SET notify-keyspace-events Eex` as an admin), and the watcher checks at start that
notifications arrive: it writes a probe key that expires at once and waits for its `expired`
notification (`PROBE_S`). If none comes, one error names the setting that is missing; what
Redis drops is then found by a load miss (the engine recomputes) and never announced.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import redis

from kvconnect.connector.offload.tiers.redis_client import KEY_PREFIX, connect, redact
from kvconnect.events import ExternalBlockHash

logger = logging.getLogger(__name__)

NEEDED_FLAGS = "Eex"
RETRY_S = (0.1, 0.2, 0.5, 1.0, 2.0)
PING_EVERY_S = 2.0
PROBE_S = 3.0
"""How long the start-up check waits for its probe key's expiry to be published (Redis
expires keys in a background cycle ten times a second)."""


def merged_flags(current: str) -> str:
    """`current` notify-keyspace-events flags plus what the watcher needs (`A` is every
    event class, so it covers `e` and `x`)."""
    missing = [f for f in NEEDED_FLAGS if f not in current and not (f in "ex" and "A" in current)]
    return current + "".join(missing)


def last_hash_of(key: bytes | str, prefix: str) -> bytes | None:
    """The chunk (its last block hash) a key `prefix<rank>/{<hex>}` names; None for a key of
    another model or world size, or not the tier's at all."""
    name = key.decode(errors="replace") if isinstance(key, bytes) else key
    if not name.startswith(prefix):
        return None
    rank, _, digest = name[len(prefix) :].partition("/")
    if not rank.isdigit():
        return None
    if not (digest.startswith("{") and digest.endswith("}")):
        return None
    try:
        return bytes.fromhex(digest[1:-1]) or None
    except ValueError:
        return None


class RedisWatcher:
    def __init__(
        self,
        url: str,
        key_prefix: str,
        world_size: int,
        rank_keys: Callable[[bytes], list[str]],
    ) -> None:
        """`key_prefix` (after the tier's own "kvconnect:") starts every key of this model and
        world size, "<model>/<world_size>/"; `rank_keys(last block hash)` are a chunk's keys
        on every rank."""
        self.url = redact(url)
        self._raw_url = url
        self.prefix = KEY_PREFIX + key_prefix
        self.world_size = world_size
        self.rank_keys = rank_keys
        self._lock = threading.Lock()
        self._watched: dict[bytes, list[ExternalBlockHash]] = {}
        self._unchecked: list[bytes] = []  # announced, existence not yet checked
        self._removed: list[tuple[bytes, list[ExternalBlockHash]]] = []
        self._stop = threading.Event()
        self.connected = threading.Event()
        self.num_notifications = 0
        self.num_removed = 0
        self.num_resyncs = 0
        self.enabled_by_us = False
        self.notifications_checked: bool | None = None
        """Whether notifications were seen to arrive (probe) or to be configured (CONFIG);
        None until the first connection."""
        self._thread = threading.Thread(target=self._run, name="kv-redis-watch", daemon=True)
        self._thread.start()

    # -- the scheduler's side -------------------------------------------------------------------

    def announce(self, last_block_hash: bytes, block_hashes: Sequence[ExternalBlockHash]) -> None:
        with self._lock:
            self._watched[last_block_hash] = list(block_hashes)
            self._unchecked.append(last_block_hash)

    def take_removed(self) -> list[tuple[bytes, list[ExternalBlockHash]]]:
        with self._lock:
            removed, self._removed = self._removed, []
        return removed

    @property
    def num_watched(self) -> int:
        with self._lock:
            return len(self._watched)

    @property
    def has_removed(self) -> bool:
        with self._lock:
            return bool(self._removed)

    def shutdown(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)

    # -- the thread ----------------------------------------------------------------------------

    def _run(self) -> None:
        attempt = 0
        while not self._stop.is_set():
            client: Any = None
            pubsub: Any = None
            try:
                client = connect(self._raw_url)
                db = client.connection_pool.connection_kwargs.get("db", 0)
                pubsub = client.pubsub(ignore_subscribe_messages=True)
                pubsub.subscribe(f"__keyevent@{db}__:evicted", f"__keyevent@{db}__:expired")
                self._enable(client, pubsub)
                self._check(client, resync=True)
                self.connected.set()
                if attempt:
                    logger.info("redis tier %s: notifications followed again", self.url)
                attempt = 0
                self._follow(client, pubsub)
            except (redis.RedisError, OSError) as e:
                self.connected.clear()
                delay = RETRY_S[min(attempt, len(RETRY_S) - 1)]
                if attempt == 0:
                    logger.warning(
                        "redis tier %s: notification connection lost (%s); reconnecting",
                        self.url,
                        e,
                    )
                attempt += 1
                self._stop.wait(delay)
            finally:
                for conn in (pubsub, client):
                    if conn is not None:
                        with contextlib.suppress(redis.RedisError, OSError):
                            conn.close()
        self.connected.clear()

    def _enable(self, client: Any, pubsub: Any) -> None:
        """Make sure the server publishes evictions and expiries: merge the flags in with
        CONFIG where allowed, else (first connection only) probe that they are set."""
        try:
            current = client.config_get("notify-keyspace-events").get("notify-keyspace-events", "")
        except redis.ResponseError as e:  # no CONFIG rights (ACL, managed Redis)
            if self.notifications_checked is None:
                self._probe(client, pubsub, e)
            return
        wanted = merged_flags(current)
        if wanted != current:
            try:
                client.config_set("notify-keyspace-events", wanted)
                self.enabled_by_us = True
            except redis.ResponseError as e:
                self._probe(client, pubsub, e)
                return
        self.notifications_checked = True

    def _probe(self, client: Any, pubsub: Any, why: Exception) -> None:
        """A key of ours that expires at once: its `expired` notification must arrive."""
        probe = f"{KEY_PREFIX}probe/{uuid.uuid4().hex}"
        client.set(probe, b"", px=1)
        deadline = time.monotonic() + PROBE_S
        while time.monotonic() < deadline:
            message = pubsub.get_message(timeout=0.1)
            if message is None or message.get("type") != "message":
                continue
            if message["data"] in (probe, probe.encode()):
                self.notifications_checked = True
                logger.info(
                    "redis tier %s: no CONFIG rights (%s); keyspace notifications arrive "
                    "(the server's notify-keyspace-events must include %r for evictions too)",
                    self.url,
                    why,
                    NEEDED_FLAGS,
                )
                return
            self._dropped(message["data"])
        self.notifications_checked = False
        logger.error(
            "redis tier %s: keyspace notifications are off and this user may not enable them "
            "(%s): have the operator set notify-keyspace-events to include %r on the server "
            "(redis.conf or CONFIG SET); until then what Redis evicts or expires is not "
            "announced",
            self.url,
            why,
            NEEDED_FLAGS,
        )

    def _follow(self, client: Any, pubsub: Any) -> None:
        last_ping = time.monotonic()
        while not self._stop.is_set():
            message = pubsub.get_message(timeout=0.05)
            while message is not None:
                if message.get("type") == "message":
                    self._dropped(message["data"])
                message = pubsub.get_message(timeout=0)
            self._check(client)
            if time.monotonic() - last_ping > PING_EVERY_S:  # a silent dead link shows here
                pubsub.ping()
                last_ping = time.monotonic()

    def _dropped(self, key: bytes | str) -> None:
        self.num_notifications += 1
        last = last_hash_of(key, self.prefix)
        if last is None:
            return
        with self._lock:
            hashes = self._watched.pop(last, None)
            if hashes is not None:
                self._removed.append((last, hashes))
                self.num_removed += 1

    def _check(self, client: Any, resync: bool = False) -> None:
        """The newly announced chunks (or, on `resync`, every watched one: whatever went while
        nobody listened) must still exist whole; what does not is removed. Notifications are
        already subscribed, so anything dropped later is heard."""
        with self._lock:
            watched = list(self._watched) if resync else self._unchecked
            self._unchecked = []
        if watched:
            pipe = client.pipeline(transaction=False)
            for last in watched:
                pipe.exists(*[KEY_PREFIX + k for k in self.rank_keys(last)])
            counts = pipe.execute()
            with self._lock:
                for last, count in zip(watched, counts, strict=True):
                    if count < self.world_size and last in self._watched:
                        self._removed.append((last, self._watched.pop(last)))
                        self.num_removed += 1
        if resync:
            self.num_resyncs += 1

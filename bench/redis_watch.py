"""The redis tier's eviction watcher (tiers/redis_watch.py) against a real redis-server, beside
a bare redis-py pub/sub loop on the same notifications in the same run.

    notifications/s   chunks of 2 ranks, 20,000 keys evicted by an allkeys-lru maxmemory as
                      new keys are written: how fast the watcher turns them into removals
    lag p50/p99       from the SET that makes Redis evict one watched chunk's key to its
                      BlockRemoved(STORAGE/REMOTE) decoded by a KVEventSubscriber, published through
                      kvconnect's ZMQ publisher as soon as the watcher has it (an engine
                      publishes it at its next step: kvconnect serve steps at least every
                      0.2 s when a connector has pending work)

Prints one line; bench/offload.py prints it too.
"""

from __future__ import annotations

import statistics
import time

import redis

from kvconnect.commands.redis_server import LocalRedis
from kvconnect.connector.offload.tiers.redis import KEY_PREFIX
from kvconnect.connector.offload.tiers.redis_watch import RedisWatcher
from kvconnect.events import BlockRemoved, KVEventBatch
from kvconnect.stream.publisher import ZmqEventPublisher
from kvconnect.stream.subscriber import KVEventSubscriber, ReceivedBatch

PREFIX = "m/2/"
VALUE = b"x" * 1000
NUM = 20_000


def keys_of(last: bytes) -> list[str]:
    return [f"{PREFIX}{r}/{{{last.hex()}}}" for r in range(2)]


def lasts(start: int, n: int) -> list[bytes]:
    return [i.to_bytes(32, "big") for i in range(start, start + n)]


def fill_to_limit(client: redis.Redis, n: int) -> None:
    """Room for about `n` values, then LRU eviction."""
    client.flushall()
    client.config_set("maxmemory", 0)
    used = int(client.info("memory")["used_memory"])
    client.config_set("maxmemory", used + n * (len(VALUE) + 150))
    client.config_set("maxmemory-policy", "allkeys-lru")


def write(client: redis.Redis, names: list[str]) -> None:
    pipe = client.pipeline(transaction=False)
    for name in names:
        pipe.set(KEY_PREFIX + name, VALUE)
    pipe.execute()


ROOM = 2000  # values that fit under maxmemory
BATCH = 900  # chunks (2 keys each) written, watched, then all evicted at once


def bare_rate(client: redis.Redis, port: int) -> float:
    """Evicted notifications a plain pub/sub loop receives per second."""
    fill_to_limit(client, ROOM)
    write(client, [f"warm/{i}" for i in range(ROOM)])
    sub = redis.Redis(port=port).pubsub(ignore_subscribe_messages=True)
    sub.subscribe("__keyevent@0__:evicted")
    sub.get_message(timeout=1.0)  # the subscription is active from here
    before = int(client.info("stats")["evicted_keys"])
    t0 = time.perf_counter()
    write(client, [f"bare/{i}" for i in range(NUM)])
    expected = int(client.info("stats")["evicted_keys"]) - before
    got = 0
    deadline = time.monotonic() + 60
    while got < expected and time.monotonic() < deadline:
        if sub.get_message(timeout=1.0) is not None:
            got += 1
    elapsed = time.perf_counter() - t0
    sub.close()
    # The warm fill only approximates the room, so a few of the first writes may still fit.
    assert got == expected > NUM * 9 // 10, (got, expected)
    return got / elapsed


def watcher_rate(client: redis.Redis, url: str) -> float:
    """Notifications per second while every one of them removes a watched chunk."""
    watcher = RedisWatcher(url, PREFIX, 2, keys_of)
    assert watcher.connected.wait(10)
    handled, elapsed = 0, 0.0
    for b in range(NUM // (2 * BATCH)):
        fill_to_limit(client, ROOM)
        chunks = lasts(b * BATCH, BATCH)
        write(client, [k for last in chunks for k in keys_of(last)])
        for last in chunks:
            watcher.announce(last, [int.from_bytes(last[-8:], "big")])
        deadline = time.monotonic() + 10
        while watcher._unchecked and time.monotonic() < deadline:  # existence checked
            time.sleep(0.001)
        assert not watcher.take_removed()
        seen = watcher.num_notifications
        t0 = time.perf_counter()
        write(client, [f"push/{b}/{i}" for i in range(3 * ROOM)])  # evicts (nearly) all
        t1 = time.perf_counter()
        gone = sum(client.exists(*[KEY_PREFIX + k for k in keys_of(last)]) < 2 for last in chunks)
        t0 += time.perf_counter() - t1  # not the watcher's time
        removed = 0
        deadline = time.monotonic() + 30
        while removed < gone and time.monotonic() < deadline:
            removed += len(watcher.take_removed())
        elapsed += time.perf_counter() - t0
        assert removed == gone > BATCH // 2, (removed, gone)
        handled += watcher.num_notifications - seen
    watcher.shutdown()
    return handled / elapsed


def lags(client: redis.Redis, url: str, samples: int = 200) -> list[float]:
    """Seconds from the evicting SET to the watched chunk's BlockRemoved decoded by a
    subscriber. The chunk's keys are the only ones with an expiry under volatile-lru, so they
    are what Redis evicts."""
    out = []
    watcher = RedisWatcher(url, PREFIX, 2, keys_of)
    pub = ZmqEventPublisher.open(bind=True, endpoint="tcp://127.0.0.1:0")
    sub = KVEventSubscriber(pub.endpoint)
    try:
        assert watcher.connected.wait(10) and pub.wait_for_subscriber()
        for i in range(samples):
            client.flushall()
            client.config_set("maxmemory", 0)
            client.config_set("maxmemory-policy", "volatile-lru")
            last = lasts(10**6 + i, 1)[0]
            pipe = client.pipeline(transaction=False)
            for name in keys_of(last):
                pipe.set(KEY_PREFIX + name, VALUE, ex=3600)
            pipe.execute()
            watcher.announce(last, [i])
            while watcher._unchecked:
                time.sleep(0.0005)
            assert not watcher.take_removed()
            used = int(client.info("memory")["used_memory"])
            client.config_set("maxmemory", used + len(VALUE) // 2)
            t0 = time.perf_counter()
            client.set(f"fill/{i}", VALUE)  # over the limit: Redis evicts a chunk key
            while not (removed := watcher.take_removed()):
                if time.perf_counter() - t0 > 5:
                    raise AssertionError("the eviction was not seen")
            hashes = [h for _, ids in removed for h in ids]
            pub.publish(
                KVEventBatch(time.time(), [BlockRemoved(hashes, "STORAGE", locality="REMOTE")])
            )
            item = sub.recv(timeout=5)
            assert isinstance(item, ReceivedBatch), item
            assert item.batch.events == [BlockRemoved([i], "STORAGE", locality="REMOTE")], (
                item.batch.events
            )
            out.append(time.perf_counter() - t0)
    finally:
        sub.close()
        pub.shutdown()
        watcher.shutdown()
    return out


def measure() -> str:
    server = LocalRedis()
    try:
        client = redis.Redis(port=server.port)
        client.config_set("notify-keyspace-events", "Eex")
        bare = bare_rate(client, server.port)
        rate = watcher_rate(client, server.url)
        lag = sorted(lags(client, server.url))
        p50 = statistics.median(lag) * 1000
        p99 = lag[int(len(lag) * 0.99) - 1] * 1000
    finally:
        server.stop()
    return (
        f"redis watch: {rate / 1000:.0f}k notifications/s handled (bare pub/sub loop "
        f"{bare / 1000:.0f}k/s); eviction -> BlockRemoved at a subscriber p50 {p50:.1f} ms "
        f"p99 {p99:.1f} ms"
    )


def main() -> None:
    print(measure())


if __name__ == "__main__":
    main()

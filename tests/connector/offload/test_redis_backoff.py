"""A redis tier against a real redis-server that stops answering (SIGSTOP): the first operation
waits out the socket timeout, the next ones fail at once without a try (counted as fast
failures), and once the server runs again (SIGCONT) a probe finds it and the tier stores and
loads as before. Timed only where the cost is the point, with a wide margin."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator

import pytest
import redis
import torch

from kvconnect.commands.redis_server import LocalRedis
from kvconnect.connector.offload.tiers.base import TierError
from kvconnect.connector.offload.tiers.redis import RedisTier
from tests.conftest import start_redis
from tests.connector.offload.test_tiers import chunk
from tests.helpers import wait_for

TIMEOUT_S = 0.5
NUM_OPS = 30


@pytest.fixture
def server() -> Iterator[LocalRedis]:
    s = start_redis()
    yield s
    if s.proc.poll() is None:
        os.kill(s.proc.pid, signal.SIGCONT)  # a stopped server would not stop
    s.stop()


def operations(tier: RedisTier) -> list[Callable[[], object]]:
    """A load, a store and a prefix lookup: each raises TierError when Redis fails."""
    key, info, data = chunk(2)
    return [
        lambda: tier.load(chunk(1)[0]),
        lambda: tier.put(key, info, data),
        lambda: tier.num_held_prefix([[chunk(1)[0]]]),
    ]


def test_a_paused_redis_costs_one_timeout_then_fails_fast_until_a_probe_finds_it_back(
    server: LocalRedis,
) -> None:
    tier = RedisTier(f"{server.url}?socket_timeout={TIMEOUT_S}&socket_connect_timeout={TIMEOUT_S}")
    key, info, data = chunk(1)
    tier.put(key, info, data)
    ops = operations(tier)
    os.kill(server.proc.pid, signal.SIGSTOP)
    failures: list[TierError] = []
    start = time.monotonic()
    for i in range(NUM_OPS):
        with pytest.raises(TierError) as caught:
            ops[i % len(ops)]()
        failures.append(caught.value)
    elapsed = time.monotonic() - start
    timed_out = sum(isinstance(e.__cause__, redis.TimeoutError) for e in failures)
    # The first waits out the timeout; the back-off (0.5 s) may let a probe or two through.
    assert timed_out <= 3, f"{timed_out} of {NUM_OPS} operations waited out the socket timeout"
    untried = sum(e.__cause__ is None for e in failures)  # no redis error behind it
    assert tier.num_fast_failures == NUM_OPS - timed_out == untried
    assert tier.num_errors == NUM_OPS and tier.backoff.is_open
    assert elapsed < NUM_OPS * TIMEOUT_S / 3, elapsed  # without the back-off: 15 s at least
    assert not tier.contains(key)  # still stopped: a miss

    os.kill(server.proc.pid, signal.SIGCONT)
    wait_for(lambda: tier.contains(key), what="the tier never probed the server again")
    assert not tier.backoff.is_open and tier.backoff.num_openings == 1
    errors = tier.num_errors
    key2, info2, data2 = chunk(3)
    assert tier.put(key2, info2, data2) == []
    loaded = tier.load(key2)
    assert loaded is not None and torch.equal(loaded.data, data2) and loaded.info == info2
    assert tier.num_held_prefix([[key], [key2]]) == 2
    assert tier.num_errors == errors  # nothing failed once it was back
    tier.close()


def test_a_refused_connection_backs_off_too_and_a_server_started_again_is_used(
    server: LocalRedis,
) -> None:
    """A server that is gone answers nothing either: its refusals cost little, but the tier
    stops sending until a probe, and uses the server started again on the same port."""
    tier = RedisTier(server.url)
    key, info, data = chunk(1)
    server.stop()
    with pytest.raises(TierError, match="get failed"):
        tier.load(key)
    for op in operations(tier):
        with pytest.raises(TierError, match="not tried"):
            op()
    assert (tier.num_fast_failures, tier.num_errors) == (3, 4)
    again = LocalRedis(port=server.port)
    try:

        def back() -> bool:
            tier.contains(key)  # the probe, once the wait is over
            return not tier.backoff.is_open

        wait_for(back, what="the tier never probed the server again")
        errors = tier.num_errors  # the waits' misses, all fast: nothing sent
        assert errors == 4 + tier.num_fast_failures - 3
        assert tier.put(key, info, data) == []
        loaded = tier.load(key)
        assert loaded is not None and torch.equal(loaded.data, data)
        assert tier.num_errors == errors
    finally:
        tier.close()
        again.stop()

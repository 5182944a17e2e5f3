"""The redis tier's back-off as a state machine on a clock the test moves (no waiting): fail
fast while open, one probe per interval, doubling to the cap, jitter within bounds, a success
closes it; and its two settings in the tier's config."""

import pytest

from kvconnect.connector.offload.common import OffloadConfig, TierConfig
from kvconnect.connector.offload.kinds import TierKind
from kvconnect.connector.offload.tiers.backoff import Backoff


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def no_jitter() -> float:
    return 0.5  # the middle of [0, 1): a factor of exactly 1


def test_a_failure_opens_it_and_each_failed_probe_doubles_the_wait_up_to_the_cap() -> None:
    clock = Clock()
    backoff = Backoff(0.5, 2.0, clock=clock, rng=no_jitter)
    assert backoff.allow() and backoff.allow() and not backoff.is_open  # closed: every one
    backoff.failed()
    assert (backoff.is_open, backoff.delay_s, backoff.num_openings) == (True, 0.5, 1)
    waits = []
    for _ in range(4):  # each probe fails
        start = clock.now
        while not backoff.allow():
            clock.now += 0.125
        waits.append(clock.now - start)
        assert not backoff.allow()  # the probe is out: the others still fail fast
        backoff.failed()
    assert waits == [0.5, 1.0, 2.0, 2.0]  # doubled, then capped at max_s
    assert backoff.num_fast_failures == (4 + 8 + 16 + 16) + 4  # each tick, and beside each probe
    assert backoff.num_openings == 1  # one outage, however many probes failed


def test_a_success_closes_it_and_the_next_failure_starts_again_from_the_first_delay() -> None:
    clock = Clock()
    backoff = Backoff(0.5, 30.0, clock=clock, rng=no_jitter)
    backoff.failed()
    backoff.failed()  # an operation already in flight fails too: the delay grows
    assert backoff.delay_s == 1.0
    clock.now += 1.0
    assert backoff.allow()  # the probe
    backoff.succeeded()
    assert not backoff.is_open and backoff.delay_s is None
    assert all(backoff.allow() for _ in range(5))
    backoff.failed()
    assert (backoff.delay_s, backoff.num_openings) == (0.5, 2)


def test_a_probe_that_never_reports_does_not_wedge_it() -> None:
    clock = Clock()
    backoff = Backoff(0.5, 30.0, clock=clock, rng=no_jitter)
    backoff.failed()
    clock.now += 0.5
    assert backoff.allow()  # a probe whose caller dies before it says how it went
    assert not backoff.allow()
    clock.now += 0.5
    assert backoff.allow()  # the next probe, a delay later


@pytest.mark.parametrize(("draw", "factor"), [(0.0, 0.9), (0.5, 1.0), (0.999999, 1.1)])
def test_each_wait_is_the_delay_within_the_jitter(draw: float, factor: float) -> None:
    clock = Clock()
    backoff = Backoff(1.0, 30.0, jitter=0.1, clock=clock, rng=lambda: draw)
    backoff.failed()
    clock.now += factor * 1.0 - 1e-3
    assert not backoff.allow()
    clock.now += 2e-3
    assert backoff.allow()


@pytest.mark.parametrize(
    ("initial_s", "max_s", "jitter"), [(0.0, 1.0, 0.1), (2.0, 1.0, 0.1), (1.0, 2.0, 1.0)]
)
def test_bad_settings_are_refused(initial_s: float, max_s: float, jitter: float) -> None:
    with pytest.raises(ValueError, match="back-off"):
        Backoff(initial_s, max_s, jitter)


def test_the_config_has_the_settings_for_redis_with_their_defaults() -> None:
    extra = {"tiers": [{"kind": "redis", "url": "u", "backoff_s": 0.25, "max_backoff_s": 4}]}
    tier = OffloadConfig.from_extra_config(extra, block_size=16).tiers[0]
    assert (tier.backoff_s, tier.max_backoff_s) == (0.25, 4.0)
    default = TierConfig(TierKind.REDIS, url="u")
    assert (default.backoff_s, default.max_backoff_s) == (0.5, 30.0)


@pytest.mark.parametrize(
    ("tier", "match"),
    [
        ({"backoff_s": 0}, r"> 0\.0 - at `tiers\[0\]\.backoff_s`"),
        ({"max_backoff_s": -1}, r"> 0\.0 - at `tiers\[0\]\.max_backoff_s`"),
        ({"backoff_s": "1"}, r"got `str` - at `tiers\[0\]\.backoff_s`"),
        ({"backoff_s": 2, "max_backoff_s": 1}, "max_backoff_s=1.0 must be at least backoff_s=2.0"),
        ({"kind": "disk", "path": "p", "backoff_s": 1}, "redis options"),
    ],
)
def test_bad_settings_in_the_config_name_the_field(tier: dict[str, object], match: str) -> None:
    extra = {"tiers": [{"kind": "redis", "url": "u", **tier}]}
    with pytest.raises(ValueError, match=match):
        OffloadConfig.from_extra_config(extra, block_size=16)


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"backoff_s": 0.0}, "backoff_s=0.0 must be > 0"),
        ({"max_backoff_s": float("nan")}, "max_backoff_s=nan must be > 0"),
        ({"max_backoff_s": 0.1}, "max_backoff_s=0.1 must be at least backoff_s=0.5"),
    ],
)
def test_a_config_made_in_code_is_checked_too(fields: dict[str, float], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        TierConfig(TierKind.REDIS, url="u", **fields)  # type: ignore[arg-type]

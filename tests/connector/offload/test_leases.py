"""Leases (P/D: a prefill's chunks kept for the decode instance that pulls them): granted,
released over the peer server's RELEASE, expired; the cpu tier evicts around them."""

from __future__ import annotations

import pytest
import torch

from kvconnect.connector.offload.common import ChunkInfo
from kvconnect.connector.offload.peers.leases import EARLY_RELEASE_S, Grant, Leases
from kvconnect.connector.offload.peers.protocol import Deadline, Hello, Served
from kvconnect.connector.offload.peers.tcp import TcpPeerClient, TcpPeerServer
from kvconnect.connector.offload.tiers.base import TierError
from kvconnect.connector.offload.tiers.cpu import CpuTier

SHAPE = (2, 2, 16, 1, 4)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def info(i: int) -> ChunkInfo:
    return ChunkInfo(bytes([i]) * 32, (i,), None, tuple(range(16)), 16)


def test_a_lease_holds_its_keys_until_released_or_expired() -> None:
    clock = Clock()
    leases = Leases(clock)
    assert leases.grant("a", ["k1", "k2"], ttl_s=30)
    assert leases.grant("b", ["k2", "k3", "k3"], ttl_s=10)
    assert {k for k in ("k1", "k2", "k3", "k4") if k in leases} == {"k1", "k2", "k3"}
    assert leases.release("a") and not leases.release("a")
    assert "k1" not in leases and "k2" in leases  # b still holds k2
    clock.now += 10
    assert "k2" not in leases and "k3" not in leases and len(leases) == 0
    leases.check_integrity()


def test_expire_counts_the_leases_that_ran_out() -> None:
    clock = Clock()
    leases = Leases(clock)
    leases.grant("a", ["k1"], ttl_s=5)
    leases.grant("b", ["k2"], ttl_s=50)
    clock.now += 6
    assert leases.expire() == 1 and len(leases) == 1
    leases.check_integrity()


def test_a_release_before_the_grant_cancels_it() -> None:
    """The decode instance may release before the prefill's workers grant (they learn of the
    lease a step after the answer left): the grant then holds nothing."""
    clock = Clock()
    leases = Leases(clock)
    assert not leases.release("early")
    assert not leases.grant("early", ["k1"], ttl_s=30)
    assert "k1" not in leases
    assert leases.grant("early", ["k1"], ttl_s=30)  # remembered once
    assert not leases.release("late")
    clock.now += EARLY_RELEASE_S + 1
    leases.release("other")  # forgets what is older
    assert leases.grant("late", ["k2"], ttl_s=30)
    leases.check_integrity()


def test_leases_are_bounded_per_instance_and_per_client() -> None:
    """Of 8 slots, leases hold at most half, and one client a quarter: past either a grant
    holds nothing (REFUSED); a key two leases share counts once; room comes back with a
    release."""
    leases = Leases(Clock(), capacity=8, max_share=0.5, max_share_per_client=0.25)
    assert leases.grant("x1", ["a", "b"], ttl_s=30, owner="x") is Grant.GRANTED
    assert leases.grant("x2", ["c"], ttl_s=30, owner="x") is Grant.REFUSED  # x's 3 > 2
    assert "c" not in leases and leases.num_held() == 2
    assert leases.grant("x3", ["a", "b"], ttl_s=30, owner="x") is Grant.GRANTED  # the same 2
    assert leases.grant("y1", ["c", "d"], ttl_s=30, owner="y") is Grant.GRANTED  # 4 of 8
    assert leases.grant("z1", ["e"], ttl_s=30, owner="z") is Grant.REFUSED  # 5 > half
    leases.release("y1")
    assert leases.grant("z1", ["e"], ttl_s=30, owner="z") is Grant.GRANTED
    assert not leases.grant("z2", ["f", "g"], ttl_s=30, owner="z")  # falsy unless granted
    leases.check_integrity()


def test_the_cpu_tier_evicts_around_leased_chunks_and_refuses_when_all_are() -> None:
    slot = 2 * 2 * 16 * 1 * 4 * 4
    tier = CpuTier(2 * slot, SHAPE, torch.float32)
    leases = Leases(Clock())
    tier.leased = leases.__contains__
    tier.put("a", info(0), torch.zeros(SHAPE))
    tier.put("b", info(1), torch.ones(SHAPE))
    leases.grant("lease", ["a"], ttl_s=30)
    evicted = tier.put("c", info(2), torch.ones(SHAPE))  # "a" is older, but leased
    assert [e.key for e in evicted] == ["b"]
    leases.grant("lease2", ["c"], ttl_s=30)
    with pytest.raises(TierError, match="all 2 slots hold leased chunks"):
        tier.put("d", info(3), torch.ones(SHAPE))
    assert tier.contains("a") and tier.contains("c") and not tier.contains("d")
    leases.release("lease")
    assert [e.key for e in tier.put("d", info(3), torch.ones(SHAPE))] == ["a"]
    tier.check_integrity()
    leases.check_integrity()


def test_release_over_the_peer_server() -> None:
    leases = Leases()
    leases.grant("req-1", ["k"], ttl_s=30)
    ns = "tiny@0123456789abcdef"
    served = Served(lambda _: 0, lambda _: None, leases.release)
    server = TcpPeerServer("127.0.0.1", 0, Hello(1, 0, ns), served, None, 5.0, 64.0, 8)
    client = TcpPeerClient("127.0.0.1", server.port, 1, 0, ns, None)
    try:
        assert client.release("req-1", Deadline(5.0)) is True
        assert "k" not in leases
        assert client.release("req-1", Deadline(5.0)) is False
        with pytest.raises(TierError, match="refused RELEASE: RELEASE: 300 bytes"):
            client.release("x" * 300, Deadline(5.0))
        assert client.release("req-2", Deadline(5.0)) is False  # the server served on
    finally:
        client.close()
        server.close()
    leases.check_integrity()

"""Leases: chunks a prefill instance keeps for a decode instance that will pull them (P/D).

A request that arrives with `kv_transfer_params.do_remote_decode` leases its prompt's chunks
when it finishes (`OffloadScheduler.request_finished`): every worker then keeps them in its
cpu tier until the decode instance's ranks release the lease after pulling (the peer
server's RELEASE) or until it expires (`kv_lease_duration`, 30 s by default, as vLLM's
NixlConnector). The cpu tier evicts around leased chunks; when every slot is leased, the
store that needs a slot is dropped (counted). After the lease, the chunks age like any
others.

    leases = Leases(capacity=64, max_share=0.5, max_share_per_client=0.25)
    leases.grant("req-7", keys, ttl_s=30.0, owner="client-a")   Grant.GRANTED
    key in leases            True while some unexpired lease holds it
    leases.release("req-7")  True once; False for an unknown or expired lease
    leases.grant(...)        Grant.RELEASED when the lease was released before it was
                             granted; Grant.REFUSED past a quota: nothing is held

Quotas (issue 46): leases together hold at most `max_share` of the cpu tier's `capacity`
slots, and one client's (`owner`: the API key a request came with) at most
`max_share_per_client`; a lease that would go past either holds nothing (its request ran
without one: its decode instance pulls what is still there and computes the rest), so no
client can pin the tier and push every other tenant's chunks out.

A decode instance may release a lease before the prefill instance's workers grant it: the
prefill answers as its request finishes, and its workers learn of the lease with the next
step's metadata. A release of an unknown lease is therefore remembered for a while
(`EARLY_RELEASE_S`), and the grant it precedes is not made.
    leases.expire()          how many leases ran out (dropped now)

Thread-safe: the step thread grants, the peer server's thread releases, the I/O thread asks.
"""

from __future__ import annotations

import enum
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence

MAX_LEASES = 1 << 16
"""Leases held at once; beyond this the one granted first ends early."""
EARLY_RELEASE_S = 60.0
MAX_EARLY_RELEASES = 4096


class Grant(enum.Enum):
    """What `Leases.grant` did; truthy only when it granted."""

    GRANTED = "granted"
    RELEASED = "released"
    """The decode instance released it before it was granted: nothing is held."""
    REFUSED = "refused"
    """Past a quota: nothing is held."""

    def __bool__(self) -> bool:
        return self is Grant.GRANTED


class Leases:
    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        capacity: int | None = None,
        max_share: float = 1.0,
        max_share_per_client: float = 1.0,
    ) -> None:
        """`capacity`: the cpu tier's slots (None: no quota)."""
        self._clock = clock
        self._lock = threading.Lock()
        self._by_id: OrderedDict[str, tuple[float, tuple[str, ...], str | None]] = OrderedDict()
        self._held: Counter[str] = Counter()
        self._held_by: dict[str | None, Counter[str]] = {}
        self._early: OrderedDict[str, float] = OrderedDict()  # released before granted
        self.capacity = capacity
        self.max_share, self.max_share_per_client = max_share, max_share_per_client

    def grant(
        self, lease_id: str, keys: Sequence[str], ttl_s: float, owner: str | None = None
    ) -> Grant:
        """Hold `keys` for `ttl_s` seconds under `lease_id` (granted again: replaced), for
        client `owner`; nothing if it was released already or would go past a quota."""
        with self._lock:
            if self._early.pop(lease_id, None) is not None:
                return Grant.RELEASED
            self._drop(lease_id)
            if not self._within_quota(set(keys), owner):
                return Grant.REFUSED
            self._by_id[lease_id] = (self._clock() + ttl_s, tuple(keys), owner)
            self._held.update(keys)
            self._held_by.setdefault(owner, Counter()).update(keys)
            while len(self._by_id) > MAX_LEASES:
                self._drop(next(iter(self._by_id)))
        return Grant.GRANTED

    def _within_quota(self, keys: set[str], owner: str | None) -> bool:
        """Whether `owner` may lease `keys` too (under the lock)."""
        if self.capacity is None:
            return True
        total = len(self._held) + len(keys - self._held.keys())
        theirs = self._held_by.get(owner, Counter())
        mine = len(theirs) + len(keys - theirs.keys())
        return total <= int(self.max_share * self.capacity) and mine <= int(
            self.max_share_per_client * self.capacity
        )

    def release(self, lease_id: str) -> bool:
        """End `lease_id`: True if it was held; else it is remembered, so that its grant,
        should it come later, holds nothing."""
        with self._lock:
            if self._drop(lease_id):
                return True
            now = self._clock()
            self._early[lease_id] = now + EARLY_RELEASE_S
            self._early.move_to_end(lease_id)
            while self._early and (
                len(self._early) > MAX_EARLY_RELEASES or next(iter(self._early.values())) <= now
            ):
                self._early.popitem(last=False)
            return False

    def expire(self) -> int:
        """Drop the leases whose time is up; how many."""
        now = self._clock()
        with self._lock:
            gone = [lid for lid, (deadline, _, _) in self._by_id.items() if deadline <= now]
            for lease_id in gone:
                self._drop(lease_id)
        return len(gone)

    def __contains__(self, key: object) -> bool:
        with self._lock:
            if not self._held.get(key):  # type: ignore[call-overload]
                return False
        self.expire()
        with self._lock:
            return bool(self._held.get(key))  # type: ignore[call-overload]

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_id)

    def _drop(self, lease_id: str) -> bool:
        entry = self._by_id.pop(lease_id, None)
        if entry is None:
            return False
        _, keys, owner = entry
        for held in (self._held, self._held_by[owner]):
            held.subtract(keys)
            for key in set(keys):
                if held[key] <= 0:
                    del held[key]
        if not self._held_by[owner]:
            del self._held_by[owner]
        return True

    def num_held(self) -> int:
        """Distinct keys leased."""
        with self._lock:
            return len(self._held)

    def check_integrity(self) -> None:
        with self._lock:
            counts: Counter[str] = Counter()
            by_owner: dict[str | None, Counter[str]] = {}
            for _, keys, owner in self._by_id.values():
                counts.update(keys)
                by_owner.setdefault(owner, Counter()).update(keys)
            assert counts == self._held, "lease counts differ from the leases held"
            assert by_owner == self._held_by, "a client's lease counts differ from its leases"

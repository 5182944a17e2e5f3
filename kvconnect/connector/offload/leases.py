"""Leases: chunks a prefill instance keeps for a decode instance that will pull them (P/D).

A request that arrives with `kv_transfer_params.do_remote_decode` leases its prompt's chunks
when it finishes (`OffloadScheduler.request_finished`): every worker then keeps them in its
cpu tier until the decode instance's ranks release the lease after pulling (the peer
server's RELEASE) or until it expires (`kv_lease_duration`, 30 s by default, as vLLM's
NixlConnector). The cpu tier evicts around leased chunks; when every slot is leased, the
store that needs a slot is dropped (counted). After the lease, the chunks age like any
others.

    leases = Leases()
    leases.grant("req-7", keys, ttl_s=30.0)
    key in leases            True while some unexpired lease holds it
    leases.release("req-7")  True once; False for an unknown or expired lease
    leases.grant(...)        False when the lease was released before it was granted

A decode instance may release a lease before the prefill instance's workers grant it: the
prefill answers as its request finishes, and its workers learn of the lease with the next
step's metadata. A release of an unknown lease is therefore remembered for a while
(`EARLY_RELEASE_S`), and the grant it precedes is not made.
    leases.expire()          how many leases ran out (dropped now)

Thread-safe: the step thread grants, the peer server's thread releases, the I/O thread asks.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence

MAX_LEASES = 1 << 16
"""Leases held at once; beyond this the one granted first ends early."""
EARLY_RELEASE_S = 60.0
MAX_EARLY_RELEASES = 4096


class Leases:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._by_id: OrderedDict[str, tuple[float, tuple[str, ...]]] = OrderedDict()
        self._held: Counter[str] = Counter()
        self._early: OrderedDict[str, float] = OrderedDict()  # released before granted

    def grant(self, lease_id: str, keys: Sequence[str], ttl_s: float) -> bool:
        """Hold `keys` for `ttl_s` seconds under `lease_id` (granted again: replaced); False,
        holding nothing, if it was released already."""
        with self._lock:
            if self._early.pop(lease_id, None) is not None:
                return False
            self._drop(lease_id)
            self._by_id[lease_id] = (self._clock() + ttl_s, tuple(keys))
            self._held.update(keys)
            while len(self._by_id) > MAX_LEASES:
                self._drop(next(iter(self._by_id)))
        return True

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
            gone = [lid for lid, (deadline, _) in self._by_id.items() if deadline <= now]
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
        self._held.subtract(entry[1])
        for key in set(entry[1]):
            if self._held[key] <= 0:
                del self._held[key]
        return True

    def check_integrity(self) -> None:
        with self._lock:
            counts: Counter[str] = Counter()
            for _, keys in self._by_id.values():
                counts.update(keys)
            assert counts == self._held, "lease counts differ from the leases held"

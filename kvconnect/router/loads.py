"""What each instance has to do, as one router replica sees it: the load the scorer weighs.

    loads.sent(name, computed)      a request is in flight at `name`, which is expected to
    loads.landed(name, computed)    compute `computed` of its prompt tokens; its answer ended
    loads.of(names)                 (in flight, pending) per instance: this router's own
                                    counts plus its replicas' (`replicas`, replicas.py)
    loads.measured_here(m)          an answer this router measured, kept for its replicas
    loads.state(after)              this replica's own counts, as `/kv/load` answers them

`version` counts the changes of this router's own counts (and answers measured), from the
microseconds of its start: a restarted replica's versions are past its last. What `watch`
was given is called after each (the HTTP front wakes the replicas waiting on it). All of it
runs on the event loop.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable, Iterable
from typing import Any

from kvconnect.router.replicas import MEASURED_KEPT, Measured, ReplicaLoads


class Loads:
    def __init__(self, names: Iterable[str]) -> None:
        self.names = list(names)
        self.in_flight: Counter[str] = Counter()
        self.pending: Counter[str] = Counter()
        """Per instance, the prompt tokens it is expected to compute for the requests in
        flight there (`Picked.computed`), until their answers end."""
        self.replicas: ReplicaLoads | None = None
        """Other router replicas' loads, added to this one's own (replicas.py)."""
        self.version = time.time_ns() // 1000
        self._on_change: Callable[[], None] = lambda: None
        self.measured: deque[Measured] = deque(maxlen=MEASURED_KEPT)
        """The last answers this router measured, for its replicas' cost models."""

    def watch(self, on_change: Callable[[], None]) -> None:
        """Call `on_change` after each change from now on (one watcher: the last given)."""
        self._on_change = on_change

    def of(self, names: list[str]) -> tuple[dict[str, int], dict[str, int]]:
        """Per instance of `names`: the requests in flight there and the prompt tokens they
        have still to compute, this router's own plus its replicas'."""
        in_flight = {n: self.in_flight[n] for n in names}
        pending = {n: self.pending[n] for n in names}
        if self.replicas is not None:
            theirs, their_pending = self.replicas.totals()
            for n in names:
                in_flight[n] += theirs.get(n, 0)
                pending[n] += their_pending.get(n, 0)
        return in_flight, pending

    def sent(self, name: str, computed: int) -> None:
        """A request is in flight at `name`, which is expected to compute `computed` of its
        prompt tokens (`landed` when its answer ends)."""
        self.in_flight[name] += 1
        self.pending[name] += computed
        self._changed()

    def landed(self, name: str, computed: int) -> None:
        self.in_flight[name] -= 1
        self.pending[name] -= computed
        self._changed()

    def measured_here(self, m: Measured) -> None:
        """An answer this router measured (under `version + 1`: the change it makes)."""
        self.measured.append(m)
        self._changed()

    def state(self, after: int | None) -> dict[str, Any]:
        """This replica's own counts, its version and the answers measured after `after`
        (all it keeps, without): `/kv/load`'s answer (replicas.py has its shape)."""
        loads = {n: {"in_flight": self.in_flight[n], "pending": self.pending[n]}
                 for n in self.names}  # fmt: skip
        measured = [m for m in self.measured if after is None or m.version > after]
        return {"instances": loads, "version": self.version, "measured": measured}

    def _changed(self) -> None:
        self.version += 1
        self._on_change()

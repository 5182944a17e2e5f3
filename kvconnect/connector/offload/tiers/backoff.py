"""Back-off for a remote tier: after the server did not answer, fail fast for a while, then let
one operation probe it.

Why: a paused or hung shared Redis costs every operation its whole socket timeout (2 s by
default), so a step's worth of loads, stores and lookups queue behind one another for many
seconds while the engine recomputes anyway. Backing off, a dead server costs one timeout per
interval, and every other operation is a miss or a dropped store at once, counted as before.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable

JITTER = 0.1
"""Each wait is the delay ± 10 %."""


class Backoff:
    """When to try the server. States (`now` from a monotonic clock; each change under one lock):

        closed ──failure──▶ open: delay = initial_s, retry_at = now + delay
        open, now < retry_at   an operation fails fast, nothing sent (`num_fast_failures`)
        open, now >= retry_at  this one operation probes; retry_at = now + delay, so the
                               others fail fast while it runs (and a probe that never
                               reports cannot wedge the tier: the next one comes a delay on)
        open ──failure──▶ open: delay = min(2 * delay, max_s), retry_at = now + delay
        any ──success──▶ closed

    Each wait is the delay times a random factor in [1 - jitter, 1 + jitter], so the workers
    and instances sharing one server do not all probe it at once. A failure while open doubles
    the delay whether or not it came from the probe (an operation already in flight when the
    server stopped answering): the delay only grows sooner, and never past `max_s`.
    """

    def __init__(
        self,
        initial_s: float,
        max_s: float,
        jitter: float = JITTER,
        clock: Callable[[], float] = time.monotonic,
        rng: Callable[[], float] = random.random,
    ) -> None:
        """`clock` and `rng` (uniform in [0, 1)) are the tests' to replace."""
        if not 0 < initial_s <= max_s:
            raise ValueError(f"back-off: need 0 < initial_s ({initial_s}) <= max_s ({max_s})")
        if not 0 <= jitter < 1:
            raise ValueError(f"back-off: jitter {jitter} must be in [0, 1)")
        self.initial_s = initial_s
        self.max_s = max_s
        self.jitter = jitter
        self._clock = clock
        self._rng = rng
        self._lock = threading.Lock()
        self.delay_s: float | None = None
        """The current wait between probes; None while closed."""
        self._retry_at = 0.0
        self.num_fast_failures = 0
        """Operations refused while open."""
        self.num_openings = 0
        """Times it went from closed to open (the server stopped answering)."""

    @property
    def is_open(self) -> bool:
        return self.delay_s is not None

    def allow(self) -> bool:
        """Whether to try an operation now: always while closed; while open, only the one
        probe per interval (a refusal is counted in `num_fast_failures`)."""
        with self._lock:
            if self.delay_s is None:
                return True
            now = self._clock()
            if now >= self._retry_at:
                self._retry_at = now + self._jittered(self.delay_s)
                return True
            self.num_fast_failures += 1
            return False

    def failed(self) -> None:
        """The server did not answer: open, or wait twice as long before the next probe."""
        with self._lock:
            if self.delay_s is None:
                self.delay_s = self.initial_s
                self.num_openings += 1
            else:
                self.delay_s = min(2 * self.delay_s, self.max_s)
            self._retry_at = self._clock() + self._jittered(self.delay_s)

    def succeeded(self) -> None:
        """The server answered: close."""
        if self.delay_s is not None:  # closed already: no lock on every successful operation
            with self._lock:
                self.delay_s = None

    def _jittered(self, delay_s: float) -> float:
        return delay_s * (1 + self.jitter * (2 * self._rng() - 1))

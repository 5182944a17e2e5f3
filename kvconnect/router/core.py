"""The router's state: its instances, the block index fed by their event streams, the choice.

    Router(instances, index, tokenizer)   nothing runs yet
    router.start()                        a thread follows every instance's stream (with
                                          replay and snapshots) into the index, under `lock`
    await router.wait_synced()            until every instance's state is in the index (once,
                                          after the start: the snapshot, then live events)
    router.pick(tokens, exclude, salt)    the instance to send a request to (scored under the
                                          same lock), or None when none is in rotation
    router.check_cached(...)              an answer's own cached-token count against the index
    router.close()                        stops the stream thread

Each instance is registered once under one name (its URL), used by the index, the scorer,
metrics and logs. The HTTP front (`server.py`) and the relay (`forward.py`) use this state; it
starts no server and never imports torch.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import NamedTuple
from urllib.parse import urlsplit

import msgspec

from kvconnect.api.protocol import ApiError, ChatCompletionRequest, CompletionRequest
from kvconnect.model.tokenizer import ChatTemplateError, Tokenizer
from kvconnect.router.costs import CostModel
from kvconnect.router.health import HealthChecker
from kvconnect.router.index import BlockIndex, PrefixScore
from kvconnect.router.replicas import MEASURED_KEPT, Measured, ReplicaLoads
from kvconnect.router.scorer import DEFAULT_LOAD_WEIGHT, choose, spread_key
from kvconnect.stream.curve import CurveClientKeys
from kvconnect.stream.subscriber import KVEventSubscriber, ReceivedBatch, StreamSnapshot

logger = logging.getLogger(__name__)


class _Details(msgspec.Struct):
    cached_tokens: int | None = 0


class Usage(msgspec.Struct):
    """An answer's usage, as far as the router reads it."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    prompt_tokens_details: _Details | None = None


class _Answer(msgspec.Struct):
    usage: Usage | None = None


_USAGE = msgspec.json.Decoder(_Answer)
"""An answer's usage alone (the rest of the body is skipped in C)."""


def usage_of(body: bytes) -> Usage | None:
    """A whole JSON answer's usage with its cached-token count; None if it has none (an
    instance without --enable-prompt-tokens-details) or is not JSON."""
    try:
        usage = _USAGE.decode(body).usage
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    return usage if usage is not None and usage.prompt_tokens_details is not None else None


HTTP_DEFAULT_PORT = 80
"""An instance URL without a port means this one (`Instance.port`)."""

MIN_PENDING_TOKENS = 256
"""A routed prompt with at least this many tokens its instance lacks is *being prefilled*
there until the index shows them (or its answer ends): a request arriving meanwhile that
shares at least this many of its tokens waits for them (`Router.wait_for_prefill`)."""
MAX_PENDING_WAIT_S = 30.0
EVENTS_GRACE_S = 5.0
"""How long a prefill whose answer ended stays pending for its events (they may come after
the answer: a request then routed would find no holder and compute the prefix again)."""
SYNC_WAIT_S = 10.0
"""From the router's start, how long a request waits for every instance in rotation to be
synced (its stream's snapshot and replay applied: `Router.wait_synced`): no decision is made
from a partial index unless an instance's state has not come by then."""
CONNECT_WAIT_S = 0.3
"""An instance whose event stream is not reached this long after the start (and after the
last handshake: they run one at a time) is not waited for: it connects later, or never (a
reachable publisher's connection is up in milliseconds)."""
SYNC_POLL_S = 0.1

StaleCheck = tuple[list[int], str | None]
"""(prompt token ids, cache salt): what to check an answer's cached tokens against."""


@dataclass(frozen=True)
class Instance:
    """One engine instance behind the router. Its URL is its name everywhere: in the index,
    the scorer, metrics and logs."""

    url: str
    events_endpoint: str
    replay_endpoint: str | None = None
    peer: tuple[str, int] | None = None
    """Where its peer tier serves (host, rank 0's port): other instances may pull from it
    (`remote_kv_source`)."""

    @property
    def name(self) -> str:
        return self.url

    @property
    def port(self) -> int:
        """The instance's HTTP port: 80 when its URL gives none, as for any http:// URL."""
        return urlsplit(self.url).port or HTTP_DEFAULT_PORT

    @classmethod
    def parse(cls, spec: str) -> Instance:
        """`URL,EVENTS_ENDPOINT[,REPLAY_ENDPOINT][,peer=HOST:PORT]`, the URL an http:// one
        (`check_url`). A URL alone (`URL[,peer=...]`) is `discovery.parse_instance`'s."""
        parts = spec.split(",")
        peer = None
        if len(parts) > 2 and parts[-1].startswith("peer="):
            peer = parse_peer(spec, parts.pop().removeprefix("peer="))
        if (
            len(parts) not in (2, 3)
            or "://" not in parts[0]
            or not all(p.startswith(("tcp://", "ipc://", "inproc://")) for p in parts[1:])
        ):
            raise ValueError(
                f"--instance {spec!r}: expected URL[,EVENTS_ENDPOINT[,REPLAY_ENDPOINT]]"
                "[,peer=HOST:PORT] (e.g. http://127.0.0.1:8001,tcp://127.0.0.1:18001,"
                "tcp://127.0.0.1:28001,peer=127.0.0.1:7100)"
            )
        check_url(parts[0])
        return cls(parts[0].rstrip("/"), parts[1], parts[2] if len(parts) == 3 else None, peer)


def parse_peer(spec: str, addr: str) -> tuple[str, int]:
    """`HOST:PORT` of an instance's peer tier; `ValueError` naming `spec` if it is not one."""
    host, sep, port = addr.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(
            f"--instance {spec!r}: peer={addr!r} is not HOST:PORT (the port its peer tier "
            "serves on, 1-65535)"
        )
    return host, int(port)


class Picked(NamedTuple):
    """Where a request goes, what the index credits it with there, and the instance to
    pull its prefix from (None: none; the instance computes what it lacks)."""

    instance: Instance
    score: PrefixScore
    source: Instance | None = None
    computed: int = 0
    """The prompt tokens the instance is expected to compute."""


@dataclass(eq=False)
class Prefill:
    """A long prompt an instance is computing (`Router.prefilling`)."""

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


def check_url(url: str) -> None:
    """`ValueError` naming `--instance` unless `url` is http:// with a host and a valid port.
    The relay speaks plain HTTP only: an https:// instance would get the client's key and
    prompt in clear (on port 80 when none is given), so it is refused, never downgraded."""
    parts = urlsplit(url)
    if parts.scheme.lower() != "http":
        raise ValueError(
            f"--instance {url!r}: TLS to instances is not supported yet (and never plaintext "
            "in its place); give an http:// URL reachable over a trusted network or a tunnel"
        )
    try:
        port = parts.port  # urlsplit checks the port only when asked for it
    except ValueError:
        port = -1
    if port is not None and not 1 <= port <= 65535:
        raise ValueError(f"--instance {url!r}: its port is not 1-65535")
    if not parts.hostname:
        raise ValueError(f"--instance {url!r}: no host")


class Router:
    def __init__(
        self,
        instances: list[Instance],
        index: BlockIndex,
        tokenizer: Tokenizer,
        load_weight: float = DEFAULT_LOAD_WEIGHT,
        curve: CurveClientKeys | None = None,
        prefill_instances: list[Instance] | None = None,
        pulls: bool = True,
    ) -> None:
        """`prefill_instances`: P/D (router/pd.py): these only prefill, for `instances`,
        which decode. Every instance's events feed the index and every one is health
        checked. `pulls`: a request may be sent with `remote_kv_source` naming an instance
        with a peer tier (`Instance.peer`) that holds more of its prefix (scorer.py)."""
        if not instances:
            raise ValueError("the router needs at least one --instance (or --decode-instance)")
        self.prefill_names = {i.name for i in prefill_instances or []}
        instances = [*instances, *(prefill_instances or [])]
        self.instances = instances
        self.index = index
        self.tokenizer = tokenizer
        self.load_weight = load_weight
        self.curve = curve
        """Keys for event streams with CURVE on (stream/curve.py); None reads plain ones."""
        self.lock = threading.Lock()
        self.in_flight: Counter[str] = Counter()
        self.pending: Counter[str] = Counter()
        """Per instance, the prompt tokens it is expected to compute for the requests in
        flight there (`Picked.computed`), until their answers end."""
        self.replicas: ReplicaLoads | None = None
        """Other router replicas' loads, added to this one's own (replicas.py)."""
        self.load_version = time.time_ns() // 1000
        """Counts the changes of this router's own in-flight counts (`sent`, `landed`), from
        the microseconds of its start: a restarted replica's versions are past its last."""
        self.on_load_change: Callable[[], None] = lambda: None
        """Called after each such change (the server wakes the replicas waiting on it)."""
        self.measured: deque[Measured] = deque(maxlen=MEASURED_KEPT)
        """The last answers this router measured, for its replicas' cost models."""
        self.decisions: Counter[str] = Counter()
        self.hit_blocks: Counter[str] = Counter()
        self.failures: Counter[str] = Counter()
        self.pulls = pulls
        self.costs = CostModel()
        self.pulls_sent: Counter[tuple[str, str]] = Counter()
        """Requests sent with `remote_kv_source`, per (source, instance)."""
        self.pd: Counter[str] = Counter()
        """P/D outcomes: disaggregated, local, prefill_failed, no_prefill_instance."""
        self._by_name = {i.name: i for i in instances}
        if len(self._by_name) != len(instances):
            raise ValueError("each --instance must have its own URL")
        self.health = HealthChecker([i.name for i in instances])
        for inst in instances:
            index.add_instance(inst.name)
        # The subscriber names a stream by the endpoint it reads; that maps to one instance.
        self._name_by_endpoint = {i.events_endpoint: i.name for i in instances}
        self.last_seq: dict[str, int] = {}
        """Per instance, the seq of the last batch (or snapshot) its index state includes."""
        self.subscriber: KVEventSubscriber | None = None
        self._thread: threading.Thread | None = None
        self._closing = False
        self.synced: set[str] = set()
        """Instances whose stream state (snapshot, replay) the index has applied whole."""
        self.started = 0.0
        self.decisions_unsynced = 0
        """Decisions made while an instance in rotation was not synced (`SYNC_WAIT_S` over)."""
        self.prefills: list[Prefill] = []
        """Long prompts being computed (`prefilling`): what a burst sharing them waits for."""
        self._applied: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []
        self.waited: Counter[str] = Counter()
        """Requests that waited for another's prefill, by how the wait ended (held: the
        instance holds the prefix; ended: that prompt's answer ended first; timeout)."""

    def start(self) -> Router:
        """Follow every instance's event stream on a thread of its own; returns self."""
        if self._thread is not None:
            raise RuntimeError("Router.start() called twice")
        self.subscriber = KVEventSubscriber(
            [i.events_endpoint for i in self.instances],
            [i.replay_endpoint for i in self.instances],
            start_seq=0,
            snapshots=True,  # a router that (re)starts, or loses batches, gets the whole state
            curve=self.curve,
        )
        self.started = time.monotonic()
        self._thread = threading.Thread(target=self._follow, name="router-events", daemon=True)
        self._thread.start()
        return self

    def _follow(self) -> None:
        sub = self.subscriber
        assert sub is not None
        everyone = len(self.instances)
        while not self._closing:
            # Until every stream is synced, a handshake that queued nothing must be seen too
            # (for SYNC_WAIT_S: a stream never reached must not keep the thread waking up);
            # then the thread sleeps until a batch comes (no wake-ups of its own).
            syncing = len(self.synced) < everyone
            polling = syncing and time.monotonic() - self.started < SYNC_WAIT_S
            item = sub.recv(SYNC_POLL_S if polling else None)
            if item is not None:
                name = self._name_by_endpoint[item.stream.endpoint]
                with self.lock:
                    self.index.apply_item(name, item)
                    if isinstance(item, ReceivedBatch | StreamSnapshot):
                        self.last_seq[name] = item.seq
            if syncing and not sub.num_queued:  # all a handshake queued is applied
                fresh = {self._name_by_endpoint[e] for e in sub.caught_up} - self.synced
                if fresh:
                    with self.lock:
                        self.synced |= fresh
                    logger.info("router: synced with %s", ", ".join(sorted(fresh)))
                    self._wake()
                    continue
            if item is not None and self._applied:
                self._wake()

    def is_synced(self) -> bool:
        """Every instance in rotation is synced, or cannot be: its stream is not reached
        CONNECT_WAIT_S after the start (one that is down, or comes later, syncs from its
        first handshake)."""
        synced = self.synced
        if len(synced) == len(self.instances):
            return True
        sub = self.subscriber
        if sub is None:
            return False
        # handshakes run one after another: an endpoint not reached yet may be next in line
        quiet = time.monotonic() - max(self.started, sub.last_handshake)
        late = not sub.handshaking and quiet > CONNECT_WAIT_S
        return all(
            i.name in synced
            or not self.health.is_up(i.name)
            or (late and i.events_endpoint not in sub.connected)
            for i in self.instances
        )

    async def wait_synced(self) -> bool:
        """Until `is_synced` (True), or until SYNC_WAIT_S after the start (False): a router
        that starts (or restarts) while traffic flows makes its first decision from the
        whole index."""
        loop = asyncio.get_running_loop()
        while not self.is_synced():
            left = self.started + SYNC_WAIT_S - time.monotonic()
            if left <= 0:
                return False
            future: asyncio.Future[None] = loop.create_future()
            with self.lock:
                self._applied.append((loop, future))
            if self.is_synced():
                break
            # an instance leaving rotation ends the wait too: look again now and then
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(future, min(left, SYNC_POLL_S * 5))
        return True

    def _wake(self) -> None:
        """Every `wait_for_prefill` looks again (the index or the prefills changed)."""
        with self.lock:
            waiters, self._applied = self._applied, []
        for loop, future in waiters:
            loop.call_soon_threadsafe(_resolve, future)

    def prefilling(
        self, name: str, token_ids: list[int], salt: str | None, score: PrefixScore
    ) -> Prefill | None:
        """A prompt sent to `name`, which lacks `score` of it: a Prefill (to end with
        `prefilled`) when that leaves at least MIN_PENDING_TOKENS to compute."""
        if len(token_ids) - score.num_tokens < MIN_PENDING_TOKENS:
            return None
        p = Prefill(name, token_ids, salt)
        with self.lock:
            self.prefills.append(p)
        return p

    def prefilled(self, p: Prefill) -> None:
        """`p`'s answer ended: pending for EVENTS_GRACE_S more, for its events."""
        p.ended = time.monotonic()
        self._wake()

    def _pending(self, token_ids: list[int], salt: str | None) -> tuple[Prefill, int] | None:
        """The prefill sharing the most (at least MIN_PENDING_TOKENS) of `token_ids`, and how
        many, where no instance holds that many of them yet."""
        if not self.prefills:  # the usual request: none under way
            return None
        now = time.monotonic()
        with self.lock:
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
        scores = self.scores(token_ids, salt)
        bs = scores[best[0].instance].block_size or self.index.block_size
        if max((s.num_tokens for s in scores.values()), default=0) >= best[1] // bs * bs:
            return None  # held already: routing sees it
        return best

    async def wait_for_prefill(self, token_ids: list[int], salt: str | None = None) -> None:
        """When another request is computing a long prefix of `token_ids` that no instance
        holds yet, wait until its instance holds it (its events), its answer ends or
        MAX_PENDING_WAIT_S pass: then routing finds the prefix (and may pull it) instead of
        computing it once more (a burst sharing a new prefix is computed once)."""
        if not self.pulls or len(self.instances) < 2:  # then routing is exactly as before
            return
        deadline = time.monotonic() + MAX_PENDING_WAIT_S
        first = self._pending(token_ids, salt)
        if first is None:
            return
        loop = asyncio.get_running_loop()
        while True:
            future: asyncio.Future[None] = loop.create_future()
            with self.lock:
                self._applied.append((loop, future))
            pending = self._pending(token_ids, salt)
            if pending is None:
                with self.lock:
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

    def close(self) -> None:
        self._closing = True
        if self.subscriber is not None:
            self.subscriber.close()
        if self._thread is not None:
            self._thread.join(timeout=2)

    def scores(self, token_ids: list[int], cache_salt: str | None = None) -> dict[str, PrefixScore]:
        """Per instance name, what it holds of the request's prefix."""
        with self.lock:
            return self.index.score(token_ids, cache_salt)

    def pick(
        self,
        token_ids: list[int],
        exclude: set[str],
        cache_salt: str | None = None,
        costs_out: dict[str, float] | None = None,
    ) -> Picked | None:
        """The instance in rotation (and not in `exclude`) to send the request to (to decode
        it, in P/D), and the one to pull its prefix from, if pulling wins."""
        names = [
            i.name
            for i in self.instances
            if i.name not in exclude
            and i.name not in self.prefill_names
            and self.health.is_up(i.name)
        ]
        sources = [
            i.name
            for i in self.instances
            if self.pulls and i.peer is not None and self.health.is_up(i.name)
        ]
        return self._choose(names, token_ids, cache_salt, sources, costs_out)

    def pick_prefill(self, token_ids: list[int], cache_salt: str | None = None) -> Picked | None:
        """P/D: the prefill instance in rotation for the request, by prefix and load."""
        names = [n for n in self.prefill_names if self.health.is_up(n)]
        return self._choose(sorted(names), token_ids, cache_salt)

    def _choose(
        self,
        names: list[str],
        token_ids: list[int],
        cache_salt: str | None,
        sources: list[str] | None = None,
        costs_out: dict[str, float] | None = None,
    ) -> Picked | None:
        if not names:
            return None
        with self.lock:  # one state for both
            scores = self.index.score(token_ids, cache_salt)
            num_blocks = self.index.num_blocks()
        in_flight, pending = self.loads(names)
        decision = choose(
            names,
            scores,
            in_flight,
            len(token_ids),
            self.load_weight,
            spread_key(token_ids),
            num_blocks,
            sources or (),
            self.costs.pull_tokens if sources else None,
            partial(self.costs.load_tokens, default_weight=self.load_weight) if sources else None,
            costs_out,
            pending,
            self.costs.time_scale(names) if sources else None,
        )
        source = self._by_name[decision.source] if decision.source else None
        return Picked(self._by_name[decision.instance], decision.score, source, decision.computed)

    def loads(self, names: list[str]) -> tuple[dict[str, int], dict[str, int]]:
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
        self._load_changed()

    def landed(self, name: str, computed: int) -> None:
        self.in_flight[name] -= 1
        self.pending[name] -= computed
        self._load_changed()

    def _load_changed(self) -> None:
        self.load_version += 1
        self.on_load_change()

    def mark_down(self, name: str, reason: str) -> None:
        self.health.mark(name, False, reason)
        self.failures[name] += 1

    def record(self, name: str, score: PrefixScore, source: str | None = None) -> None:
        """A request went to `name` with `score` of its prefix cached there (and `source`
        named to pull more of it from)."""
        self.decisions[name] += 1
        if source is not None:
            self.pulls_sent[source, name] += 1
        for tier, n in score.blocks_per_tier.items():
            self.hit_blocks[tier] += n

    def learn(
        self,
        name: str,
        score: PrefixScore,
        source: str | None,
        elapsed_s: float,
        usage: Usage,
        queued: int = 0,
        ahead: int = 0,
    ) -> None:
        """A whole answer from `name` with `usage` (`usage_of`; sent with `source` to pull
        from, while `queued` other requests were in flight there, with `ahead` prompt tokens
        to compute: `pending`), `elapsed_s` after the request left: one measurement of its
        costs (costs.py), the tokens ahead of it counted with its own."""
        assert usage.prompt_tokens_details is not None
        cached = usage.prompt_tokens_details.cached_tokens or 0
        computed = max(0, usage.prompt_tokens - cached)
        pulled = max(0, cached - score.num_tokens) if source else 0
        m = Measured(
            self.load_version + 1,
            name,
            elapsed_s,
            computed + ahead,
            usage.completion_tokens,
            source,
            pulled,
            queued,
        )
        self.take_measured(m)
        self.measured.append(m)  # for the replicas: under the version _load_changed makes
        self._load_changed()

    def take_measured(self, m: Measured) -> None:
        """An answer measured here or at a replica (replicas.py): into the cost model."""
        self.costs.observe(
            m.instance, m.elapsed_s, m.computed, m.completion, m.source, m.pulled, m.queued
        )

    def prompt_tokens(self, req: CompletionRequest | ChatCompletionRequest) -> list[int]:
        """The tokens the engines will see first: a chat rendered with the chat template, or
        the first prompt (a multi-prompt request goes where its first prompt is cached)."""
        if isinstance(req, ChatCompletionRequest):
            try:
                text = self.tokenizer.apply_chat_template(
                    req.conversation(), req.add_generation_prompt, req.tool_dicts()
                )
            except ChatTemplateError as e:
                raise ApiError(str(e), "messages") from None
            return self.tokenizer.encode(text)
        first = req.prompts()[0]
        return first if isinstance(first, list) else self.tokenizer.encode(first)

    def check_cached(self, name: str, score: PrefixScore, check: StaleCheck, usage: Usage) -> None:
        """The instance's own count of cached prompt tokens (`usage_of` its answer) against
        what the index credited it: fewer means the index holds entries the instance no
        longer has (`BlockIndex.mark_stale`)."""
        assert usage.prompt_tokens_details is not None
        cached = usage.prompt_tokens_details.cached_tokens or 0
        if cached < score.num_tokens:
            with self.lock:
                dropped = self.index.mark_stale(name, check[0], cached, check[1])
            if dropped:
                logger.info(
                    "router: %s computed %d cached prompt tokens where the index said %d; "
                    "dropped %d stale entries",
                    name,
                    cached,
                    score.num_tokens,
                    dropped,
                )


def stale_check(
    req: CompletionRequest | ChatCompletionRequest, token_ids: list[int]
) -> StaleCheck | None:
    """A request whose usage speaks of one prompt (chat, or a single completion prompt) and
    whose engine reads its cache: one that asks for the prompt's logprobs computes all of it,
    so its count says nothing of what the instance holds (a request's options never change
    the index). `req`'s prompt was validated already (`Router.prompt_tokens`): its shape is
    enough."""
    if req.wants_prompt_logprobs():
        return None
    if isinstance(req, CompletionRequest):
        p = req.prompt
        if not (isinstance(p, str) or len(p) == 1 or not isinstance(p[0], str | list)):
            return None
    return token_ids, req.cache_salt


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)

"""Router replicas at scale, simulated (issue 47, item 5): 64 instances, 1, 2, 4 and 8 replicas.

SGLang's gateway measured 8 gateways with an index each at a cache hit of 0.66 (one: 0.95):
each of its indexes knows only what its gateway routed. kvconnect's replicas each follow every
instance's event stream, so each holds the whole index; what differs between them is what
each knows of the others' requests in flight (each counts its own; `--replica` adds the
others', read by long poll: replicas.py) and when each applies a batch (its stream's lag).
This bench measures what that costs.

The engines are simulated, nothing else: NUM_INSTANCES instances, each a real engine
`BlockPool` + `KVCacheManager` (engine/: prefix caching, LRU eviction of free blocks, and the
BlockStored / BlockRemoved events vLLM publishes) of CACHE_BLOCKS blocks of BLOCK tokens.
An instance admits its requests in arrival order when their blocks (prompt and answer) fit,
prefills one at a time (PREFILL_S_PER_TOKEN for each prompt token it does not find cached,
plus PREFILL_FIXED_S), then decodes (DECODE_S_PER_TOKEN a token, alongside the next prefills);
at the prefill's start it publishes its evictions, at its end the prompt's new blocks, at the
answer's end the answer's blocks (each batch encoded with the wire codec; what a subscriber
decodes is applied). Time is simulated; the routers are kvconnect's real ones: per replica a
`Router` (core.py: `pick`, `sent`, `landed`, `loads`) over its own `BlockIndex`, scoring with
scorer.py's `choose`, and with loads shared its `ReplicaLoads` fed with the /kv/load answers
of the others (replicas.py) as they stood REPLICA_MIN_INTERVAL_S + one event lag earlier.

The trace: CHATS multi-turn chats over TENANTS system prompts (256-1,536 tokens, Zipf
popular), 2-8 turns each; a turn is the chat so far, the last answer and a new user message
(16-256 tokens), answered in 32-384 tokens; the next turn comes THINK_S (exponential mean)
after the answer. Chats start in bursts (1-6 chats of one tenant within 20 ms), the bursts a
Poisson process. Requests are spread over the replicas at random (a load balancer without
affinity), so a chat's turns meet different replicas.

Event lag is measured, not assumed: the cluster's recorded batches are published by 64 real
`ZmqEventPublisher`s (loopback TCP, replay on) to one real `Router` (its subscriber thread
and index, `Router.start()`), at the simulated cluster's batch rate: each batch's time from
publish to applied in the index is a lag sample; each replica's batches are then delayed by
samples of that distribution (in order per stream). The same publishers then send the whole
recording while the router's lock is held (it queues in ZMQ), and the router's ingest is
timed from the lock's release until every event is applied: events per second, beside a bare
decode loop of the same payloads (the limit: the subscriber must decode each batch), and
the rate at which the simulated cluster produces events.

Per replica count, over every request:
    hit        prompt tokens the chosen instance found cached when it admitted the request /
               prompt tokens
    precision  the share of decisions equal to the choice of one all-knowing router: the
               same `Router` code over an index fed the instant each batch is published and
               the loads of every request in flight
    TTFT p90   simulated (queueing behind prefills and for blocks included)
with loads shared (replicas named to each other: `--replica`) and, for comparison, without
(each replica counting its own requests only); beside one all-knowing router routing
(`oracle`: its hit is the reference no replica set can beat by knowing more). The lag panel:
8 replicas (shared loads) with the measured lag scaled by 10, 100 and 1,000.
Index bytes per block: one index rebuilt from the recorded stream under tracemalloc (each
payload decoded inside, as the subscriber does; the decoded batches dropped): bytes traced
per entry (a distinct block hash) and per block held (instance x block).

Prints one line; plots hit and precision per replica count, and against lag, to
bench/replicas.png. About 2 minutes on 2 cores; `--quick` (a quarter of the chats, no lag
panel) about 30 s.
"""

from __future__ import annotations

import gc
import heapq
import itertools
import logging
import math
import multiprocessing
import random
import statistics
import sys
import threading
import time
import tracemalloc
from collections import deque
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from kvconnect.engine.block_pool import BlockPool
from kvconnect.engine.kv_cache_manager import KVCacheManager
from kvconnect.engine.request import Request, SamplingParams
from kvconnect.events import KVEventBatch, decode_batch, encode_batch
from kvconnect.model.tokenizer import load_tokenizer
from kvconnect.router.core import Instance, Router
from kvconnect.router.index import BlockIndex
from kvconnect.router.replicas import REPLICA_MIN_INTERVAL_S, ReplicaLoads
from kvconnect.stream.publisher import ZmqEventPublisher
from kvconnect.stream.subscriber import ReceivedBatch, SubscriberItem

QUICK = "--quick" in sys.argv
BLOCK = 16
NUM_INSTANCES = 64
CACHE_BLOCKS = 2048
"""Blocks per instance (32k tokens): the requests in flight take about half, so the chats'
histories are evicted and BlockRemoved flows."""
REPLICAS = (1, 2, 4, 8)
CHATS = 250 if QUICK else 1000
TENANTS = 24
TURNS = (2, 8)
SYSTEM_TOKENS = (256, 1536)
USER_TOKENS = (16, 256)
ANSWER_TOKENS = (32, 384)
THINK_S = 3.0
BURST = (1, 6)
BURST_SPREAD_S = 0.02
BURSTS_PER_S = 4.5
PREFILL_S_PER_TOKEN = 150e-6
PREFILL_FIXED_S = 0.005
DECODE_S_PER_TOKEN = 0.02
VOCAB = 32_000
LAG_SCALES = () if QUICK else (10, 100, 1000)
LAG_BATCHES_PER_S = 1280.0
"""The rate at which the lag is measured: 64 instances publishing 20 batches a second (a
busy engine's steps with events), faster than the simulated cluster (whose engines are
slow: the sim's time is cheap, the index's work is what it measures)."""
LAG_SECONDS = 1.0
WORKERS = 2
PLOT = Path(__file__).resolve().with_name("replicas.png")


# -- the trace ----------------------------------------------------------------------------------


@dataclass
class Chat:
    tenant: int
    start: float
    users: list[list[int]]
    answers: list[list[int]]
    thinks: list[float]


def make_trace(seed: int = 47) -> tuple[list[list[int]], list[Chat]]:
    rng = random.Random(seed)
    systems = [
        [rng.randrange(VOCAB) for _ in range(rng.randint(*SYSTEM_TOKENS))] for _ in range(TENANTS)
    ]
    weights = [1 / (k + 1) for k in range(TENANTS)]  # Zipf: a few tenants are most chats
    chats: list[Chat] = []
    now = 0.0
    while len(chats) < CHATS:
        now += rng.expovariate(BURSTS_PER_S)
        tenant = rng.choices(range(TENANTS), weights)[0]
        for _ in range(rng.randint(*BURST)):
            turns = rng.randint(*TURNS)
            chats.append(
                Chat(
                    tenant,
                    now + rng.uniform(0, BURST_SPREAD_S),
                    [
                        [rng.randrange(VOCAB) for _ in range(rng.randint(*USER_TOKENS))]
                        for _ in range(turns)
                    ],
                    [
                        [rng.randrange(VOCAB) for _ in range(rng.randint(*ANSWER_TOKENS))]
                        for _ in range(turns)
                    ],
                    [rng.expovariate(1 / THINK_S) for _ in range(turns)],
                )
            )
    return systems, chats[:CHATS]


# -- the simulated engines ----------------------------------------------------------------------


@dataclass(eq=False)
class Job:
    """One turn of a chat on its way: routed by `replica` to `instance`."""

    chat: int
    turn: int
    tokens: list[int]
    answer: list[int]
    arrival: float
    replica: int = 0
    instance: int = 0
    request: Request | None = None
    cached: int = 0
    ttft: float = 0.0


class SimInstance:
    """An engine: a real block pool, admission in arrival order, one prefill at a time."""

    def __init__(self, i: int) -> None:
        self.name = f"http://instance{i}:8000"
        self.pool = BlockPool(CACHE_BLOCKS, BLOCK, enable_caching=True, enable_kv_cache_events=True)
        self.kv = KVCacheManager(self.pool)
        self.waiting: deque[Job] = deque()
        self.prefilling = False

    def admit(self) -> Job | None:
        """The next waiting job if its blocks fit and no prefill runs: its cache hit taken,
        its blocks allocated (prompt and answer)."""
        if self.prefilling or not self.waiting:
            return None
        job = self.waiting[0]
        assert job.request is not None
        hits, cached = self.kv.get_computed_blocks(job.request)
        total = len(job.tokens) + len(job.answer)
        if self.kv.allocate_slots(job.request, total, hits) is None:
            return None  # waits for blocks (an answer ending frees them)
        self.waiting.popleft()
        job.cached = cached
        self.prefilling = True
        return job


# -- the routers --------------------------------------------------------------------------------


def make_router(instances: list[SimInstance], tokenizer: object) -> Router:
    """A replica as `kvconnect router` builds it (its event stream is fed by the simulation)."""
    named = [Instance(s.name, "tcp://127.0.0.1:1") for s in instances]
    return Router(named, BlockIndex(BLOCK), tokenizer)  # type: ignore[arg-type]


_LOADS = msgspec.json.Encoder()


class LoadViews:
    """What each replica has read of the others' /kv/load: their own counts as they stood
    `lag` seconds ago, through `ReplicaLoads.update` as the long poll delivers them."""

    def __init__(self, routers: list[Router], names: list[str], lag: float) -> None:
        self.routers, self.names, self.lag = routers, names, lag
        self.urls = [f"http://replica{r}:9000" for r in range(len(routers))]
        self.log: list[list[tuple[float, int, int]]] = [[] for _ in routers]
        """Per replica, its changes: (time, instance slot, +1 / -1)."""
        self.read = [[0] * len(routers) for _ in routers]
        self.views = [[[0] * len(names) for _ in routers] for _ in routers]
        for j, router in enumerate(routers):
            others = [u for k, u in enumerate(self.urls) if k != j]
            router.replicas = ReplicaLoads(others, names, router.take_measured)

    def changed(self, replica: int, now: float, slot: int, delta: int) -> None:
        self.log[replica].append((now, slot, delta))

    def catch_up(self, j: int, now: float) -> None:
        """Replica j reads what every other replica said up to `now - lag` (an answer every
        time: the long poll answers at least every LOAD_HOLD_S, so none goes stale)."""
        replicas = self.routers[j].replicas
        assert replicas is not None
        for k in range(len(self.routers)):
            if k == j:
                continue
            log, at, view = self.log[k], self.read[j][k], self.views[j][k]
            while at < len(log) and log[at][0] <= now - self.lag:
                view[log[at][1]] += log[at][2]
                at += 1
            self.read[j][k] = at
            loads = {
                n: {"in_flight": c, "pending": 0} for n, c in zip(self.names, view, strict=True)
            }
            body = {"instances": loads, "version": at, "measured": []}
            replicas.update(self.urls[k], _LOADS.encode(body))


@dataclass
class Run:
    name: str
    hit: float
    precision: float
    ttfts: list[float]
    num_requests: int
    recorded: list[tuple[float, int, bytes]] = field(default_factory=list)
    """(time, instance, payload) of every batch the instances published."""
    events: int = 0
    duration: float = 0.0
    busy: float = 0.0
    """Request-seconds in flight (arrival to answer), summed."""
    evicted: int = 0


def simulate(
    systems: list[list[int]],
    chats: list[Chat],
    num_replicas: int,
    shared: bool,
    lags: list[float],
    oracle_routes: bool = False,
    lag_scale: float = 1.0,
    record: bool = False,
    seed: int = 5,
) -> Run:
    """One run: every chat's turns through `num_replicas` routers (or the all-knowing one)."""
    rng = random.Random(seed)
    instances = [SimInstance(i) for i in range(NUM_INSTANCES)]
    names = [s.name for s in instances]
    slot_of = {n: i for i, n in enumerate(names)}
    tokenizer = load_tokenizer("tiny")
    oracle = make_router(instances, tokenizer)
    routers = (
        [] if oracle_routes else [make_router(instances, tokenizer) for _ in range(num_replicas)]
    )
    median_lag = statistics.median(lags) * lag_scale if lags else 0.0
    views = LoadViews(routers, names, REPLICA_MIN_INTERVAL_S + median_lag) if shared else None
    # Per replica: batches on their way, (arrival, order, instance, batch), and per stream the
    # last arrival (a stream's batches arrive in order).
    inbox: list[list[tuple[float, int, int, KVEventBatch]]] = [[] for _ in routers]
    last_arrival = [[0.0] * NUM_INSTANCES for _ in routers]
    order = itertools.count()
    clock: list[tuple[float, int, str, object]] = []
    run = Run("oracle" if oracle_routes else f"{num_replicas}", 0.0, 0.0, [], 0)
    hit_tokens = prompt_tokens = same = 0

    def at(t: float, kind: str, what: object) -> None:
        heapq.heappush(clock, (t, next(order), kind, what))

    def publish(now: float, i: int) -> None:
        events = instances[i].pool.take_events()
        if not events:
            return
        payload = encode_batch(KVEventBatch(now, events, 0))  # type: ignore[arg-type]
        batch = decode_batch(payload)  # what every subscriber decodes
        run.events += len(events)
        if record:
            run.recorded.append((now, i, payload))
        oracle.index.apply_batch(names[i], batch)  # current: the instant it is published
        for r in range(len(routers)):
            arrive = max(last_arrival[r][i], now + rng.choice(lags) * lag_scale if lags else now)
            last_arrival[r][i] = arrive
            heapq.heappush(inbox[r], (arrive, next(order), i, batch))

    def receive(r: int, now: float) -> None:
        box, index = inbox[r], routers[r].index
        while box and box[0][0] <= now:
            _, _, i, batch = heapq.heappop(box)
            index.apply_batch(names[i], batch)

    def start(now: float, inst: SimInstance) -> None:
        job = inst.admit()
        if job is None:
            return
        publish(now, job.instance)  # the evictions its allocation made
        computed = len(job.tokens) - job.cached
        at(now + PREFILL_FIXED_S + computed * PREFILL_S_PER_TOKEN, "prefilled", job)

    for c, chat in enumerate(chats):
        at(chat.start, "arrive", (c, 0))
    while clock:
        now, _, kind, what = heapq.heappop(clock)
        if kind == "arrive":
            c, turn = what  # type: ignore[misc]
            chat = chats[c]
            tokens = list(systems[chat.tenant])
            for k in range(turn):
                tokens += chat.users[k] + chat.answers[k]
            tokens += chat.users[turn]
            job = Job(c, turn, tokens, chat.answers[turn], now)
            oracle_pick = oracle.pick(tokens, set())
            assert oracle_pick is not None
            if oracle_routes:
                chosen = oracle_pick.instance.name
            else:
                job.replica = rng.randrange(num_replicas)
                router = routers[job.replica]
                receive(job.replica, now)
                if views is not None:
                    views.catch_up(job.replica, now)
                picked = router.pick(tokens, set())
                assert picked is not None
                chosen = picked.instance.name
                router.sent(chosen, 0)
                if views is not None:
                    views.changed(job.replica, now, slot_of[chosen], 1)
            same += chosen == oracle_pick.instance.name
            oracle.sent(chosen, 0)
            job.instance = slot_of[chosen]
            job.request = Request(f"{c}-{turn}", tokens, SamplingParams(max_tokens=1), BLOCK)
            inst = instances[job.instance]
            inst.waiting.append(job)
            start(now, inst)
        elif kind == "prefilled":
            job = what  # type: ignore[assignment]
            inst = instances[job.instance]
            assert job.request is not None
            inst.kv.cache_blocks(job.request, len(job.tokens))
            publish(now, job.instance)
            job.ttft = now - job.arrival
            inst.prefilling = False
            at(now + len(job.answer) * DECODE_S_PER_TOKEN, "answered", job)
            start(now, inst)
        else:  # answered
            job = what  # type: ignore[assignment]
            inst = instances[job.instance]
            req = job.request
            assert req is not None
            for t in job.answer:
                req.append_output_token(t)
            inst.kv.cache_blocks(req, req.num_tokens)
            inst.kv.free(req.request_id)
            publish(now, job.instance)
            name = names[job.instance]
            oracle.landed(name, 0)
            if not oracle_routes:
                routers[job.replica].landed(name, 0)
                if views is not None:
                    views.changed(job.replica, now, job.instance, -1)
            run.ttfts.append(job.ttft)
            run.busy += now - job.arrival
            hit_tokens += job.cached
            prompt_tokens += len(job.tokens)
            run.num_requests += 1
            chat = chats[job.chat]
            if job.turn + 1 < len(chat.users):
                at(now + chat.thinks[job.turn], "arrive", (job.chat, job.turn + 1))
            start(now, inst)
        run.duration = now
    for inst in instances:
        inst.pool.check_integrity()
        assert inst.kv.num_requests == 0 and not inst.waiting
    run.evicted = sum(oracle.index.stats.removed.values())
    run.hit = hit_tokens / prompt_tokens
    run.precision = same / run.num_requests
    return run


# -- the real streams: lag and ingest -----------------------------------------------------------


class TimedIndex(BlockIndex):
    """The router's index, noting when each live batch is applied (its lag) and when a number
    of events has been."""

    def __init__(self) -> None:
        super().__init__(BLOCK)
        self.lags: list[float] = []
        self.target = -1
        self.reached = threading.Event()

    def apply_item(self, instance: str, item: SubscriberItem) -> None:
        super().apply_item(instance, item)
        if isinstance(item, ReceivedBatch) and item.batch.ts > 0:
            self.lags.append(time.time() - item.batch.ts)
        if self.stats.events_applied >= self.target >= 0:
            self.reached.set()


@dataclass
class Streams:
    lags: list[float]
    ingest: float
    """Events per second one replica applied from its real streams."""
    decode: float
    """Events per second of a bare decode loop over the same payloads."""
    apply: float
    """Events per second of `BlockIndex.apply_batch` alone over the decoded batches."""
    blocks_per_event: float


def real_streams(recorded: list[tuple[float, int, bytes]]) -> Streams:
    """Lag samples and ingest rate of one replica following NUM_INSTANCES real publishers."""
    pubs = [
        ZmqEventPublisher.open(
            bind=True, endpoint="tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0"
        )
        for _ in range(NUM_INSTANCES)
    ]
    batches = [(i, decode_batch(p)) for _, i, p in recorded]
    num_events = sum(len(b.events) for _, b in batches)
    index = TimedIndex()
    instances = [
        Instance(f"http://instance{i}:8000", p.endpoint, p.replay_endpoint)
        for i, p in enumerate(pubs)
    ]
    router = Router(instances, index, load_tokenizer("tiny")).start()
    try:
        deadline = time.monotonic() + 30
        while len(router.synced) < NUM_INSTANCES:  # every stream's handshake applied
            if time.monotonic() > deadline:
                raise RuntimeError(f"the router synced {len(router.synced)} of 64 streams")
            time.sleep(0.01)
        for p in pubs:  # and its subscription reached every publisher
            if not p.wait_for_subscriber(10):
                raise RuntimeError("a publisher saw no subscription in 10 s")
        # Lag: LAG_SECONDS of the recording at LAG_BATCHES_PER_S, each batch stamped as sent.
        paced = batches[: int(LAG_BATCHES_PER_S * LAG_SECONDS)]
        index.target = sum(len(b.events) for _, b in paced)
        gap, t0 = 1.0 / LAG_BATCHES_PER_S, time.monotonic()
        for k, (i, b) in enumerate(paced):
            wait = t0 + k * gap - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            pubs[i].publish(msgspec.structs.replace(b, ts=time.time()))
        if not index.reached.wait(30):
            raise RuntimeError("the router did not apply the paced batches in 30 s")
        lags = list(index.lags)
        # Ingest: the whole recording queued (in ZMQ) while the router's lock is held.
        index.reached.clear()
        index.target += num_events
        with router.lock:
            for i, b in batches:
                pubs[i].publish(msgspec.structs.replace(b, ts=0.0))
            for p in pubs:
                p.flush(10)
            t0 = time.perf_counter()
        if not index.reached.wait(120):
            raise RuntimeError("the router did not apply every event in 120 s")
        ingest = num_events / (time.perf_counter() - t0)
    finally:
        router.close()
        for p in pubs:
            p.shutdown(1)
    payloads = [p for _, _, p in recorded]
    decode = num_events / min(_timed(lambda: [decode_batch(p) for p in payloads]) for _ in range(3))
    apply = num_events / min(_timed(lambda: _apply_all(batches)) for _ in range(3))
    blocks = sum(len(e.block_hashes) for _, b in batches for e in b.events)  # type: ignore[union-attr]
    return Streams(lags, ingest, decode, apply, blocks / num_events)


def _apply_all(batches: list[tuple[int, KVEventBatch]]) -> None:
    index = BlockIndex(BLOCK)
    for i, b in batches:
        index.apply_batch(f"http://instance{i}:8000", b)


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _allocated(snapshot: tracemalloc.Snapshot) -> int:
    """The bytes the traced blocks take: pymalloc serves blocks up to 512 bytes in multiples
    of 16 (tracemalloc counts the size asked for); larger ones come from malloc, with its
    16-byte header."""
    return sum((t.size + 15) // 16 * 16 if t.size <= 512 else t.size + 16 for t in snapshot.traces)


@dataclass
class IndexBytes:
    per_entry: float
    per_held: float
    entries: int
    held: int


def index_bytes(recorded: list[tuple[float, int, bytes]]) -> IndexBytes:
    """The memory of one index built from the stream, as allocated (`_allocated`), per entry
    (a block hash) and per block held (an instance's block)."""
    names = [f"http://instance{i}:8000" for i in range(NUM_INSTANCES)]
    index = BlockIndex(BLOCK)
    for n in names:
        index.add_instance(n)
    gc.collect()
    tracemalloc.start()
    for _, i, payload in recorded:
        index.apply_batch(names[i], decode_batch(payload))
    gc.collect()
    size = _allocated(tracemalloc.take_snapshot())
    tracemalloc.stop()
    index.check_integrity()
    held = sum(index.num_blocks().values())
    return IndexBytes(size / index.num_entries, size / held, index.num_entries, held)


# -- the report ---------------------------------------------------------------------------------


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    pos = q * (len(s) - 1)
    lo = math.floor(pos)
    return s[lo] + (s[min(lo + 1, len(s) - 1)] - s[lo]) * (pos - lo)


def plot(
    runs: dict[tuple[str, int], Run], oracle: Run, scaled: dict[float, Run], median_lag: float
) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "plot skipped: matplotlib is not installed (pip install matplotlib)"
    panels = 2 if scaled else 1
    fig, axes = plt.subplots(1, panels, figsize=(5.6 * panels, 4.2), squeeze=False)
    a = axes[0][0]
    styles = {"shared": ("tab:blue", "loads shared (--replica)"),
              "own": ("tab:orange", "each its own loads")}  # fmt: skip
    for mode, (color, label) in styles.items():
        xs = [n for n in REPLICAS if (mode, n) in runs]
        a.plot(xs, [runs[mode, n].hit for n in xs], "o-", color=color, label=f"hit, {label}")
        a.plot(xs, [runs[mode, n].precision for n in xs], "s--", color=color,
               label=f"precision, {label}")  # fmt: skip
    a.axhline(oracle.hit, color="tab:green", lw=1, label="hit, one all-knowing router")
    a.axhline(0.95 * runs["shared", 1].hit, color="gray", lw=0.8, ls=":",
              label="target: 0.95 x one router's hit")  # fmt: skip
    a.set_xscale("log", base=2)
    a.set_xticks(list(REPLICAS), [str(n) for n in REPLICAS])
    a.set_xlabel("router replicas")
    a.set_ylim(0, 1.02)
    a.set_title(f"{NUM_INSTANCES} instances, {CHATS} chats: hit and precision", fontsize=10)
    a.grid(True, alpha=0.3)
    a.legend(fontsize=7, loc="lower left")
    if scaled:
        b = axes[0][1]
        xs = [1.0, *scaled]
        chosen = [runs["shared", 8], *scaled.values()]
        lag_ms = [x * median_lag * 1e3 for x in xs]
        b.plot(lag_ms, [r.hit for r in chosen], "o-", color="tab:blue", label="hit")
        b.plot(lag_ms, [r.precision for r in chosen], "s--", color="tab:blue", label="precision")
        b.axhline(runs["shared", 1].hit, color="gray", lw=0.8, label="hit, one router")
        b.set_xscale("log")
        b.set_xlabel("event lag p50, ms (measured, then x10, x100, x1000)")
        b.set_ylim(0, 1.02)
        b.set_title("8 replicas, loads shared: against event lag", fontsize=10)
        b.grid(True, alpha=0.3)
        b.legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    fig.savefig(PLOT, dpi=110)
    plt.close(fig)
    return f"plot bench/{PLOT.name}"


def main() -> None:
    logging.disable(logging.WARNING)
    t0 = time.monotonic()
    systems, chats = make_trace()
    oracle = simulate(systems, chats, 1, False, [], oracle_routes=True, record=True)
    streams = real_streams(oracle.recorded)  # alone on the machine: it is timed
    lags = streams.lags
    memory = index_bytes(oracle.recorded)
    # The runs are in simulated time: two at once (one per core) changes nothing in them.
    wanted = [(n, mode == "shared", 1.0) for n in REPLICAS for mode in ("shared", "own")]
    wanted = [w for w in wanted if w[0] > 1 or w[1]]  # one replica: nobody to share with
    wanted += [(8, True, float(s)) for s in LAG_SCALES]
    spawn = multiprocessing.get_context("spawn")  # no fork of this process's ZMQ state
    with ProcessPoolExecutor(WORKERS, mp_context=spawn) as pool:
        futures = {
            w: pool.submit(simulate, systems, chats, w[0], w[1], lags, lag_scale=w[2])
            for w in sorted(wanted, key=lambda w: -w[0])  # the longest first
        }
        done = {w: f.result() for w, f in futures.items()}
    runs = {("shared" if sh else "own", n): r for (n, sh, s), r in done.items() if s == 1.0}
    runs["own", 1] = runs["shared", 1]
    scaled = {s: r for (_, _, s), r in done.items() if s != 1.0}
    one = runs["shared", 1]

    def row(what: Callable[[Run], str], mode: str) -> str:
        return "/".join(what(runs[mode, n]) for n in REPLICAS)

    def hit(r: Run) -> str:
        return f"{r.hit:.3f}"

    def precision(r: Run) -> str:
        return f"{r.precision:.2f}"

    def p90(r: Run) -> str:
        return f"{pct(r.ttfts, 0.9) * 1e3:.0f}"

    median_lag = statistics.median(lags)
    lag_part = ", ".join(
        f"x{s:g} ({median_lag * s * 1e3:.1f} ms) hit {r.hit:.3f} precision {r.precision:.2f}"
        for s, r in sorted(scaled.items())
    )
    cluster = oracle.events / oracle.duration
    print(
        f"replicas ({NUM_INSTANCES} simulated instances x {CACHE_BLOCKS} blocks of {BLOCK}, "
        f"{CHATS} chats, {one.num_requests} turns in {oracle.duration:.0f} s simulated, "
        f"{oracle.evicted} blocks evicted, requests spread at random; event lag p50/p99 "
        f"{pct(lags, 0.5) * 1e3:.2f}/{pct(lags, 0.99) * 1e3:.2f} ms measured on 64 real "
        f"streams at {LAG_BATCHES_PER_S:.0f} batches/s): 1/2/4/8 replicas hit "
        f"{row(hit, 'shared')} with loads shared (--replica), {row(hit, 'own')} each with its "
        f"own loads; precision {row(precision, 'shared')} shared, {row(precision, 'own')} "
        f"own; TTFT p90 ms {row(p90, 'shared')} shared, {row(p90, 'own')} own; one "
        f"all-knowing router hit {oracle.hit:.3f}; 8 replicas / 1: "
        f"{runs['shared', 8].hit / one.hit:.3f}x shared, {runs['own', 8].hit / one.hit:.3f}x "
        f"own (target >= 0.95)"
        + (f"; lag scaled, 8 replicas shared: {lag_part}" if lag_part else "")
        + f"; index {memory.per_entry:.0f} bytes per entry, {memory.per_held:.0f} per block "
        f"held ({memory.entries} entries, {memory.held} held; target <= 150); one replica "
        f"ingests {streams.ingest / 1e3:.1f}k events/s ({streams.blocks_per_event:.1f} blocks "
        f"an event) from 64 real streams, bare decode {streams.decode / 1e3:.1f}k (ratio "
        f"{streams.ingest / streams.decode:.2f}), apply alone {streams.apply / 1e3:.1f}k; the "
        f"simulated cluster makes {cluster / 1e3:.2f}k events/s | "
        f"{plot(runs, oracle, scaled, median_lag)} | {time.monotonic() - t0:.0f} s"
    )


if __name__ == "__main__":
    main()

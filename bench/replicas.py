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
`Router` (core.py's `scored` and `pick`; loads.py's `sent`, `landed`) over its own
`BlockIndex`, scoring with scorer.py's `choose`, and with loads shared its `ReplicaLoads` fed
with the /kv/load answers of the others (replicas.py) as they stood REPLICA_MIN_INTERVAL_S +
one event lag earlier.

The trace: CHATS multi-turn chats over TENANTS system prompts (256-1,536 tokens, Zipf
popular), 2-8 turns each; a turn is the chat so far, the last answer and a new user message
(16-256 tokens), answered in 32-384 tokens; the next turn comes THINK_S (exponential mean)
after the answer. Chats start in bursts (1-6 chats of one tenant within 20 ms), the bursts a
Poisson process. Requests are spread over the replicas at random (a load balancer without
affinity), so a chat's turns meet different replicas.

Event lag is measured, not assumed: the recorded batches of the all-knowing router's run are
published by 64 real `ZmqEventPublisher`s (loopback TCP, replay on) to one real `Router` (its
subscriber thread and index, `Router.start()`) at LAG_BATCHES_PER_S for LAG_SECONDS: each
batch's time from publish to applied in the index is a lag sample; each replica's batches
are then delayed by samples of that distribution (in order per stream), and its reads of the
others' loads by REPLICA_MIN_INTERVAL_S + the median lag. Then the same publishers send the
whole recording while the router's lock is held (it queues in ZMQ), and the router's ingest
is timed from the lock's release until every event is applied (best of 3): events per
second, beside a bare decode loop over the same payloads (best of 3; the limit: the
subscriber decodes every batch) and `apply_batch` alone over them decoded; and what that
ingest is in blocks each of 64 instances may store and evict per second.

Per setup, over every request:
    hit        prompt tokens the chosen instance found cached when it admitted the request /
               prompt tokens
    precision  the share of decisions equal to the choice of one all-knowing router: the
               same `Router` code over an index fed the instant each batch is published, and
               the loads of every request in flight
    TTFT p90   simulated (queueing behind prefills and for blocks included)
Setups: 1, 2, 4, 8 replicas with loads shared (named to each other: `--replica`) and with
their own loads only; 8 with their own loads reading one current index (the all-knowing
router's: what a shared index would give them, so that a loss there is the loads', not the
indexes'); 8 with loads shared and the measured lag scaled by 10, 100 and 1,000; and the
all-knowing router routing alone (its hit: what no set of replicas beats by knowing more).
Index bytes: one index rebuilt from the recorded stream under tracemalloc (each payload
decoded inside, as the subscriber does, the decoded batch dropped), counted as allocated
(`_allocated`): per entry (a block hash) at the end and its range over the second half of
the build, and per block held (an instance's block) at the end.

Prints one line; plots (a) hit, (b) precision, (c) TTFT p90 per replica count and (d) hit and
precision against lag to bench/replicas.png. The simulations run two at a time in worker
processes (simulated time: the machine's load does not change them; the stream measurement
runs alone before them). About 2-4 minutes on 2 cores; `--quick` (a quarter of the chats, no
lag runs) about 20-30 s.
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
from kvconnect.model.tokenizer import Tokenizer, load_tokenizer
from kvconnect.router.core import Router
from kvconnect.router.index import BlockIndex
from kvconnect.router.instances import Instance
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


def make_router(instances: list[SimInstance], tokenizer: Tokenizer, index: BlockIndex) -> Router:
    """A replica as `kvconnect router` builds it, never started: the simulation feeds its
    index (its stream's endpoint is never connected)."""
    named = [Instance(s.name, "tcp://127.0.0.1:1") for s in instances]
    return Router(named, index, tokenizer)


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
            router.loads.replicas = ReplicaLoads(others, names, router.take_measured)

    def changed(self, replica: int, now: float, slot: int, delta: int) -> None:
        self.log[replica].append((now, slot, delta))

    def catch_up(self, j: int, now: float) -> None:
        """Replica j reads what every other replica said up to `now - lag` (an answer every
        time: the long poll answers at least every LOAD_HOLD_S, so none goes stale)."""
        replicas = self.routers[j].loads.replicas
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


@dataclass(frozen=True)
class Setup:
    """Who routes in a run."""

    replicas: int
    """Router replicas the requests are spread over; 0: the all-knowing router routes."""
    shared_loads: bool = True
    """The replicas are named to each other (`--replica`): each adds the others' loads."""
    one_index: bool = False
    """The replicas read the all-knowing router's index (current, one for all) instead of
    their own: what a shared index would give them, all else alike."""
    lag_scale: float = 1.0
    """Each replica's event lag: the measured one times this."""

    @property
    def label(self) -> str:
        if not self.replicas:
            return "all-knowing"
        loads = "shared loads" if self.shared_loads else "own loads"
        index = ", one index" if self.one_index else ""
        lag = f", lag x{self.lag_scale:g}" if self.lag_scale != 1.0 else ""
        return f"{self.replicas} replicas, {loads}{index}{lag}"


@dataclass
class Run:
    setup: Setup
    hit: float = 0.0
    precision: float = 0.0
    ttfts: list[float] = field(default_factory=list)
    num_requests: int = 0
    recorded: list[tuple[float, int, bytes]] = field(default_factory=list)
    """(time, instance, payload) of every batch the instances published (when asked)."""
    events: int = 0
    duration: float = 0.0
    evicted: int = 0


class Simulation:
    """Every chat's turns through the routers of `setup`, in simulated time."""

    def __init__(
        self,
        systems: list[list[int]],
        chats: list[Chat],
        setup: Setup,
        lags: list[float],
        record: bool = False,
        seed: int = 5,
    ) -> None:
        self.systems, self.chats, self.setup, self.record = systems, chats, setup, record
        self.lags = [lag * setup.lag_scale for lag in lags] or [0.0]
        self.rng = random.Random(seed)
        self.instances = [SimInstance(i) for i in range(NUM_INSTANCES)]
        self.names = [s.name for s in self.instances]
        self.slot_of = {n: i for i, n in enumerate(self.names)}
        tokenizer = load_tokenizer("tiny")
        self.oracle = make_router(self.instances, tokenizer, BlockIndex(BLOCK))
        self.routers = [
            make_router(
                self.instances,
                tokenizer,
                self.oracle.index if setup.one_index else BlockIndex(BLOCK),
            )
            for _ in range(setup.replicas)
        ]
        lag = REPLICA_MIN_INTERVAL_S + statistics.median(self.lags)
        shared = setup.shared_loads and self.routers
        self.views = LoadViews(self.routers, self.names, lag) if shared else None
        # Per replica, the batches on their way: (arrival, order, instance, batch); and per
        # stream the last arrival (a stream's batches arrive in order).
        self.inbox: list[list[tuple[float, int, int, KVEventBatch]]] = [[] for _ in self.routers]
        self.last_arrival = [[0.0] * NUM_INSTANCES for _ in self.routers]
        self.order = itertools.count()
        self.clock: list[tuple[float, int, str, Job]] = []
        self.run = Run(setup)
        self.hit_tokens = self.prompt_tokens = self.same = 0

    def at(self, t: float, kind: str, job: Job) -> None:
        heapq.heappush(self.clock, (t, next(self.order), kind, job))

    def turn(self, c: int, turn: int, now: float) -> Job:
        """Turn `turn` of chat `c`: its system prompt, the turns and answers so far, the
        user's new message."""
        chat = self.chats[c]
        tokens = list(self.systems[chat.tenant])
        for k in range(turn):
            tokens += chat.users[k] + chat.answers[k]
        tokens += chat.users[turn]
        return Job(c, turn, tokens, chat.answers[turn], now)

    def go(self) -> Run:
        for c, chat in enumerate(self.chats):
            self.at(chat.start, "arrive", self.turn(c, 0, chat.start))
        handlers: dict[str, Callable[[float, Job], None]] = {
            "arrive": self.arrive,
            "prefilled": self.prefilled,
            "answered": self.answered,
        }
        now = 0.0
        while self.clock:
            now, _, kind, job = heapq.heappop(self.clock)
            handlers[kind](now, job)
        for inst in self.instances:
            inst.pool.check_integrity()
            assert inst.kv.num_requests == 0 and not inst.waiting, "a request left behind"
        run = self.run
        run.duration = now
        run.evicted = sum(self.oracle.index.stats.removed.values())
        run.hit = self.hit_tokens / self.prompt_tokens
        run.precision = self.same / run.num_requests
        return run

    # -- the routers' side

    def arrive(self, now: float, job: Job) -> None:
        """A turn reaches the load balancer: a replica at random chooses its instance."""
        best = self.oracle.pick(self.oracle.scored(job.tokens), set())
        assert best is not None
        chosen = best.instance.name
        if self.routers:
            job.replica = self.rng.randrange(len(self.routers))
            router = self.routers[job.replica]
            self.receive(job.replica, now)
            if self.views is not None:
                self.views.catch_up(job.replica, now)
            picked = router.pick(router.scored(job.tokens), set())
            assert picked is not None
            chosen = picked.instance.name
            router.loads.sent(chosen, 0)
        self.same += chosen == best.instance.name
        self.oracle.loads.sent(chosen, 0)  # the all-knowing router knows every request in flight
        job.instance = self.slot_of[chosen]
        if self.views is not None:
            self.views.changed(job.replica, now, job.instance, 1)
        job.request = Request(f"{job.chat}-{job.turn}", job.tokens, SamplingParams(), BLOCK)
        self.instances[job.instance].waiting.append(job)
        self.start(now, self.instances[job.instance])

    def receive(self, r: int, now: float) -> None:
        """Replica r applies the batches that have reached it by `now`."""
        box, index = self.inbox[r], self.routers[r].index
        if index is self.oracle.index:
            return
        while box and box[0][0] <= now:
            _, _, i, batch = heapq.heappop(box)
            index.apply_batch(self.names[i], batch)

    def publish(self, now: float, i: int) -> None:
        """Instance i's events since its last batch, as one batch on its stream."""
        events = self.instances[i].pool.take_events()
        if not events:
            return
        payload = encode_batch(KVEventBatch(now, events, 0))  # type: ignore[arg-type]
        batch = decode_batch(payload)  # what every subscriber decodes
        self.run.events += len(events)
        if self.record:
            self.run.recorded.append((now, i, payload))
        self.oracle.index.apply_batch(self.names[i], batch)  # current: at once
        if self.setup.one_index:
            return
        for r in range(len(self.routers)):
            arrive = max(self.last_arrival[r][i], now + self.rng.choice(self.lags))
            self.last_arrival[r][i] = arrive
            heapq.heappush(self.inbox[r], (arrive, next(self.order), i, batch))

    # -- the engines' side

    def start(self, now: float, inst: SimInstance) -> None:
        """The instance's next prefill, if one can start."""
        job = inst.admit()
        if job is None:
            return
        self.publish(now, job.instance)  # the evictions its allocation made
        computed = len(job.tokens) - job.cached
        self.at(now + PREFILL_FIXED_S + computed * PREFILL_S_PER_TOKEN, "prefilled", job)

    def prefilled(self, now: float, job: Job) -> None:
        inst = self.instances[job.instance]
        assert job.request is not None
        inst.kv.cache_blocks(job.request, len(job.tokens))
        self.publish(now, job.instance)
        job.ttft = now - job.arrival
        inst.prefilling = False
        self.at(now + len(job.answer) * DECODE_S_PER_TOKEN, "answered", job)
        self.start(now, inst)

    def answered(self, now: float, job: Job) -> None:
        """The answer's blocks are cached and published, the request's blocks freed, its
        router counts it done; the chat's next turn comes after the user's think time."""
        inst = self.instances[job.instance]
        req = job.request
        assert req is not None
        for t in job.answer:
            req.append_output_token(t)
        inst.kv.cache_blocks(req, req.num_tokens)
        inst.kv.free(req.request_id)
        self.publish(now, job.instance)
        self.oracle.loads.landed(inst.name, 0)
        if self.routers:
            self.routers[job.replica].loads.landed(inst.name, 0)
            if self.views is not None:
                self.views.changed(job.replica, now, job.instance, -1)
        run = self.run
        run.ttfts.append(job.ttft)
        run.num_requests += 1
        self.hit_tokens += job.cached
        self.prompt_tokens += len(job.tokens)
        chat = self.chats[job.chat]
        if job.turn + 1 < len(chat.users):
            then = now + chat.thinks[job.turn]
            self.at(then, "arrive", self.turn(job.chat, job.turn + 1, then))
        self.start(now, inst)


def simulate(systems: list[list[int]], chats: list[Chat], setup: Setup, lags: list[float]) -> Run:
    """One run (a function: what the worker processes are handed)."""
    return Simulation(systems, chats, setup, lags).go()


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
        while len(router.follow.synced) < NUM_INSTANCES:  # every stream's handshake applied
            if time.monotonic() > deadline:
                raise RuntimeError(f"the router synced {len(router.follow.synced)} of 64 streams")
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
        # Ingest: the whole recording queued (in ZMQ) while the router's lock is held, then
        # timed from the lock's release; three times (the best, as for the decode loop).
        ingest = 0.0
        for _ in range(3):
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
            ingest = max(ingest, num_events / (time.perf_counter() - t0))
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
    low: float
    high: float
    """Per entry, the least and most over the second half of the build: a dict's table grows
    by doubling, so what an entry costs moves within a range as entries come and go."""


def index_bytes(recorded: list[tuple[float, int, bytes]]) -> IndexBytes:
    """The memory of one index built from the stream, as allocated (`_allocated`), per entry
    (a block hash) and per block held (an instance's block)."""
    names = [f"http://instance{i}:8000" for i in range(NUM_INSTANCES)]
    index = BlockIndex(BLOCK)
    for n in names:
        index.add_instance(n)
    gc.collect()
    tracemalloc.start()
    seen: list[tuple[int, int]] = []  # (bytes asked for, entries) along the way
    for k, (_, i, payload) in enumerate(recorded):
        index.apply_batch(names[i], decode_batch(payload))
        if k > len(recorded) // 2 and k % 100 == 0:
            seen.append((tracemalloc.get_traced_memory()[0], index.num_entries))
    gc.collect()
    asked = tracemalloc.get_traced_memory()[0]
    size = _allocated(tracemalloc.take_snapshot())
    tracemalloc.stop()
    index.check_integrity()
    held = sum(index.num_blocks().values())
    rounding = (size - asked) / index.num_entries  # pymalloc's, per entry (its hash's int)
    along = [b / n + rounding for b, n in seen]
    return IndexBytes(
        size / index.num_entries, size / held, index.num_entries, held, min(along), max(along)
    )


# -- the report ---------------------------------------------------------------------------------


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    pos = q * (len(s) - 1)
    lo = math.floor(pos)
    return s[lo] + (s[min(lo + 1, len(s) - 1)] - s[lo]) * (pos - lo)


def plot(
    runs: dict[tuple[str, int], Run],
    oracle: Run,
    one_index: Run,
    scaled: dict[float, Run],
    median_lag: float,
) -> str:
    """(a) hit, (b) precision, (c) TTFT p90 per replica count, shared loads against own;
    (d) hit and precision at 8 replicas against event lag."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "plot skipped: matplotlib is not installed (pip install matplotlib)"
    fig, axes = plt.subplots(2, 2, figsize=(11.0, 7.6))
    (a, b), (c, d) = axes
    modes = {"shared": ("tab:blue", "loads shared (--replica)"), "own": ("tab:orange", "own loads")}
    xs = list(REPLICAS)
    for mode, (color, label) in modes.items():
        a.plot(xs, [runs[mode, n].hit for n in xs], "o-", color=color, label=label)
        b.plot(xs, [runs[mode, n].precision for n in xs], "o-", color=color, label=label)
        c.plot(xs, [pct(runs[mode, n].ttfts, 0.9) * 1e3 for n in xs], "o-", color=color,
               label=label)  # fmt: skip
    a.plot([8], [one_index.hit], "D", color="tab:red", label="own loads, one current index")
    a.axhline(oracle.hit, color="tab:green", lw=1, label="one all-knowing router")
    a.axhline(0.95 * runs["shared", 1].hit, color="gray", lw=0.8, ls=":",
              label="target: 0.95 x one replica's")  # fmt: skip
    a.set_title("(a) cache hit: prompt tokens found cached / prompt tokens", fontsize=9)
    b.set_title("(b) precision: decisions equal to the all-knowing router's", fontsize=9)
    c.set_title("(c) TTFT p90, ms (simulated; log scale)", fontsize=9)
    c.set_yscale("log")
    for ax in (a, b, c):
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(n) for n in xs])
        ax.set_xlabel("router replicas (requests spread at random)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    a.set_ylim(0.5, 1.0)
    b.set_ylim(0.5, 1.02)
    if scaled:
        lag_ms = [median_lag * s * 1e3 for s in (1.0, *scaled)]
        chosen = [runs["shared", 8], *scaled.values()]
        d.plot(lag_ms, [r.hit for r in chosen], "o-", color="tab:blue", label="hit")
        d.plot(lag_ms, [r.precision for r in chosen], "s--", color="tab:blue", label="precision")
        d.axhline(runs["shared", 1].hit, color="gray", lw=0.8, label="hit, one replica")
        d.set_xscale("log")
        d.set_xlabel("event lag p50, ms (measured, then x10, x100, x1000)")
        d.set_ylim(0.5, 1.02)
        d.grid(True, alpha=0.3)
        d.legend(fontsize=7)
    else:
        d.axis("off")
    d.set_title("(d) 8 replicas, loads shared: against event lag", fontsize=9)
    fig.suptitle(
        f"{NUM_INSTANCES} simulated instances x {CACHE_BLOCKS} blocks of {BLOCK}, {CHATS} "
        f"multi-turn chats, kvconnect's router replicas",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(PLOT, dpi=100)
    plt.close(fig)
    return f"plot bench/{PLOT.name}"


def main() -> None:
    logging.disable(logging.WARNING)
    t0 = time.monotonic()
    systems, chats = make_trace()
    oracle = Simulation(systems, chats, Setup(0), [], record=True).go()
    streams = real_streams(oracle.recorded)  # alone on the machine: it is timed
    lags = streams.lags
    memory = index_bytes(oracle.recorded)
    setups = [Setup(n, shared) for n in REPLICAS for shared in (True, False) if n > 1 or shared]
    setups += [Setup(8, False, one_index=True)]
    setups += [Setup(8, lag_scale=s) for s in LAG_SCALES]
    # The runs are in simulated time: two at once (one per core) changes nothing in them.
    spawn = multiprocessing.get_context("spawn")  # no fork of this process's ZMQ state
    with ProcessPoolExecutor(WORKERS, mp_context=spawn) as pool:
        futures = [
            pool.submit(simulate, systems, chats, s, lags)
            for s in sorted(setups, key=lambda s: -s.replicas)  # the longest first
        ]
        done = {f.result().setup: f.result() for f in futures}
    one = done[Setup(1)]
    runs = {("shared", n): done[Setup(n)] for n in REPLICAS}
    runs |= {("own", n): done[Setup(n, n == 1)] for n in REPLICAS}
    one_index = done[Setup(8, False, one_index=True)]
    scaled = {s: done[Setup(8, lag_scale=s)] for s in LAG_SCALES}

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
        for s, r in scaled.items()
    )
    blocks = streams.ingest * streams.blocks_per_event / 2 / NUM_INSTANCES  # stored + removed
    drawn = plot(runs, oracle, one_index, scaled, median_lag)
    print(
        f"replicas ({NUM_INSTANCES} simulated instances x {CACHE_BLOCKS} blocks of {BLOCK}, "
        f"{CHATS} chats, {one.num_requests} turns in {oracle.duration:.0f} s simulated, "
        f"{oracle.evicted} blocks evicted, requests spread at random; event lag p50/p99 "
        f"{pct(lags, 0.5) * 1e3:.2f}/{pct(lags, 0.99) * 1e3:.2f} ms measured on 64 real "
        f"streams at {LAG_BATCHES_PER_S:.0f} batches/s): 1/2/4/8 replicas hit "
        f"{row(hit, 'shared')} with loads shared (--replica), {row(hit, 'own')} each with its "
        f"own loads ({one_index.hit:.3f} at 8 with one current index for all); precision "
        f"{row(precision, 'shared')} shared, {row(precision, 'own')} own; TTFT p90 ms "
        f"{row(p90, 'shared')} shared, {row(p90, 'own')} own; one all-knowing router hit "
        f"{oracle.hit:.3f}; 8 replicas / 1: {runs['shared', 8].hit / one.hit:.3f}x shared, "
        f"{runs['own', 8].hit / one.hit:.3f}x own (target >= 0.95)"
        + (f"; lag scaled, 8 replicas shared: {lag_part}" if lag_part else "")
        + f"; index {memory.per_entry:.0f} bytes per entry ({memory.low:.0f}-"
        f"{memory.high:.0f} along the build), {memory.per_held:.0f} per block held "
        f"({memory.entries} entries, {memory.held} held; target <= 150); one replica "
        f"ingests {streams.ingest / 1e3:.1f}k events/s ({streams.blocks_per_event:.1f} blocks "
        f"an event) from 64 real streams, bare decode {streams.decode / 1e3:.1f}k (ratio "
        f"{streams.ingest / streams.decode:.2f}), apply alone {streams.apply / 1e3:.1f}k: "
        f"enough for 64 instances each storing and evicting {blocks:.0f} blocks/s "
        f"({blocks * BLOCK / 1e3:.0f}k tokens/s) | {drawn} | {time.monotonic() - t0:.0f} s"
    )


if __name__ == "__main__":
    main()

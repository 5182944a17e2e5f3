"""Router index speed and routing quality, each beside its own reference in the same run.

Prints one line:
- index events applied per second (BlockStored/BlockRemoved of 16 blocks each), beside a bare
  dict-count loop over the same hashes (the limit), and the index's memory per million entries;
- routing decisions (score + choose) over 64 instances holding 1M indexed blocks, p50/p99, for
  8,192- and 100,000-token prompts, cold (a prefix nobody holds) and extending a prefix the
  instances hold and the router has seen (its hash memo), beside bare dict lookups of the held
  hashes (the floor for walking the prefix);
- lookup latency for an 8,192-token prompt: hashing its 512 blocks, then scoring them;
- hashing cost per 1,000 tokens for each of vLLM's algorithms, and for sha256_cbor with every
  block serialised by cbor2 (as before kvconnect's block encoder), beside bare hashlib.sha256
  over the very bytes it hashes (the serialisations made beforehand: the limit);
- the index apply rate for an instance the router keys by its own chain over token ids (its
  seed is not reproducible) beside one keyed by its engine hashes;
- a multi-tenant workload (8 tenants, 1,024-token system prompts, 64-token user turns, Poisson
  arrivals) over 4 instances: prefix hit rate and TTFT p50/p90 for KV-aware routing (the real
  BlockIndex fed by the instances' real block-pool events, the real scorer), round-robin, and an
  oracle that reads every pool directly and uses the same cost function.

The instances are simulated: each has a real engine `BlockPool` (prefix caching, LRU eviction,
events) and serves requests one at a time; a request's prefill time is its uncached tokens
times the tiny model's per-token prefill cost, measured at the start of this run.
"""

from __future__ import annotations

import hashlib
import logging
import pickle
import random
import statistics
import time
from collections import Counter
from collections.abc import Callable

import cbor2

from kvconnect import hashing
from kvconnect.engine.block_pool import BlockPool
from kvconnect.engine.kv_cache_manager import KVCacheManager
from kvconnect.engine.request import Request, SamplingParams
from kvconnect.events import BlockRemoved, BlockStored, KVEventBatch
from kvconnect.hashing import ALGORITHMS, block_hashes, seed_hash, to_wire
from kvconnect.router.index import BlockIndex, PrefixScore
from kvconnect.router.schemes import HashScheme
from kvconnect.router.scorer import Inputs, choose, spread_key

BS = 16
NUM_INSTANCES = 4


def prefill_seconds_per_token() -> float:
    import torch

    from kvconnect.model.llama import AttentionMetadata
    from kvconnect.model.loader import load_model

    model, _ = load_model("tiny")
    n = 1024
    caches = [torch.zeros(model.kv_cache_shape(n // BS, BS)) for _ in model.layer_names]
    meta = AttentionMetadata([n], [n], [list(range(n // BS))], torch.arange(n), BS)
    best = float("inf")
    with torch.inference_mode():
        for _ in range(3):
            t0 = time.perf_counter()
            model(torch.randint(0, 256, (n,)), torch.arange(n), caches, meta)
            best = min(best, (time.perf_counter() - t0) / n)
    return best


def index_rate() -> tuple[float, float]:
    rng = random.Random(0)
    batches = []
    for _ in range(2000):
        hashes = [rng.getrandbits(64) for _ in range(16)]
        events: list[BlockStored | BlockRemoved] = [
            BlockStored(hashes, None, [], BS, None, "GPU", None)
        ]
        if rng.random() < 0.5:
            events.append(BlockRemoved(hashes[:8], "GPU"))
        batches.append(KVEventBatch(0.0, events, 0))  # type: ignore[arg-type]
    num_events = sum(len(b.events) for b in batches)
    index = BlockIndex(BS)
    iid = "http://x:1"
    t0 = time.perf_counter()
    for b in batches:
        index.apply_batch(iid, b)
    ours = num_events / (time.perf_counter() - t0)
    counts: Counter[int] = Counter()
    t0 = time.perf_counter()
    for b in batches:
        for e in b.events:
            delta = 1 if isinstance(e, BlockStored) else -1
            for h in e.block_hashes:
                counts[h] += delta  # type: ignore[index]
    bare = num_events / (time.perf_counter() - t0)
    return ours, bare


def hashing_costs() -> tuple[dict[str, float], float]:
    """us per 1,000 tokens at block size 16, per algorithm; and bare sha256 of the pickles."""
    tokens = [random.Random(2).randrange(49152) for _ in range(8192)]
    per_k = len(tokens) / 1000
    out = {}
    for algorithm in ALGORITHMS:
        scheme = HashScheme(algorithm, "0")
        best = min(_timed(lambda s=scheme: s.wire_hashes(tokens, BS)) for _ in range(5))
        out[algorithm] = best / per_k * 1e6
    # Before kvconnect's block encoder: sha256_cbor with every block through cbor2.
    fast = hashing._cbor
    hashing._cbor = lambda obj: cbor2.dumps(obj, canonical=True)
    try:
        scheme = HashScheme("sha256_cbor", "0")
        best = min(_timed(lambda: scheme.wire_hashes(tokens, BS)) for _ in range(5))
        out["sha256_cbor through cbor2"] = best / per_k * 1e6
    finally:
        hashing._cbor = fast
    # The limit: SHA-256 of the same pickled (parent, tokens, None) tuples, made beforehand.
    parents = block_hashes(tokens, BS, algorithm="sha256", seed="0")
    blobs = [
        pickle.dumps(
            (
                parents[i - 1] if i else seed_hash("sha256", "0"),
                tuple(tokens[i * BS : (i + 1) * BS]),
                None,
            ),
            protocol=pickle.HIGHEST_PROTOCOL,
        )
        for i in range(len(parents))
    ]
    bare = min(_timed(lambda: [hashlib.sha256(b).digest() for b in blobs]) for _ in range(5))
    return out, bare / per_k * 1e6


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def keyed_apply_rates() -> tuple[float, float]:
    """Events/s applied for a stream of prefix-chained BlockStored/BlockRemoved with token ids:
    (keyed by engine hashes, keyed by the router's own chain)."""
    rng = random.Random(3)
    rates = []
    for scheme in (HashScheme("sha256", "vllm-none-hash"), HashScheme("xxhash", "private")):
        batches = []
        for _ in range(500):
            tokens = [rng.randrange(49152) for _ in range(8 * BS)]
            raw = block_hashes(tokens, BS, algorithm=scheme.algorithm, seed=scheme.seed)
            wire = [to_wire(h) for h in raw]
            stored = BlockStored(wire, None, tokens, BS, None, "GPU", None, extra_keys=[None] * 8)
            batches.append(KVEventBatch(0.0, [stored, BlockRemoved(wire[4:], "GPU")], 0))
        index = BlockIndex()
        t0 = time.perf_counter()
        for b in batches:
            index.apply_batch("http://x:1", b)
        rates.append(2 * len(batches) / (time.perf_counter() - t0))
        assert ("router-keyed" in index.schemes()["http://x:1"][0]) == (scheme.seed == "private")
    return rates[0], rates[1]


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def decisions() -> tuple[dict[str, tuple[float, float]], float, float]:
    """{case: (p50, p99) seconds}, the bare lookup floor for the 100k shared case, and the
    index's bytes per million entries."""
    rng = random.Random(7)
    docs = [[rng.randrange(49152) for _ in range(100_000)] for _ in range(8)]
    before = rss()
    index = BlockIndex(BS, max_entries=2_000_000)
    scheme = index.scheme
    chains = [scheme.wire_hashes(d, BS) for d in docs]
    names = [f"http://i{i}:8000" for i in range(64)]
    per_instance = 1_000_000 // len(names)
    for i, name in enumerate(names):
        doc, chain = docs[i % 8], chains[i % 8]
        held = rng.randrange(len(chain) // 2, len(chain))  # a prefix of one document
        stored = BlockStored(chain[:held], None, doc[: held * BS], BS, None, "GPU", None)
        filler = [rng.getrandbits(64) for _ in range(per_instance - held)]
        events = [stored, BlockStored(filler, None, [], BS, None, "CPU", None)]
        index.apply_batch(name, KVEventBatch(0.0, events, 0))  # type: ignore[arg-type]
    num_entries = index.num_entries
    per_million = (rss() - before) / num_entries * 1e6
    cases = {
        "8k cold": lambda: [rng.randrange(49152) for _ in range(8192)],
        "8k shared": lambda: docs[0][:8000] + [rng.randrange(49152) for _ in range(192)],
        "100k cold": lambda: [rng.randrange(49152) for _ in range(100_000)],
        "100k shared": lambda: docs[0][:90_000] + [rng.randrange(49152) for _ in range(10_000)],
    }
    out = {}
    loads = dict.fromkeys(names, 0)
    for case, make in cases.items():
        prompts = [make() for _ in range(40)]
        index.score(prompts[0])  # the router has seen this prefix before (the memo)
        times = []
        for p in prompts:
            t0 = time.perf_counter()
            choose(names, Inputs(index.score(p), loads, len(p), spread_key=spread_key(p)))
            times.append(time.perf_counter() - t0)
        times.sort()
        out[case] = (statistics.median(times), times[int(len(times) * 0.99) - 1])
    entries = index._entries
    held = chains[0][: 90_000 // BS]
    t0 = time.perf_counter()
    for _ in range(10):
        for h in held:
            entries.get(h)
    floor = (time.perf_counter() - t0) / 10
    return out, floor, per_million


def lookup_latency() -> tuple[float, float]:
    index = BlockIndex(BS)
    tokens = [random.Random(1).randrange(256) for _ in range(8192)]
    hashes = index.request_hashes(tokens)
    for i in range(NUM_INSTANCES):
        index.apply_batch(
            f"http://i{i}:1",
            KVEventBatch(
                0.0, [BlockStored(hashes[: 100 * (i + 1)], None, [], BS, None, "GPU", None)], 0
            ),
        )
    t0 = time.perf_counter()
    for _ in range(20):
        index.request_hashes(tokens)
    hashing = (time.perf_counter() - t0) / 20
    t0 = time.perf_counter()
    for _ in range(200):
        index.score_hashes(hashes)
    scoring = (time.perf_counter() - t0) / 200
    return hashing, scoring


class SimInstance:
    def __init__(self, i: int) -> None:
        self.name = f"http://instance{i}:8000"
        self.pool = BlockPool(320, BS, enable_caching=True, enable_kv_cache_events=True)
        self.kv = KVCacheManager(self.pool)
        self.busy_until = 0.0
        self.queue_ends: list[float] = []

    def load(self, now: float) -> int:
        self.queue_ends = [t for t in self.queue_ends if t > now]
        return len(self.queue_ends)

    def serve(self, req: Request, now: float, sec_per_token: float) -> tuple[float, int]:
        """(TTFT, cached tokens) of `req` arriving at `now`."""
        hits, cached = self.kv.get_computed_blocks(req)
        blocks = self.kv.allocate_slots(req, req.num_tokens, hits)
        assert blocks is not None, "pool too small for the workload"
        self.kv.cache_blocks(req, req.num_tokens)
        self.kv.free(req.request_id)
        start = max(now, self.busy_until)
        self.busy_until = start + (req.num_tokens - cached) * sec_per_token
        self.queue_ends.append(self.busy_until)
        return self.busy_until - now, cached


Policy = Callable[[list[SimInstance], Request, float, int], SimInstance]


def simulate(policy_name: str, sec_per_token: float) -> tuple[float, float, float]:
    rng = random.Random(42)
    tenants = [[rng.randrange(256) for _ in range(1024)] for _ in range(8)]
    instances = [SimInstance(i) for i in range(NUM_INSTANCES)]
    index = BlockIndex(BS)
    rr = 0
    now = 0.0
    ttfts, hit_tokens, prompt_tokens = [], 0, 0
    mean_gap = 1088 * sec_per_token / NUM_INSTANCES / 0.7  # about 70% busy if nothing is cached
    for n in range(400):
        now += rng.expovariate(1 / mean_gap)
        tokens = rng.choice(tenants) + [rng.randrange(256) for _ in range(64)]
        req = Request(str(n), tokens, SamplingParams(max_tokens=1), BS)
        loads = {inst.name: inst.load(now) for inst in instances}
        ids = [inst.name for inst in instances]
        if policy_name == "round-robin":
            target = instances[rr % NUM_INSTANCES]
            rr += 1
        else:
            if policy_name == "kv-aware":
                scores = index.score(tokens)
            else:  # oracle: every pool's real contents
                scores = {}
                for inst in instances:
                    run = 0
                    for h in req.block_hashes:
                        if inst.pool.get_cached_block(h) is None:
                            break
                        run += 1
                    scores[inst.name] = PrefixScore(run, float(run), block_size=BS)
            chosen = choose(ids, Inputs(scores, loads, len(tokens))).instance
            target = next(inst for inst in instances if inst.name == chosen)
        ttft, cached = target.serve(req, now, sec_per_token)
        ttfts.append(ttft)
        hit_tokens += cached
        prompt_tokens += len(tokens)
        for inst in instances:  # the instances publish; the router applies
            events = inst.pool.take_events()
            if events:
                index.apply_batch(inst.name, KVEventBatch(now, events, 0))  # type: ignore[arg-type]
    q = statistics.quantiles(ttfts, n=10)
    return hit_tokens / prompt_tokens, q[4], q[8]


def main() -> None:
    logging.disable(logging.WARNING)  # the router-keyed stream is expected, not news
    spt = prefill_seconds_per_token()
    ours, bare = index_rate()
    cases, floor, per_million = decisions()
    hashing, scoring = lookup_latency()
    costs, bare_sha = hashing_costs()
    engine_keyed, router_keyed = keyed_apply_rates()
    parts = []
    for name in ("kv-aware", "round-robin", "oracle"):
        hit, p50, p90 = simulate(name, spt)
        parts.append(f"{name} hit {hit:.0%} TTFT p50/p90 {p50 * 1000:.0f}/{p90 * 1000:.0f} ms")
    print(
        f"router: index {ours / 1e6:.2f}M events/s (bare dict count {bare / 1e6:.2f}M, "
        f"ratio {ours / bare:.2f}), {per_million / 2**20:.0f} MiB per 1M entries; "
        "decision p50/p99 ms, 64 instances, 1M blocks: "
        + ", ".join(f"{c} {a * 1e3:.2f}/{b * 1e3:.2f}" for c, (a, b) in cases.items())
        + f" (bare dict lookups of the 5,625 held blocks {floor * 1e3:.2f}); "
        f"8192-token lookup {hashing * 1000:.2f} ms hashing + {scoring * 1e6:.0f} us scoring; "
        "hashing us/1k tokens: "
        + ", ".join(f"{a} {us:.0f}" for a, us in costs.items())
        + f" (bare hashlib.sha256 of the same bytes {bare_sha:.0f}); "
        f"apply with token ids: engine-keyed {engine_keyed / 1e3:.0f}k ev/s, "
        f"router-keyed {router_keyed / 1e3:.0f}k ev/s; "
        f"4 instances, 8 tenants: " + "; ".join(parts)
    )


if __name__ == "__main__":
    main()

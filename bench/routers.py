"""KV-aware routers side by side on one workload: kvconnect's router, vllm-router (kv_aware,
cache_aware, round_robin) in front of the same two `kvconnect serve --model tiny` instances.

Prints one line. Per router:
- hit: the prefix hit rate, cached prompt tokens / prompt tokens, as the instances report it
  in each answer's usage (ideal: every request after a tenant's first hits its prefix);
- ttft p50/p90: time to the answer of a one-token completion (the prefill is the cost);
- added p50/p99: what the router adds per proxied request on that workload, each routed
  request followed by a direct one of the same shape (same tenant prefix, another suffix) sent
  to the instance the router chose (the prefix is cached there for both, or for neither);
then the front's own cost, measured apart on a backend that answers at once (so the engine's
time does not hide it): added p50/p99 non-streamed and to the first streamed byte, for
kvconnect's router and vllm-router kv_aware in the same run, and each one's CPU per request.

The workload (the one of issue 24): 3 tenants, each a 512-token shared prefix plus 16 tokens of
its own per request, as token ids, ROUNDS rounds; each router gets prefixes of its own, so
every router starts cold. vllm-router comes from `.peers/vllm-router` (`bash tests_peers/env.sh
.peers` builds it); without it only kvconnect's router runs.
"""

from __future__ import annotations

import http.client
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VLLM_ROUTER = ROOT / ".peers" / "vllm-router" / "bin" / "vllm-router"
TENANTS = 3
PREFIX_TOKENS = 512
SUFFIX_TOKENS = 16
ROUNDS = int(os.environ.get("KVCONNECT_BENCH_ROUNDS", "12"))
FRONT_REQUESTS = int(os.environ.get("KVCONNECT_BENCH_FRONT_REQUESTS", "400"))
STUB = Path(__file__).with_name("_stub_backend.py")


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
    """Everything the bench starts, stopped at the end whatever happens."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []
        self.logs = Path(tempfile.mkdtemp(prefix="bench-routers-"))

    def start(self, args: list[str], name: str, health: str | None = None) -> int:
        with open(self.logs / f"{name}.log", "wb") as log:
            proc = subprocess.Popen(
                args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.procs.append(proc)
        if health is not None:
            wait_healthy(health, proc, self.logs / f"{name}.log")
        return proc.pid

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGINT)
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)


def wait_healthy(url: str, proc: subprocess.Popen[bytes], log: Path, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    host = url.removeprefix("http://")
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url} exited {proc.returncode}: {log.read_text()[-1500:]}")
        try:
            conn = http.client.HTTPConnection(host, timeout=1)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} not healthy in {timeout}s")


class Client:
    """One keep-alive connection: the same client cost whatever the target."""

    def __init__(self, url: str) -> None:
        self.conn = http.client.HTTPConnection(url.removeprefix("http://"), timeout=120)

    def complete(self, prompt: list[int], stream: bool = False) -> tuple[float, str, int, int]:
        """(seconds to the whole answer, or streamed to its first byte; the instance that
        answered when the router says so; cached and prompt tokens, non-streamed only)."""
        body = json.dumps(
            {"model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0, "stream": stream}
        )
        start = time.perf_counter()
        self.conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        resp = self.conn.getresponse()
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


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(len(xs) * q))] * 1e3


def start_kvconnect_router(ps: Processes, backends: list[tuple[str, int]], name: str) -> str:
    """`kvconnect router` over (url, events port) backends; its URL."""
    port = free_port()
    args = [sys.executable, "-m", "kvconnect.cli", "router", "--model", "tiny", "--port", str(port)]
    for url, ev in backends:
        args += ["--instance", f"{url},tcp://127.0.0.1:{ev},tcp://127.0.0.1:{ev + 10000}"]
    ps.start(args, name, f"http://127.0.0.1:{port}")
    return f"http://127.0.0.1:{port}"


def start_vllm_router(
    ps: Processes, policy: str, backends: list[tuple[str, int]], name: str
) -> str:
    port = free_port()
    urls = [u for u, _ in backends]
    args = [str(VLLM_ROUTER), "--host", "127.0.0.1", "--port", str(port), "--policy", policy,
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
            "--worker-urls", *urls]  # fmt: skip
    if policy == "kv_aware":
        args += ["--kv-event-block-size", "16", "--kv-event-model", "tiny"]
        for url, ev in backends:
            args += ["--kv-event-source", f"{url}=tcp://127.0.0.1:{ev}"]
            args += ["--kv-event-replay-source", f"{url}=tcp://127.0.0.1:{ev + 10000}"]
    ps.start(args, name, f"http://127.0.0.1:{port}")
    return f"http://127.0.0.1:{port}"


def workload(router: str, urls: list[str], seed: int) -> str:
    """Hit rate, TTFT and added latency of one router on the tenants' workload."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1, 250) for _ in range(PREFIX_TOKENS)] for _ in range(TENANTS)]
    via, direct = Client(router), {u: Client(u) for u in urls}
    cached = prompt = 0
    ttft: list[float] = []
    added: list[float] = []
    home: dict[int, str] = {}  # a tenant's instance, for routers that do not say
    for r in range(ROUNDS):
        for t, prefix in enumerate(prefixes):
            a = prefix + [rng.randrange(1, 250) for _ in range(SUFFIX_TOKENS)]
            b = prefix + [rng.randrange(1, 250) for _ in range(SUFFIX_TOKENS)]
            routed, where, c, p = via.complete(a)
            cached, prompt = cached + c, prompt + p
            ttft.append(routed)
            where = where or home.setdefault(t, urls[t % len(urls)])
            if r >= 1:  # the pair: the same instance, the prefix cached there (or not) alike
                alone = direct[where].complete(b)[0]
                added.append(routed - alone)
    return (
        f"hit {cached / prompt:.3f}, ttft p50/p90 {pct(ttft, 0.5):.1f}/{pct(ttft, 0.9):.1f} ms, "
        f"added p50/p99 {pct(added, 0.5):.2f}/{pct(added, 0.99):.2f} ms"
    )


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
    results: dict[tuple[str, bool], list[float]] = {(n, s): [] for n in routers for s in (0, 1)}
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


def main() -> None:
    ps = Processes()
    try:
        backends: list[tuple[str, int]] = []
        for i in range(2):
            port = free_port((0, 10000, 20000))
            events = json.dumps({"enable_kv_cache_events": True})
            args = [sys.executable, "-m", "kvconnect.cli", "serve", "--model", "tiny",
                    "--port", str(port), "--kv-events-config", events,
                    "--num-kv-blocks", "8192"]  # fmt: skip
            ps.start(args, f"serve-{i}", f"http://127.0.0.1:{port}")
            backends.append((f"http://127.0.0.1:{port}", port + 10000))
        urls = [u for u, _ in backends]
        runs: list[tuple[str, Callable[[], str]]] = [
            ("kvconnect", lambda: start_kvconnect_router(ps, backends, "kvconnect-router"))
        ]
        if VLLM_ROUTER.exists():
            for policy in ("kv_aware", "cache_aware", "round_robin"):
                runs.append(
                    (
                        f"vllm-router {policy}",
                        lambda p=policy: start_vllm_router(ps, p, backends, p),
                    )  # type: ignore[misc]
                )
        parts = [
            f"{name}: {workload(start(), urls, seed)}"
            for seed, (name, start) in enumerate(runs)
            if not os.environ.get("KVCONNECT_BENCH_FRONT_ONLY")
        ]
        stub_port = free_port()
        stub = f"http://127.0.0.1:{stub_port}"
        ps.start([sys.executable, str(STUB), str(stub_port)], "stub", stub)
        fronts = {"kvconnect": start_kvconnect_router(ps, [(stub, free_port((0, 10000)))], "front")}
        front_pids = {"kvconnect": ps.procs[-1].pid}
        if VLLM_ROUTER.exists():
            ev = free_port()
            fronts["vllm-router kv_aware"] = start_vllm_router(
                ps, "kv_aware", [(stub, ev)], "vr-front"
            )
            front_pids["vllm-router kv_aware"] = ps.procs[-1].pid
        cost = front_cost({n: (u, front_pids[n]) for n, u in fronts.items()}, stub)
        print(
            f"routers ({TENANTS} tenants x {PREFIX_TOKENS}-token prefixes, {ROUNDS} rounds, 2 tiny "
            f"instances): " + "; ".join(parts) + f" | front's own added latency p50/p99: {cost}"
        )
    finally:
        ps.stop()


if __name__ == "__main__":
    main()

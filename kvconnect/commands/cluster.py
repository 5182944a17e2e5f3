"""`kvconnect cluster`: N engine instances, a router in front, optionally a shared Redis, all on
loopback; shows progress while they start, sends a short demo workload through the router, then
serves until Ctrl-C and stops everything it started.

    instance i   http://127.0.0.1:(base_port + 1 + i), events and replay derived from that
                 port (+10000, +20000); the model (SmolLM2 by default), OffloadConnector with
                 a CPU tier (and the Redis tier, if asked); its log in a temporary directory
    router       http://127.0.0.1:base_port
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import TextIO

from kvconnect.commands.redis_server import LocalRedis
from kvconnect.commands.startup import EVENTS_PORT_OFFSET, REPLAY_PORT_OFFSET, check_port_free
from kvconnect.model.tokenizer import load_tokenizer
from kvconnect.router.core import Router
from kvconnect.router.index import BlockIndex
from kvconnect.router.instances import Instance
from kvconnect.router.server import RouterFront


def wait_healthy(url: str, proc: subprocess.Popen[bytes] | None, timeout: float) -> None:
    """Return once `url`/health answers 200; `RuntimeError` if `proc` exits or time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{url} exited with code {proc.returncode} while starting")
        try:
            with urllib.request.urlopen(url + "/health", timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"{url} did not become healthy within {timeout:.0f}s")


def instance_command(
    i: int, args: argparse.Namespace, redis_tier: dict[str, object] | None
) -> list[str]:
    tiers: list[dict[str, object]] = [{"kind": "cpu", "max_bytes": 256 << 20}]
    if redis_tier:
        tiers.append(redis_tier)
    transfer = {
        "kv_connector": "OffloadConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"chunk_size": 64, "tiers": tiers},
    }
    return [
        sys.executable,
        "-m",
        "kvconnect.cli",
        "serve",
        "--model",
        args.model,
        "--tp",
        str(args.tp),
        "--port",
        str(args.base_port + 1 + i),
        "--kv-transfer-config",
        json.dumps(transfer),
        # Events on, their addresses derived from the HTTP port (see startup.py).
        "--kv-events-config",
        json.dumps({"enable_kv_cache_events": True}),
        # The demo prints each answer's cached prompt tokens (and the router checks them
        # against its index): on loopback, with the demo's own two tenants.
        "--enable-prompt-tokens-details",
    ]


TENANTS = {
    "acme": (
        "You are the support assistant of Acme Rockets. Acme sells model rockets, launch pads "
        "and engines. Orders ship within two days. Refunds are possible within thirty days. "
        "Answer in one short sentence.",
        ["How long does shipping take?", "Can I get a refund?", "What do you sell?"],
    ),
    "globex": (
        "You are the assistant of Globex Travel. Globex books trains across Europe. Tickets "
        "can be changed until one hour before departure. Answer in one short sentence.",
        ["Can I change my ticket?", "What do you book?", "Until when can I change a ticket?"],
    ),
}


def demo(router_url: str, out: TextIO, rounds: int = 3) -> None:
    """Two tenants with their own system prompts, a few user questions each, as chats."""
    for r in range(rounds):
        for name, (system, questions) in TENANTS.items():
            messages = [
                {"role": "system", "content": system},
                {"role": "user", "content": questions[r % len(questions)]},
            ]
            body = {"messages": messages, "max_tokens": 24, "temperature": 0}
            req = urllib.request.Request(
                router_url + "/v1/chat/completions",
                data=json.dumps(body).encode(),
                headers={"Content-Type": "application/json"},
            )
            t0 = time.monotonic()
            with urllib.request.urlopen(req, timeout=120) as resp:
                answer = json.load(resp)
                where = resp.headers["x-kvconnect-instance"]
            usage = answer["usage"]
            cached = usage["prompt_tokens_details"]["cached_tokens"]
            text = answer["choices"][0]["message"]["content"].replace("\n", " ")
            print(
                f"  {name:7s} round {r}: -> {where}  {cached:3d}/{usage['prompt_tokens']} "
                f"prompt tokens cached, {(time.monotonic() - t0) * 1000:5.0f} ms  {text!r}",
                file=out,
                flush=True,
            )


class BackgroundRouter:
    """A router serving on its own event loop thread, for as long as the cluster runs."""

    def __init__(self, router: Router, port: int) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self._front = RouterFront(router)  # the connection cap and deadlines of `kvconnect router`
        self._loop = asyncio.new_event_loop()
        self._loop.run_until_complete(self._front.start("127.0.0.1", port))
        threading.Thread(target=self._loop.run_forever, daemon=True).start()

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._front.close(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)


def start_instances(
    args: argparse.Namespace,
    redis_tier: dict[str, object] | None,
    logs: str,
    procs: list[subprocess.Popen[bytes]],
) -> list[Instance]:
    """Start every instance (appended to `procs` as it starts) and wait until each is up."""
    instances = []
    for i in range(args.instances):
        http_port = args.base_port + 1 + i
        log = open(f"{logs}/instance-{i}.log", "wb")  # noqa: SIM115 - kept by the child
        # Own sessions: a terminal's Ctrl-C reaches only this process, which then stops
        # each instance once.
        procs.append(
            subprocess.Popen(
                instance_command(i, args, redis_tier),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        )
        instances.append(
            Instance(
                f"http://127.0.0.1:{http_port}",
                f"tcp://127.0.0.1:{http_port + EVENTS_PORT_OFFSET}",
                f"tcp://127.0.0.1:{http_port + REPLAY_PORT_OFFSET}",
            )
        )
    return instances


def wait_instances(
    instances: list[Instance], procs: list[subprocess.Popen[bytes]], logs: str, out: TextIO
) -> None:
    start = time.monotonic()
    for n, (inst, proc) in enumerate(zip(instances, procs, strict=True)):
        try:
            wait_healthy(inst.url, proc, timeout=180)
        except RuntimeError as e:
            tail = Path(f"{logs}/instance-{n}.log").read_text(errors="replace")[-2000:]
            raise RuntimeError(f"{e}; its log ends:\n{tail}") from None
        print(
            f"[{n + 1}/{len(instances)}] instance {inst.url} ready "
            f"({time.monotonic() - start:.1f}s), events {inst.events_endpoint}",
            file=out,
            flush=True,
        )


def print_router_metrics(router_url: str, out: TextIO) -> None:
    with urllib.request.urlopen(router_url + "/metrics") as r:
        wanted = ("decisions_total", "hit_blocks_total", "index_entries ")
        for line in r.read().decode().splitlines():
            if any(w in line for w in wanted) and not line.startswith("#"):
                print(f"  {line}", file=out)


def serve_until_interrupted(out: TextIO) -> None:
    print("# serving; Ctrl-C stops the cluster", file=out, flush=True)
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt))
    try:
        while True:
            time.sleep(1)
    except KeyboardInterrupt:
        print("# stopping", file=out, flush=True)


def stop_all(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGINT)
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()


def start_redis(out: TextIO) -> LocalRedis:
    """The cluster's Redis, with a generated password: it listens on loopback, which every
    local user reaches. `out` gets only the address."""
    server = LocalRedis(password=secrets.token_urlsafe(24))
    print(f"# redis on redis://127.0.0.1:{server.port}/0 (password set)", file=out, flush=True)
    return server


def redis_tier(server: LocalRedis, logs: str) -> dict[str, object]:
    """The instances' redis tier: the password in a file of the (private) logs directory,
    so that it is on no command line."""
    path = Path(logs) / "redis-password"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(server.password or "")
    return {
        "kind": "redis",
        "url": f"redis://127.0.0.1:{server.port}/0",
        "password_file": str(path),
    }


def run_cluster(args: argparse.Namespace, out: TextIO) -> int:
    procs: list[subprocess.Popen[bytes]] = []
    front: BackgroundRouter | None = None
    if args.log_level != "debug":  # the demo's lines, not the router's access log
        logging.getLogger("kvconnect.access").setLevel(logging.WARNING)
    local_redis: LocalRedis | None = None
    logs = tempfile.mkdtemp(prefix="kvconnect-cluster-")
    check_port_free("127.0.0.1", args.base_port, "--base-port (the router)")
    try:
        if args.redis:
            local_redis = start_redis(out)
        tier = redis_tier(local_redis, logs) if local_redis is not None else None
        instances = start_instances(args, tier, logs, procs)
        print(f"# {args.instances} instances of {args.model} starting; logs in {logs}", file=out)
        wait_instances(instances, procs, logs, out)
        router = Router(instances, BlockIndex(), load_tokenizer(args.model)).start()
        front = BackgroundRouter(router, args.base_port)
        wait_healthy(front.url, None, timeout=30)
        print(f"# router on {front.url} (metrics at {front.url}/metrics)", file=out, flush=True)
        if args.demo_rounds:
            demo(front.url, out, args.demo_rounds)
            print_router_metrics(front.url, out)
        if not args.exit_after_demo:
            serve_until_interrupted(out)
        return 0
    finally:
        if front is not None:  # the router first: no alarms
            front.stop()
        stop_all(procs)
        if local_redis is not None:
            local_redis.stop()

"""`kvconnect cluster`: N engine instances, a router in front, optionally a shared Redis, all on
loopback; shows progress while they start, sends a short demo workload through the router, then
serves until Ctrl-C and stops everything it started.

    instance i   http://127.0.0.1:(base_port + 1 + i)   events tcp://127.0.0.1:(event_port + 2i)
                 the model (SmolLM2 by default), OffloadConnector with a CPU tier (and the
                 Redis tier, if asked)
    router       http://127.0.0.1:base_port
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from typing import TextIO

from kvconnect.redis_server import LocalRedis
from kvconnect.router.index import BlockIndex
from kvconnect.router.server import Instance, Router, make_app
from kvconnect.tokenizer import load_tokenizer


def wait_healthy(url: str, proc: subprocess.Popen[bytes], timeout: float) -> None:
    """Return once `url`/health answers 200; `RuntimeError` if `proc` exits or time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url} exited with code {proc.returncode} while starting")
        try:
            with urllib.request.urlopen(url + "/health", timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"{url} did not become healthy within {timeout:.0f}s")


def instance_command(i: int, args: argparse.Namespace, redis_url: str | None) -> list[str]:
    tiers: list[dict[str, object]] = [{"kind": "cpu", "max_bytes": 256 << 20}]
    if redis_url:
        tiers.append({"kind": "redis", "url": redis_url})
    transfer = {
        "kv_connector": "OffloadConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"chunk_size": 64, "tiers": tiers},
    }
    ev_port = args.event_port + 2 * i
    events = {
        "enable_kv_cache_events": True,
        "endpoint": f"tcp://127.0.0.1:{ev_port}",
        "replay_endpoint": f"tcp://127.0.0.1:{ev_port + 1}",
        "bind": True,  # a loopback address is connected to by vLLM's rule; bind it here
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
        "--kv-events-config",
        json.dumps(events),
    ]


def demo(router_url: str, out: TextIO, rounds: int = 3) -> None:
    """Two tenants with their own long system prompts, a few user turns each."""
    rng = random.Random(0)
    tenants = {
        name: f"You are {name}'s assistant. " + "Policy text. " * 30 for name in ("acme", "globex")
    }
    for r in range(rounds):
        for name, system in tenants.items():
            prompt = system + f"Question {r}-{rng.randrange(1000)}?"
            body = json.dumps({"prompt": prompt, "max_tokens": 8}).encode()
            req = urllib.request.Request(
                router_url + "/v1/completions",
                data=body,
                headers={"Content-Type": "application/json"},
            )
            t0 = time.monotonic()
            with urllib.request.urlopen(req, timeout=60) as resp:
                answer = json.load(resp)
                where = resp.headers["x-kvconnect-instance"]
            kv = answer.get("kv_cache", {})
            print(
                f"  {name:7s} round {r}: -> {where}  {kv.get('num_cached_tokens', 0):4d} "
                f"cached + {kv.get('num_external_tokens', 0):4d} loaded of "
                f"{answer['usage']['prompt_tokens']} prompt tokens, "
                f"{(time.monotonic() - t0) * 1000:.0f} ms",
                file=out,
                flush=True,
            )


def run_cluster(args: argparse.Namespace, out: TextIO) -> int:
    from aiohttp import web

    procs: list[subprocess.Popen[bytes]] = []
    redis_url = None
    local_redis: LocalRedis | None = None
    try:
        if args.redis:
            local_redis = LocalRedis()
            redis_url = local_redis.url
            print(f"# redis on {redis_url}", file=out, flush=True)
        instances = []
        for i in range(args.instances):
            # Own sessions: a terminal's Ctrl-C reaches only this process, which then stops
            # each instance once.
            procs.append(
                subprocess.Popen(
                    instance_command(i, args, redis_url),
                    stdout=subprocess.DEVNULL,
                    start_new_session=True,
                )
            )
            port = args.event_port + 2 * i
            instances.append(
                Instance(
                    f"http://127.0.0.1:{args.base_port + 1 + i}",
                    f"tcp://127.0.0.1:{port}",
                    f"tcp://127.0.0.1:{port + 1}",
                )
            )
        start = time.monotonic()
        for n, (inst, proc) in enumerate(zip(instances, procs[-args.instances :], strict=True)):
            wait_healthy(inst.url, proc, timeout=120)
            print(
                f"[{n + 1}/{args.instances}] instance {inst.url} ready "
                f"({time.monotonic() - start:.1f}s), events {inst.events_endpoint}",
                file=out,
                flush=True,
            )
        router = Router(instances, BlockIndex(), load_tokenizer(args.model))
        router_url = f"http://127.0.0.1:{args.base_port}"
        runner = web.AppRunner(make_app(router))
        loop = asyncio.new_event_loop()
        loop.run_until_complete(runner.setup())
        loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", args.base_port).start())
        threading.Thread(target=loop.run_forever, daemon=True).start()
        print(f"# router on {router_url} (metrics at {router_url}/metrics)", file=out, flush=True)
        if args.demo_rounds:
            time.sleep(0.5)
            demo(router_url, out, args.demo_rounds)
            with urllib.request.urlopen(router_url + "/metrics") as r:
                wanted = ("decisions", "hit_blocks", "index_entries", "events_applied")
                for line in r.read().decode().splitlines():
                    if any(w in line for w in wanted):
                        print(f"  {line}", file=out)
        if not args.exit_after_demo:
            print("# serving; Ctrl-C stops the cluster", file=out, flush=True)
            signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt))
            try:
                while True:
                    time.sleep(1)
            except KeyboardInterrupt:
                print("# stopping", file=out, flush=True)
        return 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
        if local_redis is not None:
            local_redis.stop()

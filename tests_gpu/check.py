"""`make test-gpu`'s driver (tests_gpu/run.sh builds its environment and calls it): kvconnect's
OffloadConnector inside `vllm serve` (vLLM 0.33, CUDA) with a cpu and a disk tier.

    check.py serve MODEL --tp N --work DIR     one server, the checks below, one TTFT line
    check.py tp-model SMOLLM2_DIR OUT          a small random Llama whose 8 heads (4 KV)
                                               divide by 2, with SmolLM2's tokenizer

For an 8k-token prompt P1 (greedy, 16 tokens), in this order:
    1. recompute: P1 cold; its chunks reach the cpu tier, one BlockStored each (TP ranks
       report them once), and its tail (the blocks past them), no other
    2. vLLM prefix hit: P1 again (the reference answer)
    3. cpu tier: vLLM's prefix cache reset (its own only), P1 again -> from the cpu tier
    4. disk tier: P2 and P3 (other 8k prompts) push P1 out of the cpu tier (demoted to disk),
       vLLM's cache reset, P1 again -> from the disk tier
    5. peer pull: a second server B, P1 naming A as its `remote_kv_source` -> B pulls P1's
       chunks from A's tiers over the peer tier (the data port), into its GPU cache
Answers 3, 4 and 5 equal answer 2 token for token (the tiers give back vLLM's own KV bytes;
the suffix is computed as after a prefix hit). Where the KV came from is seen in the usage's
cached tokens (vLLM holds none after its reset) and in the tiers' events (which tier holds
P1's chunks; a disk hit is promoted to cpu). Exit 1 with the reason on the first failure.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import zmq

from kvconnect.events import BlockRemoved, BlockStored, decode_batch

PROMPT_TOKENS = int(os.environ.get("KVCONNECT_GPU_PROMPT_TOKENS", "8000"))
"""8k; a rehearsal on vLLM for CPU takes a shorter one."""
BLOCK = int(os.environ.get("KVCONNECT_GPU_BLOCK_SIZE", "16"))
"""vLLM's GPU default; vLLM on CPU takes multiples of 32."""
CHUNK, OUTPUT_TOKENS = 256, 16
START_TIMEOUT, WAIT_TIMEOUT = 300.0, 120.0


def fail(why: str) -> None:
    print(f"test-gpu: FAILED: {why}", flush=True)
    sys.exit(1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def kv_bytes_per_chunk(model: Path, tp: int) -> int:
    cfg = json.loads((model / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kv_heads = cfg["num_key_value_heads"] // tp
    return int(cfg["num_hidden_layers"] * 2 * CHUNK * kv_heads * head_dim * 2)  # bf16


class Events:
    """kvconnect's tier events from vLLM's KV event stream (medium CPU or STORAGE), on a
    thread; `held` follows stored minus removed per (medium, last block hash)."""

    def __init__(self, endpoint: str) -> None:
        self.sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.setsockopt(zmq.RCVTIMEO, 200)
        self.sock.connect(endpoint)
        self.stored: dict[str, list[Any]] = {"CPU": [], "STORAGE": []}
        self.duplicates: list[str] = []
        self.held: set[tuple[str, Any]] = set()
        self.lock = threading.Lock()
        self.stop = False
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop:
            try:
                frames = self.sock.recv_multipart()
            except zmq.Again:
                continue
            for ev in decode_batch(frames[-1]).events:
                self._take(ev)

    def _take(self, ev: Any) -> None:
        medium = getattr(ev, "medium", None)
        if medium not in self.stored:
            return  # vLLM's own GPU blocks
        key = (medium, ev.block_hashes[-1])
        with self.lock:
            if isinstance(ev, BlockStored):
                if key in self.held:
                    self.duplicates.append(f"{medium} chunk {ev.block_hashes[-1]!r} stored twice")
                self.held.add(key)
                self.stored[medium].append(ev)
            elif isinstance(ev, BlockRemoved):
                self.held.discard(key)

    def count(self, medium: str) -> int:
        with self.lock:
            return len(self.stored[medium])

    def wait_until(self, condition: Any, what: str) -> None:
        deadline = time.monotonic() + WAIT_TIMEOUT
        while True:
            with self.lock:
                if condition(self.held):
                    return
            if time.monotonic() > deadline:
                fail(f"no events showing {what}")
            time.sleep(0.1)

    def wait_for(self, medium: str, n: int) -> None:
        deadline = time.monotonic() + WAIT_TIMEOUT
        while self.count(medium) < n:
            if time.monotonic() > deadline:
                fail(f"{self.count(medium)} {medium} chunk events, expected {n}")
            time.sleep(0.1)


class Server:
    def __init__(
        self, model: Path, tp: int, work: Path, name: str = "a", sources: tuple[int, ...] = ()
    ) -> None:
        """`sources`: the peer ports of the servers this one may pull from."""
        self.model, self.tp, self.work, self.sources = model, tp, work / name, sources
        self.work.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.peer_port = free_port()  # rank r serves on peer_port + r
        self.events = f"ipc://{self.work}/events"  # vLLM binds ipc ones (a tcp host: connects)
        self.log = work / f"vllm-tp{tp}-{name}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        per_chunk = kv_bytes_per_chunk(self.model, self.tp)
        n = PROMPT_TOKENS // CHUNK
        tiers = [  # the cpu tier holds 1.5 prompts: two more push the first one to disk
            {"kind": "cpu", "max_bytes": per_chunk * n * 3 // 2},
            {"kind": "disk", "path": str(self.work / "disk"), "max_bytes": per_chunk * n * 8},
        ]
        transfer = {
            "kv_connector": "OffloadConnector",
            "kv_connector_module_path": "kvconnect.vllm",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {
                "chunk_size": CHUNK,
                "tiers": tiers,
                "peer": {
                    "port": self.peer_port,
                    "timeout_s": 30,
                    "sources": [f"127.0.0.1:{p}" for p in self.sources],
                },
            },
        }
        events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": self.events}
        cmd = [
            str(Path(sys.executable).with_name("vllm")), "serve", str(self.model),
            "--host", "127.0.0.1", "--port", str(self.port), "--served-model-name", "m",
            "--tensor-parallel-size", str(self.tp), "--max-model-len", "8192",
            "--block-size", str(BLOCK), "--enable-prefix-caching", "--enforce-eager",
            "--gpu-memory-utilization", "0.35", "--dtype", "bfloat16",
            "--enable-prompt-tokens-details",
            "--kv-transfer-config", json.dumps(transfer),
            "--kv-events-config", json.dumps(events),
        ]  # fmt: skip
        env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1"}  # for /reset_prefix_cache
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        deadline = time.monotonic() + START_TIMEOUT
        while not self._healthy():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                fail(f"vllm serve (TP={self.tp}) did not start:\n{self.log.read_text()[-3000:]}")
            time.sleep(1)

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                return bool(r.status == 200)
        except OSError:
            return False

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)

    def post(self, path: str, body: dict[str, Any] | None = None) -> Any:
        data = json.dumps(body or {}).encode()
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.port}{path}",
            data=data,
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=WAIT_TIMEOUT) as resp:
            return json.load(resp)

    def complete(
        self, prompt: list[int], source: Server | None = None
    ) -> tuple[list[int], float, int]:
        """(the greedy answer's token ids, TTFT in ms, prompt tokens vLLM did not compute) of
        a streamed completion; with `source`, pulling what it holds of `prompt`."""
        body: dict[str, Any] = {
            "model": "m", "prompt": prompt, "max_tokens": OUTPUT_TOKENS, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "return_token_ids": True,
            "stream_options": {"include_usage": True},
        }  # fmt: skip
        if source is not None:
            peer = {"host": "127.0.0.1", "port": source.peer_port}
            body["kv_transfer_params"] = {"remote_kv_source": peer}
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        start, first, cached = time.monotonic(), None, -1
        tokens: list[int] = []
        with urllib.request.urlopen(req, timeout=WAIT_TIMEOUT) as resp:
            for raw in resp:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                for choice in chunk.get("choices") or []:
                    ids = choice.get("token_ids") or []
                    if ids and first is None:
                        first = time.monotonic()
                    tokens += ids
                details = (chunk.get("usage") or {}).get("prompt_tokens_details") or {}
                cached = details.get("cached_tokens", cached)
        if first is None or len(tokens) != OUTPUT_TOKENS or cached < 0:
            fail(
                f"a completion returned {len(tokens)} tokens (not {OUTPUT_TOKENS}), cached {cached}"
            )
        return tokens, (first - start) * 1000, cached  # type: ignore[operator]

    def reset_prefix_cache(self) -> None:
        """vLLM's own prefix cache only (reset_external false: the tiers keep theirs);
        refused while transfers hold blocks, so tried again."""
        deadline = time.monotonic() + WAIT_TIMEOUT
        while not self.post("/reset_prefix_cache").get("success"):
            if time.monotonic() > deadline:
                fail("vLLM did not reset its prefix cache")
            time.sleep(0.2)


def prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(1000, 40000) for _ in range(PROMPT_TOKENS)] for _ in range(3)]


def from_tier(server: Server, prompt: list[int], tier: str) -> tuple[list[int], float]:
    """vLLM's own prefix cache reset, `prompt` again: its chunks must come from the
    connector (vLLM holds none of them now)."""
    server.reset_prefix_cache()
    answer, ttft, cached = server.complete(prompt)
    loadable = (PROMPT_TOKENS - 1) // CHUNK * CHUNK  # whole chunks; vLLM computes the last token
    if cached < loadable:
        fail(f"after the reset {cached} prompt tokens came back from {tier}, not {loadable}")
    return answer, ttft


def entries() -> int:
    """What a finished P1 leaves in the cpu tier: its whole chunks, and a tail (the blocks
    its prompt and answer fill past them, a chunk of fewer blocks) where there are any."""
    full = (PROMPT_TOKENS + OUTPUT_TOKENS - 1) // BLOCK * BLOCK  # the last token has no KV
    return full // CHUNK + (1 if full % CHUNK else 0)


def pulled(server: Server, puller: Server, prompt: list[int]) -> tuple[list[int], float]:
    """`prompt` on `puller`, which holds none of it, pulling it from `server`'s tiers."""
    answer, ttft, cached = puller.complete(prompt, source=server)
    loadable = (PROMPT_TOKENS - 1) // CHUNK * CHUNK
    if cached < loadable:
        fail(f"the peer pull brought {cached} prompt tokens, not {loadable}")
    return answer, ttft


def run_checks(server: Server, name: str, puller: Server) -> str:
    p1, p2, p3 = prompts()
    n = entries()
    events = Events(server.events)
    time.sleep(1)  # the subscription reaches the publisher before the first event
    recompute, t_recompute, _ = server.complete(p1)
    events.wait_for("CPU", n)
    reference, t_prefix, _ = server.complete(p1)
    with events.lock:
        p1_keys = {ev.block_hashes[-1] for ev in events.stored["CPU"]}
    if events.count("CPU") != n or len(p1_keys) != n:
        fail(f"P1's {n} entries were announced {events.count('CPU')} times in the cpu tier")
    answers, ttft = {}, {}
    answers["cpu"], ttft["cpu"] = from_tier(server, p1, "cpu")  # the cpu tier holds them all
    for other in (p2, p3):
        server.complete(other)
    events.wait_until(lambda held: all(("STORAGE", k) in held for k in p1_keys), "P1 on disk")
    with events.lock:
        if any(("CPU", k) in events.held for k in p1_keys):
            fail("P1's chunks are still in the cpu tier after two other prompts")
    answers["disk"], ttft["disk"] = from_tier(server, p1, "disk")
    events.wait_until(lambda held: all(("CPU", k) in held for k in p1_keys), "P1 promoted")
    puller.start()
    answers["peer"], ttft["peer"] = pulled(server, puller, p1)
    for tier, answer in answers.items():
        if answer != reference:
            fail(f"{tier} tier answer {answer} != vLLM prefix hit answer {reference}")
    if events.duplicates:
        fail("; ".join(events.duplicates[:5]))
    events.stop = True
    same = "equal" if recompute == reference else "differs (numerics of a prefix hit)"
    return (
        f"gpu {name}: {PROMPT_TOKENS}-token prompt TTFT: recompute {t_recompute:.0f} ms, "
        f"vLLM prefix hit {t_prefix:.0f} ms, cpu tier {ttft['cpu']:.0f} ms, disk tier "
        f"{ttft['disk']:.0f} ms, pulled from a peer {ttft['peer']:.0f} ms; cpu/prefix hit "
        f"{ttft['cpu'] / t_prefix:.2f}; answers after cpu, disk and peer loads equal the prefix "
        f"hit's; recompute's {same}; {n} cpu-tier entries announced once each"
    )


def serve(args: argparse.Namespace) -> None:
    work = Path(tempfile.mkdtemp(prefix=f"kvc-gpu-tp{args.tp}-", dir=args.work))
    server = Server(Path(args.model), args.tp, work)
    puller = Server(Path(args.model), args.tp, work, "b", (server.peer_port,))
    try:
        server.start()
        print(run_checks(server, f"{args.name} TP={args.tp}", puller), flush=True)
    finally:
        for s in (puller, server):
            s.stop()
            if s.log.exists():
                shutil.copy(s.log, work.parent / s.log.name)  # kept for a post-mortem
    shutil.rmtree(work, ignore_errors=True)


def tp_model(args: argparse.Namespace) -> None:
    """A random (seeded) Llama that TP=2 can split: 8 heads, 4 KV heads of 64, 4 layers."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    source, out = Path(args.smollm2), Path(args.out)
    base = json.loads((source / "config.json").read_text())
    config = LlamaConfig(
        vocab_size=base["vocab_size"], hidden_size=512, intermediate_size=1024,
        num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
        max_position_embeddings=8192, bos_token_id=base.get("bos_token_id"),
        eos_token_id=base.get("eos_token_id"), tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(dtype=torch.bfloat16)  # type: ignore[call-arg]
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    for f in source.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, out / f.name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve")
    s.add_argument("model")
    s.add_argument("--tp", type=int, default=1)
    s.add_argument("--name", default="model")
    s.add_argument("--work", default=None)
    t = sub.add_parser("tp-model")
    t.add_argument("smollm2")
    t.add_argument("out")
    args = parser.parse_args()
    serve(args) if args.cmd == "serve" else tp_model(args)


if __name__ == "__main__":
    main()

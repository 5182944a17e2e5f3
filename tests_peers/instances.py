"""kvconnect's side of the peer suite.

Instance   one `kvconnect serve --model tiny` process; `complete(tokens)`
Engine     a kvconnect engine in this process (`LLM`), whose prefix cache a test can
           reset: `generate(tokens)`, `reset()` (serve has no HTTP reset)
Streams    this process's own SUB on every kvconnect stream, so that a test waits for the
           exact event it caused (`stored`, `event`, `held`, `last_seq`, `num_events`)
           before it asks a peer about it
"""

from __future__ import annotations

import json
import re
import sys
import threading
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import zmq

from kvconnect.engine.llm import LLM
from kvconnect.engine.request import SamplingParams
from tests_peers.support import (
    BLOCK_SIZE,
    MODEL,
    WAIT,
    Proc,
    completion,
    free_port,
    http,
    wait_for,
    wait_http,
)


@dataclass
class Instance:
    """`kvconnect serve --model tiny` on HTTP port `port`, events on port+10000, replay on
    port+20000 (kvconnect's rule for derived addresses), `num_kv_blocks` GPU blocks (few, so
    that a handful of prompts evicts everything), and the offload `tiers`, if any."""

    name: str
    workdir: Path
    tiers: list[dict[str, Any]] = field(default_factory=list)
    num_kv_blocks: int = 16
    port: int = field(default_factory=lambda: free_port((0, 10000, 20000)))
    proc: Proc | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def events(self) -> str:
        return f"tcp://127.0.0.1:{self.port + 10000}"

    @property
    def replay(self) -> str:
        return f"tcp://127.0.0.1:{self.port + 20000}"

    def start(self) -> None:
        cmd = [
            sys.executable,
            "-m",
            "kvconnect.cli",
            "serve",
            "--model",
            MODEL,
            "--port",
            str(self.port),
            "--block-size",
            str(BLOCK_SIZE),
            "--num-kv-blocks",
            str(self.num_kv_blocks),
            "--kv-events-config",
            json.dumps({"enable_kv_cache_events": True}),
            "--enable-prompt-tokens-details",  # the tests read cached_tokens
        ]
        if self.tiers:
            transfer = {
                "kv_connector": "OffloadConnector",
                "kv_role": "kv_both",
                "kv_connector_extra_config": {"chunk_size": 64, "tiers": self.tiers},
            }
            cmd += ["--kv-transfer-config", json.dumps(transfer)]
        self.proc = Proc.start(cmd, self.workdir / f"serve-{self.name}.log")

    def wait(self) -> None:
        assert self.proc is not None
        wait_http(self.url + "/health", self.proc, f"kvconnect serve {self.name}")

    def complete(self, tokens: list[int]) -> dict[str, Any]:
        """Serve `tokens` (one token out); the response's usage."""
        status, body = http(self.url + "/v1/completions", completion(tokens))
        assert status == 200, body
        usage: dict[str, Any] = body["usage"]
        return usage

    def num_subscriptions(self) -> int:
        _, text = http(self.url + "/metrics")
        found = re.search(r"^kvconnect_kv_event_subscriptions\{[^}]*\} (\S+)$", text, re.M)
        return int(float(found.group(1))) if found else 0

    def wait_for_subscribers(self, num: int) -> None:
        wait_for(
            f"{num} subscribers of {self.name}'s events",
            lambda: True if self.num_subscriptions() >= num else None,
        )

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()


class Engine:
    """A kvconnect engine (`LLM`, tiny model) in this process, events on loopback TCP. It
    stands in for an instance where a test must reset the prefix cache (AllBlocksCleared):
    `kvconnect serve` has no HTTP endpoint for that."""

    name = "engine"

    def __init__(self) -> None:
        port = free_port((0, 1))
        self.events = f"tcp://127.0.0.1:{port}"
        self.replay = f"tcp://127.0.0.1:{port + 1}"
        # A tcp address without `*` is connected to, as in vLLM, unless `bind` says otherwise.
        config = {"enable_kv_cache_events": True, "endpoint": self.events, "bind": True}
        self.llm = LLM(
            model=MODEL,
            block_size=BLOCK_SIZE,
            num_kv_blocks=64,
            kv_events_config={**config, "replay_endpoint": self.replay},
        )

    def generate(self, tokens: list[int]) -> None:
        self.llm.generate([tokens], SamplingParams(max_tokens=1))

    def reset(self) -> None:
        assert self.llm.reset_prefix_cache(), "blocks in use"

    def wait_for_subscribers(self, num: int) -> None:
        publisher: Any = self.llm.publisher
        assert publisher.wait_for_subscriber(WAIT, num), "peers did not subscribe"

    def stop(self) -> None:
        self.llm.shutdown()


@dataclass
class Stored:
    """One BlockStored event as it was on the wire, with the seq of its batch."""

    seq: int
    event: dict[str, Any]

    @property
    def hashes(self) -> list[int]:
        return list(self.event["block_hashes"])

    @property
    def parent(self) -> int | None:
        return self.event.get("parent_block_hash")


class Streams:
    """A SUB socket on each kvconnect stream, read by one thread from session start on. Keeps
    every batch as decoded from the wire (msgpack, vLLM's map form), unchanged."""

    def __init__(self, sources: dict[str, str]) -> None:
        self._ctx = zmq.Context()
        self._sockets: dict[zmq.Socket[bytes], str] = {}
        for name, endpoint in sources.items():
            sock = self._ctx.socket(zmq.SUB)
            sock.setsockopt(zmq.SUBSCRIBE, b"")
            sock.connect(endpoint)
            self._sockets[sock] = name
        self.batches: dict[str, list[tuple[int, list[dict[str, Any]]]]] = {
            name: [] for name in sources
        }
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="streams", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        for sock in self._sockets:
            poller.register(sock, zmq.POLLIN)
        while not self._stop.is_set():
            for sock, _ in poller.poll(100):
                _topic, seq, payload = sock.recv_multipart()
                _ts, events, *_ = msgspec.msgpack.decode(payload)
                with self._lock:
                    self.batches[self._sockets[sock]].append(
                        (int.from_bytes(seq, "big"), list(events))
                    )

    def _batches(self, name: str) -> list[tuple[int, list[dict[str, Any]]]]:
        with self._lock:
            return list(self.batches[name])

    def last_seq(self, name: str) -> int:
        batches = self._batches(name)
        return batches[-1][0] if batches else -1

    def find_stored(
        self, name: str, token_ids: list[int], medium: str | None, after: int = -1
    ) -> Stored | None:
        """The first BlockStored after seq `after` carrying exactly `token_ids`, in `medium`
        (None: any tier but GPU)."""
        for seq, events in self._batches(name):
            for event in events:
                if (
                    seq > after
                    and event["type"] == "BlockStored"
                    and event["token_ids"] == token_ids
                    and (event["medium"] == medium if medium else event["medium"] != "GPU")
                ):
                    return Stored(seq, event)
        return None

    def event(self, name: str, kind: str, after: int = -1) -> int:
        """The seq of the first batch after `after` with an event of type `kind`."""

        def find() -> int | None:
            for seq, events in self._batches(name):
                if seq > after and any(e["type"] == kind for e in events):
                    return seq
            return None

        return wait_for(f"{name}: {kind} after seq {after}", find)

    def stored(
        self, name: str, token_ids: list[int], medium: str | None = "GPU", after: int = -1
    ) -> Stored:
        where = medium or "a tier"
        return wait_for(
            f"{name}: BlockStored of {len(token_ids)} tokens in {where}",
            lambda: self.find_stored(name, token_ids, medium, after),
        )

    def num_events(self) -> dict[str, int]:
        """GPU stores, GPU removals and clears so far, on all streams together."""
        counts = dict.fromkeys(("stored", "removed", "cleared"), 0)
        for name in self.batches:
            for _, events in self._batches(name):
                for event in events:
                    if event["type"] == "AllBlocksCleared":
                        counts["cleared"] += 1
                    elif event["medium"] == "GPU":
                        counts[event["type"].removeprefix("Block").lower()] += 1
        return counts

    def held(self, name: str, medium: str) -> Counter[int]:
        """Block hashes in `medium` as the stream tells so far (a count per hash: an engine
        may hold two blocks with one hash, as vLLM's can)."""
        held: Counter[int] = Counter()
        for _, events in self._batches(name):
            for event in events:
                if event["type"] == "AllBlocksCleared":
                    held.clear()
                elif event.get("medium") == medium:
                    for h in event["block_hashes"]:
                        held[h] += 1 if event["type"] == "BlockStored" else -1
        return +held

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        for sock in self._sockets:
            sock.close(linger=0)
        self._ctx.term()

"""`kvconnect events tail` and `kvconnect events demo`: a KV event stream, readable.

`tail` prints every batch of a stream (vLLM's or kvconnect's) as it arrives, with gap repair
through replay; a stream with CURVE on is read with the key files named by
KVCONNECT_EVENTS_CURVE_SERVER_KEY and KVCONNECT_EVENTS_CURVE_CLIENT_KEY (stream/curve.py says
how to make them). `demo` runs a real publisher on loopback fed with the block events of a few
prompts that share a prefix, and tails it, so the stream can be seen without an engine.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import threading
import time
from collections.abc import Mapping
from typing import Any, TextIO

import msgspec

from kvconnect.events import (
    MEDIUM_CPU,
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    ExternalBlockHash,
    KVEvent,
    KVEventBatch,
)
from kvconnect.hashing import block_hashes, to_wire
from kvconnect.stream.curve import CurveClientKeys
from kvconnect.stream.publisher import ZmqEventPublisher
from kvconnect.stream.subscriber import (
    KVEventSubscriber,
    PublisherRestarted,
    ReceivedBatch,
    StreamSnapshot,
    SubscriberItem,
)


def _short(h: int | bytes | None) -> str:
    if h is None:
        return "-"
    return f"{h:016x}" if isinstance(h, int) else h.hex()[:16]


def format_event(event: KVEvent) -> str:
    """One readable line for an event."""
    if isinstance(event, BlockStored):
        hashes = ",".join(_short(h) for h in event.block_hashes)
        return (
            f"BlockStored  medium={event.medium} blocks={len(event.block_hashes)} "
            f"parent={_short(event.parent_block_hash)} tokens={len(event.token_ids)} "
            f"block_size={event.block_size} hashes=[{hashes}]"
        )
    if isinstance(event, BlockRemoved):
        hashes = ",".join(_short(h) for h in event.block_hashes)
        return f"BlockRemoved medium={event.medium} blocks={len(event.block_hashes)} [{hashes}]"
    return "AllBlocksCleared"


def _marker(kind: str, item: SubscriberItem, **fields: Any) -> str:
    """A JSON line for a stream marker: `{kind: {"endpoint": ..., **fields}}`."""
    return json.dumps({kind: {"endpoint": item.stream.endpoint, **fields}})


def format_item(item: SubscriberItem, as_json: bool) -> str:
    if isinstance(item, ReceivedBatch):
        batch = item.batch
        if as_json:
            return json.dumps(
                {
                    "seq": item.seq,
                    "topic": item.stream.topic,
                    "data_parallel_rank": batch.data_parallel_rank,
                    "ts": batch.ts,
                    "events": msgspec.to_builtins(batch.events),
                }
            )
        head = (
            f"seq={item.seq} rank={batch.data_parallel_rank} ts={batch.ts:.6f} "
            f"events={len(batch.events)}"
        )
        return "\n".join([head, *(f"  {format_event(e)}" for e in batch.events)])
    if isinstance(item, StreamSnapshot):
        events = item.batch.events
        if as_json:
            return _marker("snapshot", item, seq=item.seq, events=msgspec.to_builtins(events))
        head = f"snapshot as of seq={item.seq} from {item.stream.endpoint}: {len(events)} events"
        return "\n".join([head, *(f"  {format_event(e)}" for e in events)])
    if isinstance(item, PublisherRestarted):
        if as_json:
            return _marker(
                "publisher_restarted", item, last_seq=item.last_seq, first_seq=item.first_seq
            )
        return (
            f"! publisher {item.stream.endpoint} restarted (last seq {item.last_seq}, "
            f"now {item.first_seq})"
        )
    if as_json:
        return _marker("events_lost", item, first_seq=item.first_seq, last_seq=item.last_seq)
    return f"! lost batches {item.first_seq}..{item.last_seq} from {item.stream.endpoint}"


def tail(
    subscriber: KVEventSubscriber, out: TextIO, as_json: bool, max_batches: int | None = None
) -> int:
    """Print items until interrupted (or `max_batches` batches); returns the batch count."""
    count = 0
    try:
        for item in subscriber:
            print(format_item(item, as_json), file=out, flush=True)
            if isinstance(item, ReceivedBatch):
                count += 1
                if max_batches is not None and count >= max_batches:
                    break
    except KeyboardInterrupt:
        pass
    finally:
        subscriber.close()
    return count


def demo_batches(num_batches: int, block_size: int = 16, seed: int = 0) -> list[KVEventBatch]:
    """Block events of prompts that share a system prompt, as an engine with a CPU tier
    would publish them: GPU stores, CPU copies, GPU evictions, then a cache reset."""
    rng = random.Random(seed)
    system = [rng.randrange(32_000) for _ in range(4 * block_size)]
    batches: list[KVEventBatch] = []
    stored: list[ExternalBlockHash] = []
    for i in range(num_batches - 1):
        prompt = system + [rng.randrange(32_000) for _ in range(2 * block_size)]
        wire: list[ExternalBlockHash] = [to_wire(h) for h in block_hashes(prompt, block_size)]
        events: list[KVEvent] = []
        new = wire if i == 0 else wire[4:]  # the system prompt's blocks are cached after #0
        parent = None if i == 0 else wire[3]
        tokens = prompt if i == 0 else prompt[4 * block_size :]
        events.append(BlockStored(new, parent, tokens, block_size, None, MEDIUM_GPU, None))
        events.append(BlockStored(new, parent, tokens, block_size, None, MEDIUM_CPU, None))
        if stored and i % 3 == 2:
            events.append(BlockRemoved(stored[:2], MEDIUM_GPU))
        stored = new
        batches.append(KVEventBatch(time.time(), events))
    batches.append(KVEventBatch(time.time(), [AllBlocksCleared()]))
    return batches


def run_demo(port: int, num_batches: int, out: TextIO) -> int:
    endpoint, replay = f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{port + 1}"
    publisher = ZmqEventPublisher.open(
        endpoint=endpoint, replay_endpoint=replay, topic="kvconnect", bind=True
    )
    subscriber = KVEventSubscriber(endpoint, replay, topic="kvconnect", start_seq=0)
    print(
        f"# demo publisher on {endpoint} (replay {replay}); tailing {num_batches} batches",
        file=out,
        flush=True,
    )

    def feed() -> None:
        for batch in demo_batches(num_batches):
            batch.ts = time.time()
            publisher.publish(batch)
            time.sleep(0.05)

    feeder = threading.Thread(target=feed, daemon=True)
    feeder.start()
    try:
        return tail(subscriber, out, as_json=False, max_batches=num_batches)
    finally:
        feeder.join(timeout=5)
        publisher.shutdown()


CURVE_SERVER_KEY_ENV = "KVCONNECT_EVENTS_CURVE_SERVER_KEY"
"""`tail`, `router`: the publishers' public key file (`server.key`), for streams with CURVE on."""
CURVE_CLIENT_KEY_ENV = "KVCONNECT_EVENTS_CURVE_CLIENT_KEY"
"""`tail`, `router`: this client's secret key file (`client.key_secret`), with the one above."""


def curve_from_env(env: Mapping[str, str]) -> CurveClientKeys | None:
    """The CURVE keys `tail` and `router` read locked-down streams with: both variables or
    neither."""
    server, client = env.get(CURVE_SERVER_KEY_ENV), env.get(CURVE_CLIENT_KEY_ENV)
    if not server and not client:
        return None
    if not server or not client:
        raise ValueError(f"set both {CURVE_SERVER_KEY_ENV} and {CURVE_CLIENT_KEY_ENV}, or neither")
    return CurveClientKeys.from_files(server, client)


def run_events(args: argparse.Namespace, out: TextIO) -> int:
    """`kvconnect events tail|demo`."""
    if args.action == "demo":
        return run_demo(args.port, args.batches, out)
    replay: Any = args.replay
    if replay is not None and len(replay) == 1 and len(args.endpoint) == 1:
        replay = replay[0]
    subscriber = KVEventSubscriber(
        args.endpoint,
        replay,
        topic=args.topic,
        bind=args.bind,
        start_seq=args.from_seq,
        snapshots=args.snapshot,
        curve=curve_from_env(os.environ),
    )
    tail(subscriber, out, args.json)
    return 0

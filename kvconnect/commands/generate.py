"""`kvconnect generate`: run the engine on prompts and summarise the KV events it published.

When events are on and the endpoint is one this process can read (loopback or ipc), the
command subscribes to its own stream, so the summary counts what a router would have seen.
"""

from __future__ import annotations

import argparse
import time
from collections import Counter
from typing import TextIO

from kvconnect.config import KVEventsConfig
from kvconnect.engine.llm import LLM, as_config
from kvconnect.engine.request import SamplingParams
from kvconnect.events import BlockRemoved, BlockStored
from kvconnect.stream.publisher import ZmqEventPublisher
from kvconnect.stream.subscriber import KVEventSubscriber, ReceivedBatch


def summarize(subscriber: KVEventSubscriber) -> str:
    """One line: batches, and events by type and medium, read until the stream is quiet."""
    batches, lost = 0, 0
    kinds: Counter[str] = Counter()
    blocks: Counter[str] = Counter()
    while (item := subscriber.recv(timeout=0.5)) is not None:
        if not isinstance(item, ReceivedBatch):
            lost += 1
            continue
        batches += 1
        for ev in item.batch.events:
            name = type(ev).__name__
            if isinstance(ev, BlockStored | BlockRemoved):
                name = f"{name}({ev.medium})"
                blocks[name] += len(ev.block_hashes)
            kinds[name] += 1
    parts = [
        f"{n} {k}" + (f" [{blocks[k]} blocks]" if k in blocks else "")
        for k, n in sorted(kinds.items())
    ]
    extra = f"; {lost} gap/restart markers" if lost else ""
    return f"published {batches} batches: {', '.join(parts) or 'no events'}{extra}"


def run_generate(args: argparse.Namespace, out: TextIO) -> int:
    events = as_config(KVEventsConfig, args.kv_events_config)
    subscriber = None
    if events is not None and events.enable_kv_cache_events and events.binds_endpoint:
        subscriber = KVEventSubscriber(
            events.endpoint.replace("*", "127.0.0.1"),
            events.replay_endpoint and events.replay_endpoint.replace("*", "127.0.0.1"),
            topic=events.topic,
            start_seq=0,
        )
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed
    )
    start = time.monotonic()
    with LLM(
        args.model,
        tensor_parallel_size=args.tp,
        distributed_executor_backend=args.distributed_executor_backend,
        block_size=args.block_size,
        enable_prefix_caching=not args.no_prefix_caching,
        kv_transfer_config=args.kv_transfer_config,
        kv_events_config=events,
    ) as llm:
        print(
            f"# {args.model} at TP={args.tp}: ready in {time.monotonic() - start:.1f}s",
            file=out,
            flush=True,
        )
        # The summary's subscriber connected before the engine bound the endpoint: what is
        # published before its subscription reaches the socket would go to no one.
        publisher = llm.publisher
        if isinstance(publisher, ZmqEventPublisher) and not publisher.wait_for_subscriber(10):
            print("# the summary's subscriber did not connect in 10 s", file=out)
        for run in range(args.repeat):
            t0 = time.monotonic()
            outputs = llm.generate(args.prompt, params)
            took = time.monotonic() - t0
            for i, o in enumerate(outputs):
                print(
                    f"[run {run} prompt {i}] {len(o.prompt_token_ids)} prompt tokens, "
                    f"{o.num_cached_tokens} from the prefix cache, {o.num_external_tokens} "
                    f"loaded by a connector -> tokens {o.outputs[0].token_ids[:8]}... "
                    f"text {o.outputs[0].text[:24]!r}",
                    file=out,
                )
            print(f"# run {run}: {took * 1000:.0f} ms", file=out, flush=True)
        if subscriber is not None:
            print(
                f"# events on {events.endpoint}: {summarize(subscriber)}",  # type: ignore[union-attr]
                file=out,
            )
            subscriber.close()
    return 0

"""`kvconnect serve`: flags checked before anything loads, then the engine, then the API."""

from __future__ import annotations

import argparse

from kvconnect.commands.startup import (
    check_events_ports,
    check_port_free,
    events_config,
    transfer_config,
)
from kvconnect.engine.llm import LLM
from kvconnect.serve.server import serve


def run_serve(args: argparse.Namespace) -> int:
    """`kvconnect serve`: configs and ports checked, then the model loaded, then served."""
    events = events_config(args.kv_events_config, args.port)
    transfer = transfer_config(args.kv_transfer_config)
    check_port_free(args.host, args.port, "--port")
    check_events_ports(events)
    llm = LLM(
        args.model,
        tensor_parallel_size=args.tp,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        max_model_len=args.max_model_len,
        hash_seed=args.hash_seed,
        kv_transfer_config=transfer,
        kv_events_config=events,
    )
    ready = ""
    if events is not None and events.enable_kv_cache_events:
        pub = llm.publisher
        ready = f"; KV events {pub.endpoint}, replay {pub.replay_endpoint}"
    try:
        return serve(llm, args.host, args.port, args.served_model_name or args.model, ready)
    finally:
        llm.shutdown()

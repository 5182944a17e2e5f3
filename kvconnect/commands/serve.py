"""`kvconnect serve`: flags checked before anything loads, then the engine, then the API."""

from __future__ import annotations

import argparse

from kvconnect.commands.startup import (
    check_events_ports,
    check_port_free,
    events_config,
    peer_config,
    transfer_config,
)
from kvconnect.connector.offload.common import PeerConfig
from kvconnect.engine.llm import LLM
from kvconnect.http.auth import admin_token_from, api_keys_from
from kvconnect.http.limits import ConnectionLimits
from kvconnect.serve.server import ServeOptions, serve


def serve_options(args: argparse.Namespace, peer: PeerConfig | None = None) -> ServeOptions:
    """The API's options from the flags (and the keys from the environment)."""
    return ServeOptions(
        max_num_waiting=args.max_num_waiting,
        max_num_waiting_tokens=args.max_num_waiting_tokens,
        request_timeout=args.request_timeout,
        enable_prompt_tokens_details=args.enable_prompt_tokens_details,
        api_key=api_keys_from(args.api_key, vllm_env=True),
        admin_token=admin_token_from(args.admin_token),
        limits=ConnectionLimits(args.max_connections, args.header_timeout, args.body_timeout),
        peer_sources=peer.source_addrs if peer is not None else frozenset(),
        peer_pd=peer is not None and peer.pd,
    )


def run_serve(args: argparse.Namespace) -> int:
    """`kvconnect serve`: configs and ports checked, then the model loaded, then served."""
    events = events_config(args.kv_events_config, args.port)
    transfer = transfer_config(args.kv_transfer_config)
    options = serve_options(args, peer_config(transfer, args.block_size))
    check_port_free(args.host, args.port, "--port")
    check_events_ports(events)
    llm = LLM(
        args.model,
        tensor_parallel_size=args.tp,
        distributed_executor_backend=args.distributed_executor_backend,
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
        name = args.served_model_name or args.model
        return serve(llm, args.host, args.port, name, ready, options)
    finally:
        llm.shutdown()

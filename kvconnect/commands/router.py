"""`kvconnect router`: flags checked, tokenizer loaded, the streams followed, then serving."""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
from collections.abc import Coroutine
from typing import Any

from kvconnect.commands.events import curve_from_env
from kvconnect.commands.startup import check_port_free
from kvconnect.events import tier_of
from kvconnect.http.auth import admin_token_from, api_keys_from, instance_api_key_from
from kvconnect.http.limits import ConnectionLimits
from kvconnect.model.tokenizer import load_tokenizer
from kvconnect.router.core import Router
from kvconnect.router.discovery import discover, parse_instance
from kvconnect.router.index import DEFAULT_TIER_WEIGHTS, BlockIndex
from kvconnect.router.replicas import ReplicaLoads, replica_url
from kvconnect.router.server import RouterOptions, serve_router
from kvconnect.router.tracing import RouterTracing


def parse_tier_weights(text: str) -> dict[str, float]:
    """`--tier-weights TIER=WEIGHT,...` over the defaults. A tier is a medium, optionally
    with its locality (`GPU`, `CPU`, `STORAGE/LOCAL`, `STORAGE/REMOTE`, `STORAGE`); the older
    `DISK` and `EXTERNAL` name the STORAGE ones."""
    weights = dict(DEFAULT_TIER_WEIGHTS)
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = part.partition("=")
        medium, _, locality = name.strip().upper().partition("/")
        try:
            weight = float(value)
        except ValueError:
            weight = -1.0
        if not sep or not medium or not 0.0 <= weight < float("inf"):
            raise ValueError(
                f"--tier-weights: {part!r} is not TIER=WEIGHT with a weight >= 0 "
                "(e.g. GPU=1,CPU=0.8,STORAGE/LOCAL=0.5,STORAGE/REMOTE=0.3)"
            )
        weights[tier_of(medium, locality or None)] = weight
    return weights


def run_router_command(args: argparse.Namespace) -> int:
    if not args.access_log:
        logging.getLogger("kvconnect.access").setLevel(logging.WARNING)
    if not args.instance:
        raise ValueError("the router needs at least one --instance (or --decode-instance)")
    specs = [parse_instance(spec) for spec in args.instance]
    prefill_specs = [parse_instance(spec) for spec in args.prefill_instance]
    weights = parse_tier_weights(args.tier_weights)
    endpoint = args.otlp_traces_endpoint
    tracing = None if endpoint is None else RouterTracing.start(endpoint)
    options = RouterOptions(
        api_key=api_keys_from(args.api_key),
        admin_token=admin_token_from(args.admin_token),
        instance_api_key=instance_api_key_from(args.instance_api_key),
        upstream_timeout=args.upstream_timeout,
        limits=ConnectionLimits(
            args.max_connections, args.header_timeout, args.body_timeout, args.write_timeout
        ),
        allow_unauthenticated=args.allow_unauthenticated,
        pd_min_tail=args.pd_min_tail,
        trust_client_kv_params=args.trust_client_kv_params,
        tracing=tracing,
    )
    check_port_free(args.host, args.port, "--port")
    key = options.instance_api_key
    # Instances named by URL alone tell where their streams are (router/discovery.py).
    found = discover(
        [*specs, *prefill_specs], f"Bearer {key}" if key else None, args.discovery_timeout
    )
    instances, prefill = found[: len(specs)], found[len(specs) :]
    tokenizer = load_tokenizer(args.model)
    index = BlockIndex(
        args.block_size,
        hash_algorithm=args.hash_algorithm,
        hash_seed=args.hash_seed,
        max_entries=args.max_index_entries,
        tier_weights=weights,
    )
    curve = curve_from_env(os.environ)  # as `events tail`: both key files, or neither
    replicas = [replica_url(url) for url in args.replica]
    router = Router(
        instances, index, tokenizer, args.load_weight, curve, prefill, pulls=not args.no_pulls
    )
    if replicas:
        names = [i.name for i in router.instances]
        router.loads.replicas = ReplicaLoads(replicas, names, router.take_measured)
    router.start()
    gc.freeze()  # what start-up made lives as long as the process: no collection walks it again
    return run_event_loop(serve_router(router, args.host, args.port, options))


def run_event_loop(main: Coroutine[Any, Any, int]) -> int:
    """`main` on uvloop where it is installed (about half the per-request cost of a proxied
    request), else on asyncio's own loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)

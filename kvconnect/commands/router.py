"""`kvconnect router`: flags checked, tokenizer loaded, the streams followed, then serving."""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Coroutine
from typing import Any

from kvconnect.commands.startup import check_port_free
from kvconnect.router.core import Instance, Router
from kvconnect.router.index import BlockIndex
from kvconnect.router.server import serve_router
from kvconnect.tokenizer import load_tokenizer


def parse_tier_weights(text: str) -> dict[str, float]:
    """`--tier-weights MEDIUM=WEIGHT,...`."""
    try:
        return {m: float(w) for m, w in (p.split("=") for p in text.split(","))}
    except ValueError:
        raise ValueError(f"--tier-weights {text!r}: expected MEDIUM=WEIGHT,...") from None


def run_router_command(args: argparse.Namespace) -> int:
    instances = [Instance.parse(spec) for spec in args.instance]
    weights = parse_tier_weights(args.tier_weights)
    check_port_free(args.host, args.port, "--port")
    tokenizer = load_tokenizer(args.model)
    index = BlockIndex(
        args.block_size,
        hash_algorithm=args.hash_algorithm,
        hash_seed=args.hash_seed,
        max_entries=args.max_index_entries,
        tier_weights=weights,
    )
    router = Router(instances, index, tokenizer, args.load_weight).start()
    return run_event_loop(serve_router(router, args.host, args.port))


def run_event_loop(main: Coroutine[Any, Any, int]) -> int:
    """`main` on uvloop where it is installed (about half the per-request cost of a proxied
    request), else on asyncio's own loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)

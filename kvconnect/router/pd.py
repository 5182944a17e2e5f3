"""Disaggregated prefill/decode through the router, in NixlConnector's handshake (vLLM's toy
proxy and llm-d's sidecar drive it the same way), so it drives kvconnect pairs and vLLM
NixlConnector pairs alike:

    1. the decode instance D is chosen as any request's instance is (`Router.pick`)
    2. a prefill instance P is chosen among the `--prefill-instance`s (prefix and load,
       `choose`); when the prompt's tail that D lacks is at least the pair's crossover, P
       gets the request with max_tokens 1, no stream and
       `kv_transfer_params: {"do_remote_decode": true, ...}`
    3. D gets the client's request with P's answer's `kv_transfer_params`; its answer
       (streamed or not) is the client's

A P that fails, times out, answers an error, no params or malformed ones (the keys of
`kvconnect.transfer_params`, checked as D checks them) costs only its time: D gets the
client's request unchanged and computes the prompt (counted: `pd_prefill_failed`). What
each step sent where is counted per outcome (`kvconnect_router_pd_total`).

The crossover is measured: D's answers to P/D requests fit what pulling from P costs D
(costs.py), and below `CostModel.crossover(P, D)` tokens D computes faster than it pulls, so
it computes the tail itself. Until the pair is measured, `min_tail` (`--pd-min-tail`) stands
in for it.
"""

from __future__ import annotations

import logging
from typing import Any

import msgspec

from kvconnect.http.client import Unreachable, UpstreamBroken, UpstreamPool, UpstreamTimeout
from kvconnect.router.core import Instance, Router
from kvconnect.router.costs import CostModel
from kvconnect.router.index import PrefixScore
from kvconnect.transfer_params import TO_PREFILL, parse

logger = logging.getLogger(__name__)

MAX_PREFILL_ANSWER = 1 << 20
"""A prefill's answer is one token and its params: anything longer is not one."""


class _PrefillAnswer(msgspec.Struct):
    kv_transfer_params: dict[str, Any] | None = None


_answer = msgspec.json.Decoder(_PrefillAnswer)
_encode = msgspec.json.Encoder().encode


def prefill_body(raw: bytes) -> bytes:
    """The client's request as P gets it: one token, no stream, do_remote_decode."""
    body = msgspec.json.decode(raw)
    body.update(max_tokens=1, stream=False, kv_transfer_params=TO_PREFILL)
    if "max_completion_tokens" in body:
        body["max_completion_tokens"] = 1
    for key in ("stream_options", "n", "best_of", "min_tokens"):
        body.pop(key, None)
    return _encode(body)


def decode_body(raw: bytes, params: dict[str, Any]) -> bytes:
    """The client's request as D gets it: with P's params."""
    body = msgspec.json.decode(raw)
    body["kv_transfer_params"] = params
    return _encode(body)


def without_params(raw: bytes) -> bytes:
    """The client's request without its `kv_transfer_params`: they are the proxy's to send
    (a client's would make an instance pull from or lease to whom the client says)."""
    body = msgspec.json.decode(raw)
    body.pop("kv_transfer_params", None)
    return _encode(body)


def with_source(raw: bytes, source: Instance) -> bytes:
    """The client's request with `remote_kv_source` naming `source`'s peer tier: the
    instance pulls the prefix `source` holds beyond its own (scorer.py)."""
    assert source.peer is not None
    host, port = source.peer
    return decode_body(raw, {"remote_kv_source": {"host": host, "port": port}})


def min_tail_of(costs: CostModel, prefill: str, decode: str, min_tail: int) -> float:
    """The tail `decode` must lack for a prefill on `prefill` to pay: the pair's measured
    crossover (inf: a pull from it never pays), or `min_tail` until it is measured."""
    crossover = costs.crossover(prefill, decode)
    return max(1.0, min_tail if crossover is None else crossover)


async def prefilled(
    router: Router,
    pool: UpstreamPool,
    path: str,
    raw: bytes,
    token_ids: list[int],
    decode: str,
    decode_score: PrefixScore,
    min_tail: int,
    authorization: str | None,
    cache_salt: str | None = None,
) -> tuple[bytes, str] | None:
    """The body to send D (`decode`), with a prefill's params, and that prefill instance;
    None when D computes the prompt itself (and gets the client's body)."""
    tail = len(token_ids) - decode_score.num_tokens
    if tail < 1:
        router.pd["local"] += 1
        return None
    picked = router.pick_prefill(token_ids, cache_salt)
    if picked is None:
        router.pd["no_prefill_instance"] += 1
        return None
    prefill, score, _, _ = picked
    if tail < min_tail_of(router.costs, prefill.name, decode, min_tail):
        router.pd["local"] += 1
        return None
    router.record(prefill.name, score)
    params = await _run_prefill(router, pool, prefill, path, raw, authorization)
    if params is None:
        router.pd["prefill_failed"] += 1
        return None
    router.pd["disaggregated"] += 1
    return decode_body(raw, params), prefill.name


async def _run_prefill(
    router: Router,
    pool: UpstreamPool,
    prefill: Instance,
    path: str,
    raw: bytes,
    authorization: str | None,
) -> dict[str, Any] | None:
    name = prefill.name
    router.sent(name, 0)  # in flight; prefill picks weigh no pending tokens
    try:
        upstream = await pool.post(
            prefill.url, path, prefill_body(raw), authorization=authorization
        )
        try:
            if upstream.status != 200:
                logger.warning(
                    "router: prefill %s answered %d; decode computes", name, upstream.status
                )
                return None
            if upstream.content_length is None or upstream.content_length > MAX_PREFILL_ANSWER:
                logger.warning("router: prefill %s sent no bounded answer; decode computes", name)
                return None
            body = await upstream.read()
        finally:
            upstream.release()
    except UpstreamTimeout as e:
        router.mark_down(name, f"prefill stalled: {e}")
        return None
    except (Unreachable, UpstreamBroken) as e:
        logger.warning("router: prefill %s failed (%s); decode computes", name, e)
        router.mark_down(name, f"prefill failed: {e}")
        return None
    finally:
        router.landed(name, 0)
    try:
        params = _answer.decode(body).kv_transfer_params
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        logger.warning("router: prefill %s answered no JSON params (%s); decode computes", name, e)
        return None
    if not params or not params.get("do_remote_prefill"):
        logger.warning("router: prefill %s gave no kv_transfer_params; decode computes", name)
        return None
    try:  # the keys kvconnect reads, as the decode instance checks them (others pass)
        parse(params, strict=False)
    except ValueError as e:
        logger.warning(
            "router: prefill %s answered malformed params (%s); decode computes", name, e
        )
        return None
    return params

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
client's request unchanged and computes the prompt. What each request's step did is counted
per outcome (`PrefillStep.outcomes`, `kvconnect_router_pd_total{outcome}`).

The crossover is measured: D's answers to P/D requests fit what pulling from P costs D
(costs.py), and below `CostModel.crossover(P, D)` tokens D computes faster than it pulls, so
it computes the tail itself. Until the pair is measured, `min_tail` (`--pd-min-tail`) stands
in for it.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

import msgspec

from kvconnect.http.client import Unreachable, UpstreamBroken, UpstreamPool, UpstreamTimeout
from kvconnect.router.core import Picked, Router, Scored
from kvconnect.router.costs import CostModel
from kvconnect.router.instances import Instance
from kvconnect.transfer_params import TO_PREFILL, parse

logger = logging.getLogger(__name__)

MAX_PREFILL_ANSWER = 1 << 20
"""A prefill's answer is one token and its params: anything longer is not one."""


class _PrefillAnswer(msgspec.Struct):
    kv_transfer_params: dict[str, Any] | None = None


_answer = msgspec.json.Decoder(_PrefillAnswer)
_encode = msgspec.json.Encoder().encode


class Body:
    """The client's request body as the router sends it on, decoded at most once for every
    body made from it (a P/D request's prefill and decode bodies, a pull's)."""

    def __init__(self, raw: bytes) -> None:
        self.raw = raw
        """What an instance gets when nothing is added."""
        self._decoded: dict[str, Any] | None = None

    def _dict(self) -> dict[str, Any]:
        if self._decoded is None:
            self._decoded = msgspec.json.decode(self.raw)
        return self._decoded

    def drop_params(self) -> None:
        """The client's own `kv_transfer_params` dropped: they are the proxy's to send (a
        client's would make an instance pull from or lease to whom the client says)."""
        body = self._dict()
        body.pop("kv_transfer_params", None)
        self.raw = _encode(body)

    def for_prefill(self) -> bytes:
        """As P gets it: one token, no stream, do_remote_decode."""
        body = dict(self._dict())
        body.update(max_tokens=1, stream=False, kv_transfer_params=TO_PREFILL)
        if "max_completion_tokens" in body:
            body["max_completion_tokens"] = 1
        for key in ("stream_options", "n", "best_of", "min_tokens"):
            body.pop(key, None)
        return _encode(body)

    def with_params(self, params: dict[str, Any]) -> bytes:
        """As D gets it: with P's params."""
        return _encode({**self._dict(), "kv_transfer_params": params})

    def with_source(self, source: Instance) -> bytes:
        """With `remote_kv_source` naming `source`'s peer tier: the instance pulls the prefix
        `source` holds beyond its own (scorer.py)."""
        assert source.peer is not None
        host, port = source.peer
        return self.with_params({"remote_kv_source": {"host": host, "port": port}})


def min_tail_of(costs: CostModel, prefill: str, decode: str, min_tail: int) -> float:
    """The tail `decode` must lack for a prefill on `prefill` to pay: the pair's measured
    crossover (inf: a pull from it never pays), or `min_tail` until it is measured."""
    crossover = costs.crossover(prefill, decode)
    return max(1.0, min_tail if crossover is None else crossover)


class PrefillStep:
    """P/D's first step for the requests of one router: a prefill instance chosen, the
    request sent there, its params checked; what each request's step did, counted
    (`outcomes`: disaggregated, local, prefill_failed, no_prefill_instance)."""

    def __init__(self, router: Router, pool: UpstreamPool, min_tail: int) -> None:
        self.router = router
        self.pool = pool
        self.min_tail = min_tail
        self.outcomes: Counter[str] = Counter()

    async def run(
        self,
        path: str,
        body: Body,
        scored: Scored,
        decode: Picked,
        authorization: str | None,
        trace_headers: str,
    ) -> tuple[bytes, str] | None:
        """The body to send D (`decode`), with a prefill's params, and that prefill
        instance; None when D computes the prompt itself (and gets the client's body). P
        gets the request's `authorization` and `trace_headers` as D does."""
        router = self.router
        tail = len(scored.token_ids) - decode.score.num_tokens
        if tail < 1:
            self.outcomes["local"] += 1
            return None
        picked = router.pick_prefill(scored)
        if picked is None:
            self.outcomes["no_prefill_instance"] += 1
            return None
        prefill, score, _, _ = picked
        if tail < min_tail_of(router.costs, prefill.name, decode.instance.name, self.min_tail):
            self.outcomes["local"] += 1
            return None
        router.record(prefill.name, score)
        raw = body.for_prefill()
        params = await self._prefill(prefill, path, raw, authorization, trace_headers)
        if params is None:
            self.outcomes["prefill_failed"] += 1
            return None
        self.outcomes["disaggregated"] += 1
        return body.with_params(params), prefill.name

    async def _prefill(
        self,
        prefill: Instance,
        path: str,
        raw: bytes,
        authorization: str | None,
        trace_headers: str,
    ) -> dict[str, Any] | None:
        router, name = self.router, prefill.name
        router.loads.sent(name, 0)  # in flight; prefill picks weigh no pending tokens
        try:
            upstream = await self.pool.post(
                prefill.url, path, raw, authorization=authorization, extra_headers=trace_headers
            )
            try:
                if upstream.status != 200:
                    logger.warning(
                        "router: prefill %s answered %d; decode computes", name, upstream.status
                    )
                    return None
                length = upstream.content_length
                if length is None or length > MAX_PREFILL_ANSWER:
                    logger.warning(
                        "router: prefill %s sent no bounded answer; decode computes", name
                    )
                    return None
                answer = await upstream.read()
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
            router.loads.landed(name, 0)
        return _params_of(name, answer)


def _params_of(name: str, answer: bytes) -> dict[str, Any] | None:
    """P's answer's `kv_transfer_params`, checked as the decode instance checks them (the
    keys kvconnect reads; others pass); None, logged, when they are absent or malformed."""
    try:
        params = _answer.decode(answer).kv_transfer_params
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        logger.warning("router: prefill %s answered no JSON params (%s); decode computes", name, e)
        return None
    if not params or not params.get("do_remote_prefill"):
        logger.warning("router: prefill %s gave no kv_transfer_params; decode computes", name)
        return None
    try:
        parse(params, strict=False)
    except ValueError as e:
        logger.warning(
            "router: prefill %s answered malformed params (%s); decode computes", name, e
        )
        return None
    return params

"""The relay: one request to the chosen instance, its answer (streamed or not) back.

Before the answer begins, a refused or failed connection, or an answer head that is not
well-framed HTTP/1.1, is `http.client.Unreachable` and the request may go to another instance;
once it has begun, nothing can move it: an instance dying mid-answer (or framing it badly)
cuts the client's answer too, never ending it as a whole one is ended (an event stream gets an
error event first); a client going away just ends the relay (its task
is cancelled and the upstream connection closed, so that the instance aborts the request
too). An instance that took the request and then stays silent past the pool's read timeout
is a 504 for the client (or a cut stream) and leaves rotation until its health check answers
again.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from kvconnect.http.client import (
    UpstreamBroken,
    UpstreamPool,
    UpstreamResponse,
    UpstreamTimeout,
)
from kvconnect.http.h1_server import Request, Response
from kvconnect.router.core import Router, StaleCheck, Usage, usage_of
from kvconnect.router.index import PrefixScore
from kvconnect.router.instances import Instance

logger = logging.getLogger(__name__)

MAX_WHOLE_BODY = 8 << 20
"""Answers of a known length up to this size are relayed whole (and their usage checked
against the index); longer or streamed ones chunk by chunk."""

_TIMED_OUT = (
    b'{"error": {"message": "the instance did not answer in time", '
    b'"type": "timeout", "param": null, "code": 504}}'
)
_BROKEN = (
    b'{"error": {"message": "the instance failed mid-answer", '
    b'"type": "bad_gateway", "param": null, "code": 502}}'
)


@dataclass(frozen=True)
class Relay:
    """One request as it goes to its instance, and what its answer is measured against."""

    instance: Instance
    """Where the request goes."""
    body: bytes
    """The request body as sent (the router's `kv_transfer_params` in it, the client's not)."""
    score: PrefixScore
    """What the index credited the instance with."""
    source: str | None = None
    """The instance it was told to pull from (`remote_kv_source`, or P/D's prefill)."""
    check: StaleCheck | None = None
    """What to check its cached tokens against (`Router.check_cached`); None: nothing."""
    load: tuple[int, int] = (0, 0)
    """The requests in flight at the instance when it was sent, and the prompt tokens they
    had still to compute (`Loads.of`)."""
    streamed_usage: bool = False
    """A stream that asked for its usage chunk (`stream_options.include_usage`)."""
    authorization: str | None = None
    """Sent to the instance as that header."""
    trace_headers: str = ""
    """The trace context lines sent with it (router/tracing.py)."""


async def forward(request: Request, pool: UpstreamPool, router: Router, relay: Relay) -> Response:
    """Relay one request and its answer; a whole JSON answer's usage is checked against the
    index (`Router.check_cached`) and measures the instance's costs (and the pull's, from
    `relay.source`: `Router.learn`). So does a streamed one that ends with a usage chunk
    (`relay.streamed_usage`), its time to first token against one completion token."""
    start = time.perf_counter()
    instance = relay.instance
    try:
        upstream = await pool.post(
            instance.url,
            request.path,
            relay.body,
            authorization=relay.authorization,
            extra_headers=relay.trace_headers,
        )
    except UpstreamTimeout as e:
        return _timed_out(router, instance, e)
    streamed = False
    try:
        router.record(instance.name, relay.score, relay.source)
        content_type = upstream.headers.get("content-type", "application/json")
        headers = {"x-kvconnect-instance": instance.name}
        retry_after = upstream.headers.get("retry-after")
        if retry_after is not None:  # an overloaded instance's 503 says when to come back
            headers["Retry-After"] = retry_after
        if upstream.content_length is not None and upstream.content_length <= MAX_WHOLE_BODY:
            try:
                body = await upstream.read()  # sent on in one write, its usage checked
            except UpstreamTimeout as e:
                return _timed_out(router, instance, e)
            except UpstreamBroken as e:
                logger.warning("router: %s failed mid-answer: %s", instance.name, e)
                return Response(502, _BROKEN)
            # absent: the instance does not say (then the body is not even decoded)
            if upstream.status == 200 and b'"prompt_tokens_details"' in body:
                elapsed = time.perf_counter() - start
                usage = usage_of(body)  # once, for both
                if usage is not None:
                    json_answer = content_type.startswith("application/json")
                    _measured(router, relay, elapsed, usage, json_answer)
            return Response(upstream.status, body, content_type, headers)
        streamed = True
        measure = None
        if relay.streamed_usage and upstream.status == 200:
            measure = _Measure(start, relay)
        stream = _relay_stream(upstream, instance, router, measure)
        return Response(upstream.status, b"", content_type, headers, stream, upstream.release)
    finally:
        if not streamed:
            upstream.release()


def _timed_out(router: Router, instance: Instance, e: UpstreamTimeout) -> Response:
    router.mark_down(instance.name, f"stalled: {e}")
    return Response(504, _TIMED_OUT)


@dataclass
class _Measure:
    """What a streamed answer's usage chunk is measured against (`forward`)."""

    start: float
    relay: Relay
    first: float | None = None
    """When the answer's first bytes came: its first token's."""
    tail: bytes = b""
    """The answer's last USAGE_TAIL bytes: the usage chunk is the last event but [DONE]."""

    def add(self, data: bytes) -> None:
        if self.first is None:
            self.first = time.perf_counter()
        self.tail = (self.tail + data[-USAGE_TAIL:])[-USAGE_TAIL:]

    def usage(self) -> Usage | None:
        """The usage chunk's usage, with the cached-token count; None without one."""
        tail = self.tail
        at = tail.rfind(b'"prompt_tokens_details"')
        begin = tail.rfind(b"data:", 0, at) if at >= 0 else -1
        if begin < 0:
            return None
        end = tail.find(b"\n", at)
        return usage_of(tail[begin + 5 : end if end >= 0 else len(tail)])


USAGE_TAIL = 4096


def _measured(
    router: Router, relay: Relay, elapsed: float, usage: Usage, checked: bool = True
) -> None:
    """An answer's usage, checked against the index (`relay.check`, unless not `checked`:
    an answer that is not JSON) and learned from."""
    name = relay.instance.name
    if checked and relay.check is not None and relay.score.num_tokens > 0:
        router.check_cached(name, relay.score, relay.check, usage)
    router.learn(name, relay.score, relay.source, elapsed, usage, *relay.load)


def _learn_stream(router: Router, m: _Measure) -> None:
    usage = m.usage()
    if usage is None or m.first is None:
        return
    first = Usage(usage.prompt_tokens, 1, usage.prompt_tokens_details)  # to its first token
    _measured(router, m.relay, m.first - m.start, first)


async def _relay_stream(
    upstream: UpstreamResponse, instance: Instance, router: Router, measure: _Measure | None
) -> AsyncIterator[bytes]:
    """A streamed answer, piece by piece as it comes. Once begun it cannot move: an instance
    that cuts it or frames it badly ends it with an SSE error event (for an event stream),
    then the exception, on which the server cuts the client's answer so that it never looks
    whole (`h1_server`: no last chunk, or a reset). With `measure`, a whole answer's usage
    chunk is a measurement (`Router.learn`)."""
    last = b"\n\n"
    try:
        async for data in upstream.iter_body():
            last = data
            if measure is not None:
                measure.add(data)
            yield data
        if measure is not None:
            _learn_stream(router, measure)
    except UpstreamBroken as e:
        if isinstance(e, UpstreamTimeout):
            router.mark_down(instance.name, f"stalled mid-answer: {e}")
        reason = f"{instance.name} failed mid-answer: {e}"
        if upstream.headers.get("content-type", "").startswith("text/event-stream"):
            event = {"error": {"message": reason, "type": "bad_gateway", "code": 502}}
            sep = b"" if last.endswith(b"\n\n") else b"\n\n"  # end a cut event first
            yield sep + b"data: " + json.dumps(event).encode() + b"\n\n"
        raise UpstreamBroken(reason) from None

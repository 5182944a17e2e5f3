"""OpenTelemetry traces of the router's routing, when asked for (`--otlp-traces-endpoint URL`,
vLLM's flag of that name); off by default, and then nothing of OpenTelemetry is imported or
created: a request only has its client's `traceparent` passed on to the instance.

    RouterTracing.start(endpoint)   at start (commands/router.py): the SDK's tracer provider,
                                    a batch processor and the OTLP exporter; a ValueError
                                    naming the package when the `otel` extra is missing
    tracing.traced(http, route)     per routed request (server.py): one SERVER span around
                                    `route(trace)`, continuing the client's W3C traceparent,
                                    ended when the answer has been sent (or cut, or refused)
    trace.decided(...)              the decision: each candidate's cost (what /kv/score's
                                    `choice.costs` shows), the instance, the pull source, the
                                    prompt tokens cached there
    trace.headers()                 `traceparent` (and `tracestate`) of the span, sent to the
                                    instance (forward.py), and under P/D to the prefill
                                    instance (pd.py), so their own spans join the trace
    trace.unreachable(name, error)  an instance refused the request; the next decision follows
    passthrough(headers)            tracing off: the client's traceparent (checked) as is

Configured as vLLM's is: the endpoint from the flag; the protocol from
`OTEL_EXPORTER_OTLP_TRACES_PROTOCOL` (else `OTEL_EXPORTER_OTLP_PROTOCOL`), `grpc` by default
as in vLLM, or `http/protobuf` (the endpoint then is the full URL, `.../v1/traces`). The SDK
reads the other standard variables itself: `OTEL_SERVICE_NAME` (default here
`kvconnect-router`), `OTEL_RESOURCE_ATTRIBUTES`, `OTEL_TRACES_SAMPLER`(`_ARG`),
`OTEL_PROPAGATORS`, `OTEL_BSP_*`, `OTEL_EXPORTER_OTLP_*` (headers, TLS, timeout). Spans
leave in batches from the SDK's thread; the last ones are flushed at exit.
"""

from __future__ import annotations

import atexit
import os
import re
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any

from kvconnect.api.protocol import ApiError
from kvconnect.http.h1_server import Request, Response

if TYPE_CHECKING:
    from opentelemetry.trace import Span, Tracer

    from kvconnect.router.core import Picked

SPAN_NAME = "kvconnect.router.route"
INSTRUMENTATION = "kvconnect.router"
PROTOCOLS = ("grpc", "http/protobuf")
TRACEPARENT = re.compile(r"[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}")
"""W3C trace context's `traceparent` (version-trace id-parent id-flags), lowercase hex."""
MAX_TRACESTATE = 512
"""A longer `tracestate` is not passed on (W3C: propagate at least 512 characters)."""


def passthrough(headers: Mapping[str, str]) -> str:
    """Tracing off: the client's `traceparent` (and its `tracestate`) as header lines for the
    instance, if it is well-formed; else none."""
    parent = headers.get("traceparent")
    if parent is None or not TRACEPARENT.fullmatch(parent):
        return ""
    state = headers.get("tracestate")
    if state is None or len(state) > MAX_TRACESTATE:
        return f"traceparent: {parent}\r\n"
    return f"traceparent: {parent}\r\ntracestate: {state}\r\n"


class RouteTrace:
    """One routed request's span."""

    def __init__(self, span: Span) -> None:
        self.span = span

    def decided(
        self, picked: Picked, num_prompt_tokens: int, costs: Mapping[str, float], source: str | None
    ) -> None:
        """The instance chosen, what it holds, the source it pulls from, and every
        candidate's cost (in prompt tokens' worth, the cheapest chosen)."""
        names = sorted(costs)
        self.span.set_attributes(
            {
                "kvconnect.router.instance": picked.instance.name,
                "kvconnect.router.prompt_tokens": num_prompt_tokens,
                "kvconnect.router.hit_tokens": picked.score.num_tokens,
                "kvconnect.router.computed_tokens": picked.computed,
                "kvconnect.router.candidates": names,
                "kvconnect.router.candidate_costs": [float(costs[n]) for n in names],
            }
        )
        if source is not None:
            self.span.set_attribute("kvconnect.router.pull_source", source)

    def headers(self) -> str:
        """The span's context as header lines for the instance (`OTEL_PROPAGATORS`:
        traceparent and tracestate by default)."""
        from opentelemetry import propagate, trace

        carrier: dict[str, str] = {}
        propagate.inject(carrier, context=trace.set_span_in_context(self.span))
        return "".join(
            f"{name}: {value}\r\n"
            for name, value in carrier.items()
            if "\r" not in value and "\n" not in value
        )

    def unreachable(self, instance: str, error: BaseException) -> None:
        self.span.add_event(
            "instance unreachable",
            {"kvconnect.router.instance": instance, "exception.message": str(error)},
        )


class RouterTracing:
    """The tracer of a router process (`start`), and the span of each routed request."""

    def __init__(self, tracer: Tracer) -> None:
        self.tracer = tracer

    @classmethod
    def start(cls, endpoint: str, environ: Mapping[str, str] | None = None) -> RouterTracing:
        """A tracer exporting to `endpoint` over OTLP, flushed at exit. `ValueError` (one
        line) for a protocol it does not know or a package that is not installed."""
        env = os.environ if environ is None else environ
        protocol = env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get(
            "OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"
        )
        if protocol not in PROTOCOLS:
            raise ValueError(
                f"--otlp-traces-endpoint: OTLP protocol {protocol!r} (from "
                f"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL) is not one of {', '.join(PROTOCOLS)}"
            )
        if not endpoint.strip():
            raise ValueError("--otlp-traces-endpoint: empty")
        try:
            return cls(_tracer(endpoint, protocol, env))
        except ImportError as e:
            package = _package_of(e.name or "opentelemetry")
            raise ValueError(
                f"--otlp-traces-endpoint needs the OpenTelemetry package {package} "
                "(pip install 'kvconnect[otel]')"
            ) from None

    async def traced(
        self, http: Request, route: Callable[[RouteTrace], Awaitable[Response]]
    ) -> Response:
        """`route(trace)` in a span continuing the request's traceparent; the span ends when
        the answer has been sent, cut or abandoned, or with the exception `route` raised."""
        from opentelemetry import propagate
        from opentelemetry.trace import SpanKind, Status, StatusCode

        span = self.tracer.start_span(
            SPAN_NAME,
            context=propagate.extract(http.headers),
            kind=SpanKind.SERVER,
            attributes={"http.request.method": http.method, "url.path": http.path},
        )
        try:
            response = await route(RouteTrace(span))
        except BaseException as e:
            status = e.status if isinstance(e, ApiError) else 500
            span.set_attribute("http.response.status_code", status)
            span.set_status(Status(StatusCode.ERROR, f"{type(e).__name__}: {e}"))
            span.end()
            raise
        span.set_attribute("http.response.status_code", response.status)
        if response.status >= 500:
            span.set_status(Status(StatusCode.ERROR))
        closed = response.on_close

        def end() -> None:
            if closed is not None:
                closed()
            span.end()

        response.on_close = end
        return response


_PACKAGES = (
    ("opentelemetry.exporter.otlp.proto.grpc", "opentelemetry-exporter-otlp-proto-grpc"),
    ("grpc", "opentelemetry-exporter-otlp-proto-grpc"),  # its grpcio
    ("opentelemetry.exporter", "opentelemetry-exporter-otlp-proto-http"),
    ("opentelemetry.proto", "opentelemetry-proto"),
    ("google.protobuf", "protobuf"),
    ("opentelemetry.sdk", "opentelemetry-sdk"),
    ("opentelemetry", "opentelemetry-api"),
)
"""The distribution that provides a module, by the module's name (first match)."""


def _package_of(module: str) -> str:
    for prefix, package in _PACKAGES:
        if module == prefix or module.startswith(prefix + "."):
            return package
    return module


def _tracer(endpoint: str, protocol: str, env: Mapping[str, str]) -> Tracer:
    """The SDK's tracer provider with the OTLP exporter of `protocol` (imports it: the
    `otel` extra)."""
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    exporter: Any
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter(endpoint=endpoint)  # TLS unless http:// (or _INSECURE)
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
            OTLPSpanExporter as OTLPHttpSpanExporter,
        )

        exporter = OTLPHttpSpanExporter(endpoint=endpoint)
    named = {} if env.get("OTEL_SERVICE_NAME") else {"service.name": "kvconnect-router"}
    provider = TracerProvider(resource=Resource.create(named))
    provider.add_span_processor(BatchSpanProcessor(exporter))
    atexit.register(provider.shutdown)  # the spans still queued, sent at exit
    return provider.get_tracer(INSTRUMENTATION)

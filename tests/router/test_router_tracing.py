"""The router's OpenTelemetry traces (`--otlp-traces-endpoint`, router/tracing.py), against a
real OTLP/HTTP receiver in the test (POST /v1/traces, the exporter's protobuf decoded with
opentelemetry-proto) and two real `kvconnect serve --model tiny` instances. Each instance is
reached through a recorder in the test that keeps the headers the router sent and relays the
request to it unchanged, so the test sees what the instance receives.

A request with a client's `traceparent` gives one span of that trace, child of the client's
span, with the decision on it (each candidate's cost as /kv/score shows them, the instance,
the prompt tokens cached there); the instance gets a `traceparent` of the same trace whose
parent is that span (under P/D, the prefill instance gets one too). Without the flag nothing
is traced, OpenTelemetry need not be installed, and the client's `traceparent` reaches the
instance unchanged (a malformed one does not); asking for traces without the packages is one
error line naming the package.
"""

from __future__ import annotations

import gzip
import http.client
import http.server
import queue
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvconnect.router.core import Picked
from kvconnect.router.index import PrefixScore
from kvconnect.router.instances import Instance
from kvconnect.router.tracing import RouterTracing, RouteTrace
from tests.helpers import free_port, wait_for
from tests.peer_fakes import peer_config, prompt
from tests.serving import RouterProcess, Serve, post, request

pytestmark = pytest.mark.slow

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{CLIENT_SPAN}-01"
PROMPT = "A prompt long enough to be cached in a few blocks of sixteen. " * 3
NO_OTEL = (
    "import sys; sys.modules['opentelemetry'] = None; "  # as if it were not installed
    "from kvconnect.cli import main; sys.exit(main())"
)


class Receiver(http.server.ThreadingHTTPServer):
    """An OTLP/HTTP trace receiver on loopback: every span it is sent, decoded, in `spans`."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", free_port()), _ReceiverHandler)
        self.spans: queue.SimpleQueue[Any] = queue.SimpleQueue()
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/v1/traces"

    def next_span(self, timeout: float = 20.0) -> Any:
        return self.spans.get(timeout=timeout)


class _ReceiverHandler(http.server.BaseHTTPRequestHandler):
    server: Receiver

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        if self.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        assert self.path == "/v1/traces"
        assert self.headers["Content-Type"] == "application/x-protobuf"
        export = ExportTraceServiceRequest.FromString(body)
        for resource_spans in export.resource_spans:
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    self.server.spans.put(span)
        answer = ExportTraceServiceResponse().SerializeToString()
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, *args: Any) -> None:
        pass


class Recorder(http.server.ThreadingHTTPServer):
    """In front of one `Serve`: keeps the headers of each POST it relays, relays every
    request unchanged and its answer back. `instance` names it to the router, with the
    instance's own event streams."""

    def __init__(self, serve: Serve) -> None:
        super().__init__(("127.0.0.1", free_port()), _RecorderHandler)
        self.serve = serve
        self.posted: queue.SimpleQueue[dict[str, str]] = queue.SimpleQueue()
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    @property
    def instance(self) -> str:
        port = self.serve.port
        return f"{self.url},tcp://127.0.0.1:{port + 10000},tcp://127.0.0.1:{port + 20000}"


class _RecorderHandler(http.server.BaseHTTPRequestHandler):
    server: Recorder
    protocol_version = "HTTP/1.1"  # keep-alive, as the router's pool expects

    def do_GET(self) -> None:
        self._relay(None)

    def do_POST(self) -> None:
        self.server.posted.put({k.lower(): v for k, v in self.headers.items()})
        self._relay(self.rfile.read(int(self.headers["Content-Length"])))

    def _relay(self, body: bytes | None) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", self.server.serve.port, timeout=60)
        headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "connection")}
        conn.request(self.command, self.path, body, headers)
        resp = conn.getresponse()
        answer = resp.read()
        conn.close()
        self.send_response(resp.status)
        self.send_header("Content-Type", resp.getheader("Content-Type", "application/json"))
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, *args: Any) -> None:
        pass


def attributes(span: Any) -> dict[str, Any]:
    def value(v: AnyValue) -> Any:
        kind = v.WhichOneof("value")
        if kind == "array_value":
            return [value(x) for x in v.array_value.values]
        return getattr(v, kind)

    return {kv.key: value(kv.value) for kv in span.attributes}


@pytest.fixture(scope="module")
def instances(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Recorder]]:
    tmp = tmp_path_factory.mktemp("tracing")
    serves = [Serve(tmp), Serve(tmp)]
    recorders: list[Recorder] = []
    try:
        for s in serves:
            s.start()
            recorders.append(Recorder(s))
        yield recorders
    finally:
        for r in recorders:
            r.shutdown()
        for s in serves:
            assert s.stop() == 0, s.logs()


def start_router(
    tmp: Path, recorders: list[Recorder], *extra: str, env: dict[str, str] | None = None
) -> RouterProcess:
    router = RouterProcess(tmp, recorders, *extra)  # type: ignore[arg-type]
    variables = [f"{k}={v}" for k, v in (env or {}).items()]
    router.launcher = ["env", *variables, *router.launcher]
    router.start()
    wait_for(lambda: request(router.url + "/health")[0] == 200)
    return router


def complete(router: RouterProcess, headers: dict[str, str]) -> str:
    status, body, answer_headers = request(
        router.url + "/v1/completions", {"prompt": PROMPT, "max_tokens": 2}, headers
    )
    assert status == 200, body
    return str(answer_headers["x-kvconnect-instance"])


def posted(recorders: list[Recorder], name: str) -> dict[str, str]:
    """The headers of the next request `name` received (each was sent one)."""
    (recorder,) = [r for r in recorders if r.url == name]
    return recorder.posted.get(timeout=10)


def parent_of(traceparent: str) -> tuple[str, str]:
    """The trace id and parent span id of a sampled `traceparent` (flags may carry W3C's
    random-trace-id bit besides the sampled one)."""
    version, trace_id, parent, flags = traceparent.split("-")
    assert version == "00" and int(flags, 16) & 1, traceparent
    return trace_id, parent


def nothing_else_posted(recorders: list[Recorder]) -> None:
    assert all(r.posted.empty() for r in recorders)


def test_a_traced_request_is_one_span_of_the_clients_trace_with_the_decision(
    instances: list[Recorder], tmp_path: Path
) -> None:
    receiver = Receiver()
    env = {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf", "OTEL_BSP_SCHEDULE_DELAY": "50"}
    router = start_router(tmp_path, instances, "--otlp-traces-endpoint", receiver.endpoint, env=env)
    try:
        where = complete(router, {"traceparent": TRACEPARENT})
        span = receiver.next_span()
        got = attributes(span)
        assert span.trace_id.hex() == TRACE_ID and span.parent_span_id.hex() == CLIENT_SPAN
        assert span.name == "kvconnect.router.route"
        names = sorted(r.url for r in instances)
        assert got["kvconnect.router.instance"] == where
        assert got["kvconnect.router.candidates"] == names
        assert len(got["kvconnect.router.candidate_costs"]) == 2
        assert got["kvconnect.router.hit_tokens"] == 0  # nothing cached anywhere yet
        assert "kvconnect.router.pull_source" not in got  # no peers: no pulls
        assert got["http.response.status_code"] == 200 and got["url.path"] == "/v1/completions"
        sent = posted(instances, where)["traceparent"]
        assert parent_of(sent) == (TRACE_ID, span.span_id.hex())  # the router's span, its child

        # Again, once the index has the prompt's blocks: the decision's costs are the ones
        # /kv/score shows now, and the cached tokens those it credits the instance.
        def scored() -> dict[str, Any]:
            return dict(post(router.url + "/kv/score", {"prompt": PROMPT})[1])

        wait_for(lambda: scored()["instances"][where]["cached_tokens"] > 0)
        score = scored()
        again = complete(router, {"traceparent": TRACEPARENT})
        got = attributes(receiver.next_span())
        assert again == where == score["choice"]["instance"]
        costs = dict(
            zip(
                got["kvconnect.router.candidates"],
                got["kvconnect.router.candidate_costs"],
                strict=True,
            )
        )
        assert costs == pytest.approx(score["choice"]["costs"])
        assert got["kvconnect.router.hit_tokens"] == score["instances"][where]["cached_tokens"]
        assert got["kvconnect.router.prompt_tokens"] == score["prompt_tokens"]
        assert parent_of(posted(instances, again)["traceparent"])[0] == TRACE_ID

        complete(router, {})  # no client trace: a trace of the router's own, sent on
        span = receiver.next_span()
        assert span.parent_span_id == b""
        sent = posted(instances, attributes(span)["kvconnect.router.instance"])["traceparent"]
        assert parent_of(sent) == (span.trace_id.hex(), span.span_id.hex())
        nothing_else_posted(instances)
    finally:
        assert router.stop() == 0, router.logs()
        receiver.shutdown()


def test_untraced_the_router_runs_without_opentelemetry_and_passes_the_traceparent_on(
    instances: list[Recorder], tmp_path: Path
) -> None:
    router = RouterProcess(tmp_path, instances)  # type: ignore[arg-type]
    router.launcher = [sys.executable, "-c", NO_OTEL]
    router.start()
    try:
        wait_for(lambda: request(router.url + "/health")[0] == 200)
        state = "congo=t61rcWkgMzE"
        where = complete(router, {"traceparent": TRACEPARENT, "tracestate": state})
        sent = posted(instances, where)
        assert (sent["traceparent"], sent["tracestate"]) == (TRACEPARENT, state)
        where = complete(router, {"traceparent": "00-" + TRACE_ID + "-nothex-01"})
        assert "traceparent" not in posted(instances, where)
        nothing_else_posted(instances)
    finally:
        assert router.stop() == 0, router.logs()


def test_traces_asked_for_without_the_packages_are_one_error_line_naming_one(
    tmp_path: Path,
) -> None:
    for blocked, package in (
        ("opentelemetry.sdk", "opentelemetry-sdk"),
        ("opentelemetry.exporter.otlp.proto.grpc", "opentelemetry-exporter-otlp-proto-grpc"),
    ):
        code = NO_OTEL.replace("'opentelemetry'", repr(blocked))
        args = ["router", "--model", "tiny", "--port", str(free_port())]
        args += ["--instance", "http://127.0.0.1:1,tcp://127.0.0.1:2"]
        args += ["--otlp-traces-endpoint", "http://127.0.0.1:4317"]
        done = subprocess.run(
            [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 2, done.stderr
        assert done.stderr.splitlines() == [
            "kvconnect router: error: --otlp-traces-endpoint needs the OpenTelemetry package "
            f"{package} (pip install 'kvconnect[otel]')"
        ]


def test_the_router_imports_no_opentelemetry_until_traces_are_asked_for() -> None:
    code = (
        "import sys, kvconnect.cli, kvconnect.commands.router, kvconnect.router.server; "
        "assert not [m for m in sys.modules if m.startswith('opentelemetry')]"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_decision_that_pulls_names_its_source() -> None:
    """In the SDK's own span (its in-memory exporter): the pull source is an attribute."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing = RouterTracing(provider.get_tracer("test"))
    b = Instance("http://b:1", "tcp://b:2")
    picked = Picked(b, PrefixScore(num_blocks=2, block_size=16), None, 96)
    span = tracing.tracer.start_span("route")
    RouteTrace(span).decided(picked, 128, {"http://a:1": 40.0, "http://b:1": 12.5}, "http://a:1")
    span.end()
    (finished,) = exporter.get_finished_spans()
    assert dict(finished.attributes or {}) == {
        "kvconnect.router.instance": "http://b:1",
        "kvconnect.router.prompt_tokens": 128,
        "kvconnect.router.hit_tokens": 32,
        "kvconnect.router.computed_tokens": 96,
        "kvconnect.router.candidates": ("http://a:1", "http://b:1"),
        "kvconnect.router.candidate_costs": (40.0, 12.5),
        "kvconnect.router.pull_source": "http://a:1",
    }


def test_a_pd_request_sends_the_same_trace_context_to_prefill_and_decode(
    tmp_path: Path,
) -> None:
    """P/D (router/pd.py): the prefill request and the decode request each carry a
    `traceparent` of the client's trace whose parent is the router's one span, which names
    the prefill instance as the pull source."""
    p_port = free_port()
    details = "--enable-prompt-tokens-details"
    p = Serve(tmp_path, "--kv-transfer-config", peer_config(p_port, timeout_s=2.0), details)
    d = Serve(
        tmp_path,
        "--kv-transfer-config",
        peer_config(free_port(), (p_port,), timeout_s=2.0),
        details,
    )
    recorders: list[Recorder] = []
    receiver = Receiver()
    router = None
    try:
        for s in (p, d):
            s.start()
            recorders.append(Recorder(s))
        p_rec, d_rec = recorders
        env = {
            "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
            "OTEL_BSP_SCHEDULE_DELAY": "50",
        }
        router = start_router(
            tmp_path,
            [d_rec],
            "--prefill-instance",
            p_rec.instance,
            "--pd-min-tail",
            "64",
            "--otlp-traces-endpoint",
            receiver.endpoint,
            env=env,
        )
        status, body, _ = request(
            router.url + "/v1/completions",
            {"prompt": prompt(1), "max_tokens": 2, "temperature": 0},
            {"traceparent": TRACEPARENT},
        )
        assert status == 200, body
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 128  # D pulled P's
        span = receiver.next_span()
        assert span.trace_id.hex() == TRACE_ID and span.parent_span_id.hex() == CLIENT_SPAN
        got = attributes(span)
        assert got["kvconnect.router.instance"] == d_rec.url
        assert got["kvconnect.router.pull_source"] == p_rec.url
        for rec in (p_rec, d_rec):
            sent = rec.posted.get(timeout=10)["traceparent"]
            assert parent_of(sent) == (TRACE_ID, span.span_id.hex())
        nothing_else_posted(recorders)
    finally:
        if router is not None:
            assert router.stop() == 0, router.logs()
        receiver.shutdown()
        for r in recorders:
            r.shutdown()
        for s in (p, d):
            if s.proc is not None:
                assert s.stop() == 0, s.logs()

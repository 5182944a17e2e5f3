"""What the router's tracing costs per request, beside the router untraced and the backend
alone, in the same run.

Prints one line: over a backend that answers at once (bench/_stub_backend.py, so the engine's
time does not hide the router's), the time `kvconnect router` adds per request, p50/p99,
non-streamed and to the first streamed byte, and its CPU per request: untraced (the default:
no OpenTelemetry imported, no span made) and with `--otlp-traces-endpoint` (a span per
request, exported over OTLP/HTTP to a receiver in this process that answers at once), the
routers' requests interleaved with direct ones (bench/routers.py's `front_cost`). With
KVCONNECT_BENCH_BEFORE=DIR (a checkout of another commit), that tree's router runs beside
them, untraced: what the tracing hooks cost when off.
"""

from __future__ import annotations

import http.server
import os
import sys
import threading
from typing import Any

try:  # run as `python bench/router_tracing.py`
    import routers
except ImportError:  # imported as bench.router_tracing
    from bench import routers


class _Sink(http.server.BaseHTTPRequestHandler):
    """An OTLP/HTTP receiver that takes every export and answers at once."""

    protocol_version = "HTTP/1.1"
    spans_bytes = 0

    def do_POST(self) -> None:
        _Sink.spans_bytes += len(self.rfile.read(int(self.headers["Content-Length"])))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


def main() -> None:
    sink = http.server.ThreadingHTTPServer(("127.0.0.1", routers.free_port()), _Sink)
    threading.Thread(target=sink.serve_forever, daemon=True).start()
    endpoint = f"http://127.0.0.1:{sink.server_address[1]}/v1/traces"
    ps = routers.Processes()
    try:
        stub_port = routers.free_port()
        stub = f"http://127.0.0.1:{stub_port}"
        ps.start([sys.executable, str(routers.STUB), str(stub_port)], "stub", stub)
        events = routers.free_port((0, 10000))  # the stub publishes nothing
        instance = f"{stub},tcp://127.0.0.1:{events},tcp://127.0.0.1:{events + 10000}"
        kinds = {
            "untraced": ([], {}),
            "traced": (
                ["--otlp-traces-endpoint", endpoint],
                {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"},
            ),
        }
        before = os.environ.get("KVCONNECT_BENCH_BEFORE")
        if before:
            kinds["before"] = ([], {"PYTHONPATH": before})
        fronts: dict[str, tuple[str, int]] = {}
        for name, (extra, env) in kinds.items():
            port = routers.free_port()
            args = [sys.executable, "-m", "kvconnect.cli", "router", "--model", "tiny"]
            args += ["--port", str(port), "--instance", instance, *extra]
            url = f"http://127.0.0.1:{port}"
            fronts[name] = (url, ps.start(args, name, url, env=env or None).pid)
        cost = routers.front_cost(fronts, stub)
    finally:
        ps.stop()
        sink.shutdown()
    exported = "spans exported" if _Sink.spans_bytes else "NO SPANS EXPORTED"
    print(
        f"router tracing ({routers.FRONT_REQUESTS} requests per router and mode, added over "
        f"an instant backend, p50/p99): {cost}; {exported} ({_Sink.spans_bytes} bytes)"
    )


if __name__ == "__main__":
    main()

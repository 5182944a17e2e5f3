"""`kvconnect router` in front of an instance that takes a request and then stalls (a real
router process; the instance is a small HTTP server of this test that answers its health
checks and never its completions): the client gets a 504 after --upstream-timeout, the
router closes the stalled connection, and the instance leaves rotation until its health
check answers again, as after any failed forward."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tests.helpers import free_port
from tests.serve.test_limits import metric, wait_for
from tests.serving import RouterProcess, post

pytestmark = pytest.mark.slow


class StallingInstance:
    """/health: 200. POST: read, then nothing until the router closes the connection."""

    def __init__(self) -> None:
        self.received = threading.Event()
        self.closed = threading.Event()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self.send_response(200)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"{}")

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers["Content-Length"]))
                outer.received.set()
                self.rfile.read(1)  # b"" once the router closes its end
                outer.closed.set()
                self.close_connection = True

            def log_message(self, *args: object) -> None:
                pass

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.http.daemon_threads = True
        threading.Thread(target=self.http.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"
        self.instance = f"{self.url},tcp://127.0.0.1:{free_port()}"  # a stream nobody sends on

    def stop(self) -> None:
        self.http.shutdown()
        self.http.server_close()


@pytest.fixture(scope="module")
def stalled(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[StallingInstance, RouterProcess]]:
    tmp: Path = tmp_path_factory.mktemp("stall")
    instance = StallingInstance()
    router = RouterProcess(tmp, [instance], "--upstream-timeout", "1")  # type: ignore[list-item]
    try:
        router.start()
        yield instance, router
    finally:
        router.stop()
        instance.stop()


def test_a_stalled_instance_is_a_504_its_connection_closed_and_it_leaves_rotation(
    stalled: tuple[StallingInstance, RouterProcess],
) -> None:
    instance, router = stalled
    up = f'kvconnect_router_instance_up{{instance="{instance.url}"}}'
    failures = f'kvconnect_router_forward_failures_total{{instance="{instance.url}"}}'
    wait_for(lambda: metric(router.url, up) == 1, "the instance in rotation")
    status, answer, _ = post(router.url + "/v1/completions", {"prompt": "p", "max_tokens": 1})
    assert status == 504, answer
    assert answer["error"]["type"] == "timeout"
    assert instance.received.is_set()
    assert instance.closed.wait(10)  # the router gave up on it: the instance can stop too
    assert metric(router.url, failures) == 1  # marked failing, as a refused forward is
    wait_for(lambda: metric(router.url, up) == 1, "back once its health check answers")

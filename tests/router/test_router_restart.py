"""Router replicas and restarts (issue 33, item 5): a replica that starts, or is killed and
started again, while traffic flows decides from the whole index from its first request.

Two `kvconnect serve` instances, each holding two known prompts in its cpu tier; replica A
routes a steady stream of new prompts meanwhile. Replica B reads the instances' replay sockets
through a relay that holds every answer back for a while (a big snapshot on a slow link): its
first requests, sent while it is still catching up, wait for the state, go to the holders,
and B counts no decision made unsynced. Without the wait they went by load alone.
"""

from __future__ import annotations

import asyncio
import random
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import wait_for
from tests.router.test_router_pulls import complete, metrics, value
from tests.serving import RouterProcess, Serve, get, post, serving

pytestmark = pytest.mark.slow

HOLD_S = 1.5
"""How long the relay holds a replay answer back (under the subscriber's 2 s stall limit)."""


def prompt(seed: int, n: int = 160) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


class SlowRelay:
    """Loopback TCP relays to `targets`: what a target answers reaches the client only
    HOLD_S after the connection opened. On a thread of its own; `ports` are where it listens."""

    def __init__(self, targets: list[int]) -> None:
        self.targets = targets
        self.ports: list[int] = []
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()
        assert self._ready.wait(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        for target in self.targets:
            server = self._loop.run_until_complete(
                asyncio.start_server(lambda r, w, t=target: self._relay(r, w, t), "127.0.0.1", 0)
            )
            self.ports.append(server.sockets[0].getsockname()[1])
        self._ready.set()
        self._loop.run_forever()

    async def _relay(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, target: int
    ) -> None:
        opened = self._loop.time()
        try:
            up_r, up_w = await asyncio.open_connection("127.0.0.1", target)
        except OSError:
            writer.close()
            return

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter, hold: bool) -> None:
            try:
                while data := await src.read(65536):
                    if hold:
                        await asyncio.sleep(max(0.0, opened + HOLD_S - self._loop.time()))
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                dst.close()

        await asyncio.gather(pipe(reader, up_w, False), pipe(up_r, writer, True))

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)


class SlowReplayRouter(RouterProcess):
    """A router reading each instance's replay socket through `relay`."""

    def __init__(self, tmp: Path, instances: list[Serve], relay: SlowRelay) -> None:
        super().__init__(tmp, instances)
        self.relay = relay

    def command(self) -> list[str]:
        args = ["router", "--model", "tiny", "--port", str(self.port)]
        for s, port in zip(self.instances, self.relay.ports, strict=True):
            url, events, _ = s.instance.split(",")
            args += ["--instance", f"{url},{events},tcp://127.0.0.1:{port}"]
        return args


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, list[Serve]]]:
    tmp = tmp_path_factory.mktemp("replicas")
    config = (
        '{"kv_connector": "OffloadConnector", "kv_role": "kv_both", "kv_connector_extra_config":'
        ' {"chunk_size": 32, "tiers": [{"kind": "cpu", "max_bytes": 67108864}]}}'
    )
    details = "--enable-prompt-tokens-details"
    with serving([Serve(tmp, "--kv-transfer-config", config, details) for _ in range(2)]) as s:
        yield tmp, s


def traffic(url: str, stop: threading.Event) -> threading.Thread:
    """New prompts through `url`, one after another, until `stop`: events keep flowing."""

    def run() -> None:
        seed = 1000
        while not stop.is_set():
            seed += 1
            complete(url, prompt(seed, 96), max_tokens=2)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def route(url: str, seed: int, answers: dict[int, str]) -> None:
    answers[seed] = complete(url, prompt(seed), max_tokens=2)[2]


def test_a_replica_started_under_load_decides_from_the_whole_index(
    pair: tuple[Path, list[Serve]],
) -> None:
    tmp, servers = pair
    held = {seed: servers[seed % 2].url for seed in range(4)}  # two prompts per instance
    for seed, url in held.items():
        complete(url, prompt(seed), max_tokens=2)
    a = RouterProcess(tmp, servers)
    a.start()
    relay = SlowRelay([s.port + 20000 for s in servers])
    b = SlowReplayRouter(tmp, servers, relay)
    stop = threading.Event()
    try:

        def credited() -> bool:
            for seed, url in held.items():
                _, body, _ = post(a.url + "/kv/score", {"prompt": prompt(seed)})
                if body["instances"][url]["cached_tokens"] < 160:
                    return False
            return True

        wait_for(credited, timeout=30, what="replica A credits each holder")
        flowing = traffic(a.url, stop)
        for start in range(2):  # a first start, then a restart after a kill
            b.start()
            _, health = get(b.url + "/health")
            assert not all(i["synced"] for i in health["instances"].values()), health
            answers: dict[int, str] = {}
            threads = [threading.Thread(target=route, args=(b.url, seed, answers)) for seed in held]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            assert answers == held, f"start {start}: {answers}"
            text = metrics(b.url)
            assert value(text, "kvconnect_router_decisions_unsynced_total") == 0, text
            assert value(text, "kvconnect_router_synced_instances") == 2, text
            b.kill()
        stop.set()
        flowing.join(60)
    finally:
        stop.set()
        b.kill()
        a.stop()
        relay.close()

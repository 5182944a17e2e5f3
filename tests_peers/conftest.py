"""The peer suite's session: kvconnect instances and the two routers nobody here wrote, reading
their KV event streams.

Run with kvconnect's own venv (`make test-peers`); the peers' venvs come from `env.sh` in
$KVCONNECT_PEERS_DIR (default .peers):

    bash tests_peers/env.sh .peers
    KVCONNECT_PEERS_DIR=.peers .venv/bin/python -m pytest tests_peers

Started once per session, in this order, all on loopback:

    A  kvconnect serve, GPU only          the stores, extensions and removals
    C  kvconnect serve + a cpu tier       tier credit, host memory
    D  kvconnect serve + a disk tier      tier credit, disk
    R  kvconnect serve + a redis tier     tier credit, a shared store (redis-server on a free
                                          port, kvconnect's own LocalRedis)
    E  a kvconnect engine in this process AllBlocksCleared (serve has no HTTP reset)
    vllm-router 0.1.17 --policy kv_aware  workers A, C, D, R and E (below), events and replay
    Dynamo's standalone indexer           workers 1=A, 2=C, 3=D, 4=R, 9=E

Each instance has 16 GPU blocks, so a handful of new prompts evicts a prompt's blocks. HTTP ports
are free ports checked by binding; an instance on HTTP port P publishes on P+10000 and replays on
P+20000, all three checked.

How Dynamo is networked. Its indexer binds its HTTP port on every interface (0.0.0.0:8090) and
has no host option, so it runs in a network namespace of its own (`unshare --net`), where the
only interface is loopback (brought up first: a new namespace's loopback starts down). From
there it cannot reach a TCP port of the root namespace, where the instances, vllm-router and
this process live. A Unix socket is a file, and files cross network namespaces, so the suite
bridges with Unix sockets, byte for byte (`relay.py`):

    root namespace                                      Dynamo's namespace
    kvconnect PUB tcp://127.0.0.1:P+10000
      <- relay.py: listens on WORKDIR/ev-NAME  <-------- SUB ipc://WORKDIR/ev-NAME (--workers)
    this process: HTTP over WORKDIR/dynamo-http -------> relay.py -> 127.0.0.1:8090 (its HTTP)

Dynamo's ZMQ subscriber accepts ipc:// addresses, and ZMTP (ZMQ's wire protocol) is the same
over ipc and tcp, so it holds a real ZMQ session with kvconnect's own PUB socket, frames
unchanged. vllm-router, which needs tcp://HOST:PORT sources (it refuses ipc://), reads the same
PUB sockets directly. So both peers read the very same streams, and only Dynamo is walled in.
(The alternative, kvconnect's instances inside Dynamo's namespace too, would wall in the
instances and vllm-router as well and need a relay for every HTTP port the tests use.)

(`unshare --net` needs root, as CI is; another user gets `unshare --map-root-user --net`.)

The in-process engine E has no HTTP front, and vllm-router takes a worker only with one, so E's
stream is given to vllm-router as the stream of worker http://localhost:PORT_A, a second name of
instance A. What vllm-router credits to that worker comes from E's stream alone; what it routes
there is served (or, a probe, refused) by A.

Startup is readiness by events: each instance's /health, vllm-router's "Router ready", Dynamo's
/health and active listeners, then every publisher counting three subscriptions (this process's,
vllm-router's, Dynamo's), so no event of a test is missed by anyone.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvconnect.commands.redis_server import LocalRedis
from tests_peers.instances import Engine, Instance, Streams
from tests_peers.lab import Lab
from tests_peers.peers import Dynamo, VllmRouter
from tests_peers.support import Proc, free_port, wait_for

LOGS = Path(tempfile.gettempdir()) / "kvconnect-peers-logs"
DYNAMO_IDS = {"a": 1, "c": 2, "d": 3, "r": 4, "engine": 9}


@pytest.fixture(scope="session")
def peers_dir() -> Path:
    path = Path(os.environ.get("KVCONNECT_PEERS_DIR", ".peers")).resolve()
    for venv in ("vllm-router", "dynamo"):
        if not (path / venv / ".kvconnect-peers-stamp").is_file():
            pytest.fail(f"no peer venv {path / venv}: run `bash tests_peers/env.sh {path}`")
    for tool, why in [
        ("unshare", "Dynamo's indexer runs in a network namespace of its own (util-linux)"),
        ("ip", "the namespace's loopback must be brought up (iproute2)"),
        ("redis-server", "the redis tier needs one (`make redis-server` installs it)"),
    ]:
        if shutil.which(tool) is None:
            pytest.fail(f"no {tool}: {why}")
    return path


@pytest.fixture(scope="session")
def lab(peers_dir: Path) -> Iterator[Lab]:
    workdir = Path(tempfile.mkdtemp(prefix="kvc-peers-"))
    redis = LocalRedis(port=free_port())
    a = Instance("a", workdir)
    c = Instance("c", workdir, tiers=[{"kind": "cpu", "max_bytes": 64 << 20}])
    d = Instance(
        "d", workdir, tiers=[{"kind": "disk", "path": str(workdir / "disk"), "max_bytes": 64 << 20}]
    )
    r = Instance("r", workdir, tiers=[{"kind": "redis", "url": redis.url}])
    instances = [a, c, d, r]
    stoppable: list[Instance | Engine | Proc | VllmRouter | Dynamo | Streams | LocalRedis]
    stoppable = [redis]
    try:
        for inst in instances:
            inst.start()
            stoppable.append(inst)
        engine = Engine()  # while the instances start
        stoppable.append(engine)
        for inst in instances:
            inst.wait()
        streams = Streams({i.name: i.events for i in instances} | {"engine": engine.events})
        stoppable.append(streams)

        relay_pairs = [f"{workdir}/ev-{i.name}={i.port + 10000}" for i in instances]
        relay_pairs.append(f"{workdir}/ev-engine={engine.events.rsplit(':', 1)[1]}")
        relay = Proc.start(
            [sys.executable, str(Path(__file__).with_name("relay.py")), *relay_pairs],
            workdir / "relay.log",
        )
        stoppable.append(relay)
        wait_for("the relay", lambda: True if "ready" in relay.tail() else None)

        engine_url = f"http://localhost:{a.port}"
        sources = {i.url: (i.events, i.replay) for i in instances}
        sources[engine_url] = (engine.events, engine.replay)
        router = VllmRouter(peers_dir / "vllm-router", sources, workdir)
        stoppable.append(router)
        workers = {wid: f"ipc://{workdir}/ev-{name}" for name, wid in DYNAMO_IDS.items()}
        dynamo = Dynamo(peers_dir / "dynamo", workers, workdir)
        stoppable.append(dynamo)

        router.wait_ready()
        dynamo.wait_ready(len(workers))
        publishers: list[Instance | Engine] = [*instances, engine]
        for publisher in publishers:  # this process, vllm-router, Dynamo
            publisher.wait_for_subscribers(3)
        yield Lab(a, c, d, r, engine, streams, router, dynamo, engine_url, DYNAMO_IDS)
    finally:
        for part in reversed(stoppable):
            part.stop()
        LOGS.mkdir(exist_ok=True)
        for log in workdir.glob("*.log"):  # kept for a failure's post-mortem
            shutil.copy(log, LOGS / log.name)
        shutil.rmtree(workdir, ignore_errors=True)

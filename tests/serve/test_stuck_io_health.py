"""`/health` says when the offload connector's I/O is stuck (issue 46, item 2): a real
`kvconnect serve` whose disk tier's chunk files are swapped for named pipes (a read of one
blocks as a hung network disk does). A request needing them waits on the I/O thread; past
`stuck_after_s` /health answers 503 naming why, and once the pipes give way (the read fails:
the chunks are recomputed) it answers 200 again and the request its usual answer. The step
thread never waited: another tenant's prompt runs meanwhile."""

from __future__ import annotations

import json
import os
import random
import stat
import threading
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import wait_for
from tests.serving import Serve, get, post

pytestmark = pytest.mark.slow

CHUNK = 32
CHUNK_BYTES = 4 * 2 * CHUNK * 4 * 32 * 4  # tiny: layers, K/V, tokens, KV heads, dim, fp32


def prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(150)]


def complete(server: Serve, tokens: list[int]) -> str:
    status, body, _ = post(
        server.url + "/v1/completions",
        {"model": "tiny", "prompt": tokens, "max_tokens": 4, "temperature": 0},
    )
    assert status == 200, body
    text: str = body["choices"][0]["text"]
    return text


def test_health_says_when_the_io_thread_is_stuck_and_the_step_never_waits(
    tmp_path: Path,
) -> None:
    disk = tmp_path / "disk"
    extra: dict[str, Any] = {
        "chunk_size": CHUNK,
        "stuck_after_s": 1.0,
        "tiers": [
            {"kind": "cpu", "max_bytes": 4 * CHUNK_BYTES},
            {"kind": "disk", "path": str(disk), "max_bytes": 64 * CHUNK_BYTES},
        ],
    }
    transfer = {"kv_connector": "OffloadConnector", "kv_role": "kv_both"}
    spec = json.dumps({**transfer, "kv_connector_extra_config": extra})
    server = Serve(tmp_path, "--kv-transfer-config", spec, "--num-kv-blocks", "40")
    server.start()
    try:
        held = prompt(1)
        expected = complete(server, held)
        for seed in range(2, 7):  # pushes `held` to disk, and out of the engine's own cache
            complete(server, prompt(seed))
        files = lambda: sorted(disk.rglob("*.kvchunk"))  # noqa: E731
        wait_for(lambda: len(files()) >= 8, timeout=30, what="chunks on disk")
        for f in files():  # each read of one now blocks until someone writes to it
            f.unlink()
            os.mkfifo(f, 0o600)
        answers: list[str] = []
        waiting = threading.Thread(target=lambda: answers.append(complete(server, held)))
        waiting.start()

        def stalled() -> bool:
            status, body = get(server.url + "/health")
            return status == 503 and body["status"] == "stalled"

        wait_for(stalled, timeout=30, what="/health saying the I/O is stuck")
        _, body = get(server.url + "/health")
        assert "rank 0's I/O has run one job for" in body["error"], body
        assert complete(server, prompt(50))  # the step thread never waits on it
        assert waiting.is_alive()

        def give_way() -> bool:  # each blocked open returns, and its read finds no chunk
            for f in files():
                if stat.S_ISFIFO(f.lstat().st_mode):
                    try:
                        fd = os.open(f, os.O_WRONLY | os.O_NONBLOCK)
                    except OSError:
                        continue  # no reader on this one (yet)
                    os.close(fd)
            return not waiting.is_alive()

        wait_for(give_way, timeout=60, what="the waiting request answered")
        assert answers == [expected]  # its chunks recomputed
        wait_for(lambda: get(server.url + "/health")[0] == 200, timeout=30, what="health back")
    finally:
        assert server.stop() == 0, server.logs()

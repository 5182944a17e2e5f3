"""`kvconnect serve` on its own: idle steps publish what the offload tiers finished."""

import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from kvconnect.cluster import wait_healthy
from kvconnect.events import BlockStored
from kvconnect.subscriber import KVEventSubscriber, ReceivedBatch
from tests.helpers import free_port

pytestmark = pytest.mark.slow


def test_idle_engine_publishes_background_stores_without_more_traffic(tmp_path: Path) -> None:
    port = free_port()
    events = {"enable_kv_cache_events": True, "endpoint": f"ipc://{tmp_path}/ev"}
    transfer = {
        "kv_connector": "OffloadConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "chunk_size": 32,
            "tiers": [{"kind": "cpu", "max_bytes": 1 << 24}],
        },
    }
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvconnect.cli",
            "serve",
            "--model",
            "tiny",
            "--port",
            str(port),
            "--kv-events-config",
            json.dumps(events),
            "--kv-transfer-config",
            json.dumps(transfer),
        ]
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, timeout=120)
        sub = KVEventSubscriber(f"ipc://{tmp_path}/ev", start_seq=0)
        body = json.dumps({"prompt": "y" * 70, "max_tokens": 1}).encode()
        urllib.request.urlopen(
            urllib.request.Request(url + "/v1/completions", data=body), timeout=60
        ).read()
        media = []
        end = time.monotonic() + 10
        while media.count("CPU") < 2 and time.monotonic() < end:
            item = sub.recv(timeout=0.5)
            if isinstance(item, ReceivedBatch):
                media += [e.medium for e in item.batch.events if isinstance(e, BlockStored)]
        sub.close()
        assert media.count("CPU") == 2  # two 32-token chunks, announced with no new request
    finally:
        proc.terminate()
        proc.wait(timeout=15)

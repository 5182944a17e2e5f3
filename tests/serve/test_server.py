"""`kvconnect serve` on its own: idle steps publish what the offload tiers finished."""

import json
import time
from pathlib import Path

import pytest

from kvconnect.events import BlockStored
from kvconnect.stream.subscriber import KVEventSubscriber, ReceivedBatch
from tests.serving import Serve, post

pytestmark = pytest.mark.slow


def test_idle_engine_publishes_background_stores_without_more_traffic(tmp_path: Path) -> None:
    transfer = {
        "kv_connector": "OffloadConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "chunk_size": 32,
            "tiers": [{"kind": "cpu", "max_bytes": 1 << 24}],
        },
    }
    server = Serve(tmp_path, "--kv-transfer-config", json.dumps(transfer))
    server.start()
    events, replay = server.instance.split(",")[1:]
    sub = KVEventSubscriber(events, replay, start_seq=0)
    try:
        status, body, _ = post(
            server.url + "/v1/completions", {"prompt": "y" * 70, "max_tokens": 1}
        )
        assert status == 200, body
        media: list[str] = []
        end = time.monotonic() + 10
        while media.count("CPU") < 2 and time.monotonic() < end:
            item = sub.recv(timeout=0.5)
            if isinstance(item, ReceivedBatch):
                media += [e.medium for e in item.batch.events if isinstance(e, BlockStored)]
        assert media.count("CPU") == 2  # two 32-token chunks, announced with no new request
    finally:
        sub.close()
        assert server.stop() == 0, server.logs()

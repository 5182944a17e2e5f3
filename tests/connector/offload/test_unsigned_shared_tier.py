"""A shared tier without `hmac_key_file` takes any chunk whose header checks out, and anyone who
can write to the Redis can make one: `kvconnect serve` (a real process, a real redis-server)
says so once at start, in a WARNING, and says nothing when the tier is signed."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kvconnect.commands.redis_server import LocalRedis
from tests.serving import Serve

pytestmark = pytest.mark.slow

WARNING = "anyone who can write to the Redis can feed this instance KV"


def serve_with_redis(tmp: Path, store: LocalRedis, **tier: object) -> str:
    """The log of `kvconnect serve --model tiny` with a redis tier, from start to a clean stop."""
    transfer = {
        "kv_connector": "OffloadConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "tiers": [{"kind": "redis", "url": store.url, "watch": False, **tier}]
        },
    }
    server = Serve(tmp, "--kv-transfer-config", json.dumps(transfer))
    server.start()
    assert server.stop() == 0, server.logs()
    return server.log.read_text(errors="replace")


def test_an_unsigned_redis_tier_is_one_warning_at_start(
    tmp_path: Path, fresh_redis: LocalRedis
) -> None:
    warnings = [
        line for line in serve_with_redis(tmp_path, fresh_redis).splitlines() if WARNING in line
    ]
    assert len(warnings) == 1, warnings
    assert " WARNING " in warnings[0] and "hmac_key_file" in warnings[0], warnings[0]


def test_a_signed_redis_tier_is_no_warning(tmp_path: Path, fresh_redis: LocalRedis) -> None:
    key = tmp_path / "hmac.key"
    fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(os.urandom(32).hex().encode())
    log = serve_with_redis(tmp_path, fresh_redis, hmac_key_file=str(key))
    assert WARNING not in log, log

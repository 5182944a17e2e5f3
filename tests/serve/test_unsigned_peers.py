"""A peer config with no secret to sign with takes whatever a configured source's port serves
under the right tokens, and serves its chunks to whoever connects: `kvconnect serve` says so
once at start, in a WARNING; a key anywhere in the offload config (the peer's, or a tier's,
the same deployment secret) signs peer traffic and silences it."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import free_port
from tests.serving import Serve

pytestmark = pytest.mark.slow

WARNING = "anything that answers on a source's port can feed it KV"


def key_file(tmp: Path) -> str:
    path = tmp / "hmac.key"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(os.urandom(32).hex().encode())
    return str(path)


def start_log(tmp: Path, peer: dict[str, Any], disk: dict[str, Any] | None = None) -> str:
    tiers: list[dict[str, Any]] = [{"kind": "cpu", "max_bytes": 1 << 24}]
    if disk is not None:
        tiers.append({"kind": "disk", "path": str(tmp / "disk"), **disk})
    extra = {"chunk_size": 32, "tiers": tiers, "peer": {"port": free_port(), **peer}}
    transfer = {"kv_connector": "OffloadConnector", "kv_role": "kv_both"}
    server = Serve(
        tmp, "--kv-transfer-config", json.dumps({**transfer, "kv_connector_extra_config": extra})
    )
    server.start()
    assert server.stop() == 0, server.logs()
    return server.log.read_text(errors="replace")


def test_an_unsigned_peer_config_is_one_warning_at_start(tmp_path: Path) -> None:
    warnings = [line for line in start_log(tmp_path, {}).splitlines() if WARNING in line]
    assert len(warnings) == 1, warnings
    assert " WARNING " in warnings[0] and "peer.hmac_key_file" in warnings[0], warnings[0]


@pytest.mark.parametrize("where", ["peer", "tier"])
def test_a_key_anywhere_in_the_offload_config_signs_peer_traffic(
    tmp_path: Path, where: str
) -> None:
    key = key_file(tmp_path)
    if where == "peer":
        log = start_log(tmp_path, {"hmac_key_file": key})
    else:
        log = start_log(tmp_path, {}, disk={"hmac_key_file": key})
    assert WARNING not in log, log

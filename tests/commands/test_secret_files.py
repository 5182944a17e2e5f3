"""Secret files (a CURVE secret key, a tier's `hmac_key_file` and `password_file`) that group or
others may read or write are refused, as ssh refuses such a key: by `kvconnect serve` and
`kvconnect router` (real processes) at start, in one line naming the file and its mode."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
import zmq.auth

from kvconnect.config import check_secret_mode
from tests.helpers import free_port
from tests.serving import Process, Serve

pytestmark = pytest.mark.slow


def certificates(tmp: Path, mode: int) -> tuple[str, str, str]:
    """(server.key, server.key_secret, client.key_secret), the secret ones at `mode`."""
    public, server_secret = zmq.auth.create_certificates(tmp, "server")
    _, client_secret = zmq.auth.create_certificates(tmp, "client")
    for path in (server_secret, client_secret):
        os.chmod(path, mode)
    return public, server_secret, client_secret


def refusal(proc: Process) -> str:
    """The one error line `proc` exits with (status 2) instead of becoming ready."""
    return proc.refusal(timeout=120)


def serve_with_curve(tmp: Path, secret_key_file: str) -> Serve:
    events = {"enable_kv_cache_events": True, "curve_secret_key_file": secret_key_file}
    return Serve(tmp, "--kv-events-config", json.dumps(events))


def test_serve_refuses_a_curve_secret_key_others_can_read(tmp_path: Path) -> None:
    _, server_secret, _ = certificates(tmp_path, 0o644)
    line = refusal(serve_with_curve(tmp_path, server_secret))
    assert server_secret in line and "mode 0644" in line and "chmod 600" in line, line
    os.chmod(server_secret, 0o600)
    server = serve_with_curve(tmp_path, server_secret)
    server.start()
    assert server.stop() == 0, server.logs()


def test_the_router_refuses_a_client_secret_key_others_can_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    public, _, client_secret = certificates(tmp_path, 0o620)
    monkeypatch.setenv("KVCONNECT_EVENTS_CURVE_SERVER_KEY", public)
    monkeypatch.setenv("KVCONNECT_EVENTS_CURVE_CLIENT_KEY", client_secret)

    def router() -> Process:
        port = free_port()
        instance = f"http://127.0.0.1:{free_port()},tcp://127.0.0.1:{free_port()}"
        argv = ["router", "--model", "tiny", "--port", str(port), "--instance", instance]
        return Process(argv, tmp_path / f"router-{port}.log")

    line = refusal(router())
    assert client_secret in line and "mode 0620" in line, line
    os.chmod(client_secret, 0o600)
    proc = router()
    proc.start(timeout=60)
    assert proc.stop() == 0, proc.logs()


def test_serve_refuses_an_hmac_key_file_its_group_can_read(tmp_path: Path) -> None:
    key = tmp_path / "hmac.key"
    key.write_text(os.urandom(32).hex())
    key.chmod(0o640)
    transfer = {
        "kv_connector": "OffloadConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "tiers": [{"kind": "disk", "path": str(tmp_path / "kv"), "hmac_key_file": str(key)}]
        },
    }
    line = refusal(Serve(tmp_path, "--kv-transfer-config", json.dumps(transfer)))
    assert str(key) in line and "mode 0640" in line, line


@pytest.mark.parametrize("mode", [0o400, 0o600, 0o700])
def test_a_mode_for_the_owner_alone_is_accepted(mode: int) -> None:
    check_secret_mode("k", stat.S_IFREG | mode)


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o620, 0o602, 0o610, 0o601, 0o666])
def test_any_group_or_other_bit_is_refused_naming_file_and_mode(mode: int) -> None:
    with pytest.raises(ValueError, match=rf"^secret\.key is mode 0{mode:o}: a secret file"):
        check_secret_mode("secret.key", stat.S_IFREG | mode)

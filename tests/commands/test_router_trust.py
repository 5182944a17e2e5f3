"""`kvconnect router` (a real process) refuses at start what would leak a key: an instance it
could reach only in plaintext although its URL asks for TLS, and an instance key presented on
behalf of clients that nobody authenticates (an open relay). Each refusal is one line and exit
status 2, before the router serves anything."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvconnect.router.instances import Instance
from tests.helpers import free_port
from tests.serving import Process

EVENTS = "tcp://127.0.0.1:1"


def router(tmp: Path, *args: str) -> Process:
    """`kvconnect router --model tiny ARGS` on a free port, not started yet."""
    port = free_port()
    return Process(["router", "--model", "tiny", "--port", str(port), *args], tmp / f"{port}.log")


def refusal(tmp: Path, *args: str) -> str:
    """The one line `kvconnect router ARGS` exits with (status 2) instead of serving."""
    proc = router(tmp, *args)
    line = proc.refusal(timeout=60)
    assert [line] == [x for x in proc.logs().splitlines() if x.strip()], proc.logs()
    assert line.startswith("kvconnect router: error: "), line
    return line


@pytest.fixture(autouse=True)
def no_keys_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("KVCONNECT_API_KEY", "KVCONNECT_INSTANCE_API_KEY", "KVCONNECT_ADMIN_TOKEN"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("url", ["https://127.0.0.1:8443", "https://example.test", "ftp://h:1"])
def test_an_instance_that_is_not_http_is_refused_never_reached_in_plaintext(
    tmp_path: Path, url: str
) -> None:
    line = refusal(tmp_path, "--instance", f"{url},{EVENTS}")
    assert "--instance" in line and url in line, line
    assert "TLS to instances is not supported yet" in line, line


def test_an_http_instance_without_a_port_is_port_80() -> None:
    assert Instance.parse(f"http://10.0.0.1,{EVENTS}").port == 80
    assert Instance.parse(f"http://10.0.0.1:8001/,{EVENTS}").port == 8001
    with pytest.raises(ValueError, match=r"--instance.*99999"):
        Instance.parse(f"http://10.0.0.1:99999,{EVENTS}")


def test_an_instances_peer_tier_is_host_and_port_or_refused_naming_it() -> None:
    assert Instance.parse(f"http://10.0.0.1:8001,{EVENTS},peer=10.0.0.1:7100").peer == (
        "10.0.0.1",
        7100,
    )
    assert Instance.parse(f"http://h:1,{EVENTS},peer=[::1]:7100").peer == ("::1", 7100)
    assert Instance.parse(f"http://10.0.0.1:8001,{EVENTS}").peer is None
    for bad in ("nohost", ":7100", "h:99999", "h:x"):
        with pytest.raises(ValueError, match=rf"--instance .*peer='{re.escape(bad)}' is not HOST"):
            Instance.parse(f"http://10.0.0.1:8001,{EVENTS},peer={bad}")


def test_an_instance_key_without_a_client_key_is_refused_unless_allowed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    instance = f"http://127.0.0.1:{free_port()},{EVENTS}"
    line = refusal(tmp_path, "--instance", instance, "--instance-api-key", "k" * 16)
    for name in ("--instance-api-key", "--api-key", "--allow-unauthenticated"):
        assert name in line, line
    monkeypatch.setenv("KVCONNECT_INSTANCE_API_KEY", "k" * 16)  # the same from the environment
    assert "--allow-unauthenticated" in refusal(tmp_path, "--instance", instance)
    for extra in (["--allow-unauthenticated"], ["--api-key", "client-key"]):
        proc = router(tmp_path, "--instance", instance, *extra)
        proc.start(timeout=60)
        assert proc.stop() == 0, proc.logs()

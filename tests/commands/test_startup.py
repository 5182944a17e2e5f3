"""`serve`'s KV event addresses: derived from its HTTP port, or all the OS's when asked."""

from __future__ import annotations

import json

from kvconnect.commands.startup import events_config


def config_of(fields: dict[str, object], http_port: int = 8001) -> tuple[str, str | None, bool]:
    config = events_config(json.dumps({"enable_kv_cache_events": True, **fields}), http_port)
    assert config is not None
    return config.endpoint, config.replay_endpoint, config.binds_endpoint


def test_addresses_not_given_are_derived_from_the_http_port() -> None:
    assert config_of({}) == ("tcp://127.0.0.1:18001", "tcp://127.0.0.1:28001", True)


def test_a_port_zero_endpoint_makes_the_replay_port_the_oss_choice_too() -> None:
    assert config_of({"endpoint": "tcp://*:0"}) == ("tcp://*:0", "tcp://*:0", True)
    # a port 0 on a named host is bound too: nothing can be connected to on port 0
    assert config_of({"endpoint": "tcp://127.0.0.1:0"}) == (
        "tcp://127.0.0.1:0",
        "tcp://127.0.0.1:0",
        True,
    )


def test_a_given_replay_address_is_kept_beside_a_port_zero_endpoint() -> None:
    fields = {"endpoint": "tcp://*:0", "replay_endpoint": "tcp://127.0.0.1:5600"}
    assert config_of(fields) == ("tcp://*:0", "tcp://127.0.0.1:5600", True)

"""The `--instance` forms and the `/kv_event_sources` answers the router reads (no process:
the served ones are in test_router_discovery.py, vLLM's own in tests_vllm/test_events.py)."""

from __future__ import annotations

import json

import pytest

from kvconnect.router.discovery import Undiscovered, parse_instance, parse_sources
from kvconnect.router.instances import Instance
from kvconnect.stream.wire import KVEventSource, with_host

EVENTS = "tcp://127.0.0.1:18001"


def test_an_instance_url_alone_or_with_its_peer_is_to_be_discovered() -> None:
    assert parse_instance("http://10.0.0.1:8001/") == Undiscovered("http://10.0.0.1:8001")
    assert parse_instance("http://10.0.0.1:8001,peer=10.0.0.1:7100") == Undiscovered(
        "http://10.0.0.1:8001", ("10.0.0.1", 7100)
    )
    assert parse_instance(f"http://10.0.0.1:8001,{EVENTS},peer=h:7") == Instance(
        "http://10.0.0.1:8001", EVENTS, None, ("h", 7)
    )


@pytest.mark.parametrize(
    "spec", ["10.0.0.1:8001", "https://10.0.0.1", "http://h:1,peer=h", "http://h:1,x"]
)
def test_a_malformed_instance_is_refused_naming_it(spec: str) -> None:
    with pytest.raises(ValueError, match="--instance"):
        parse_instance(spec)


def test_vllms_list_is_read_in_rank_order() -> None:
    body = json.dumps(
        [
            {
                "data_parallel_rank": 1,
                "endpoint": "tcp://10.0.0.1:41002",
                "replay_endpoint": None,
                "topic": "kv",
            },
            {
                "data_parallel_rank": 0,
                "endpoint": "tcp://10.0.0.1:41001",
                "replay_endpoint": "tcp://10.0.0.1:41003",
                "topic": "kv",
                "future_field": 1,
            },
        ]
    ).encode()
    assert parse_sources(body) == [
        KVEventSource(0, "tcp://10.0.0.1:41001", "tcp://10.0.0.1:41003", "kv"),
        KVEventSource(1, "tcp://10.0.0.1:41002", None, "kv"),
    ]
    assert parse_sources(b"[]") == []


def test_vllm_032s_map_of_rank_to_config_is_read_and_a_null_publisher_skipped() -> None:
    config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": "tcp://*:5557",
        "replay_endpoint": "tcp://*:5558",
        "buffer_steps": 10000,
        "hwm": 100000,
        "max_queue_size": 100000,
        "topic": "",
    }
    body = json.dumps({"0": config, "1": {**config, "publisher": "null"}}).encode()
    assert parse_sources(body) == [KVEventSource(0, "tcp://*:5557", "tcp://*:5558", "")]
    assert parse_sources(b"{}") == []


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"nope", "not JSON"),
        (b'"x"', "expected a JSON list"),
        (b'[{"endpoint": "tcp://h:1"}]', "not a list of event sources"),
        (
            b'[{"data_parallel_rank": 0, "endpoint": "http://h:1", "replay_endpoint": null, '
            b'"topic": ""}]',
            "is not ZMQ",
        ),
        (b'{"x": {}}', "map of DP rank"),
    ],
)
def test_another_answer_is_refused_saying_why(body: bytes, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_sources(body)


def test_a_wildcard_host_becomes_the_one_given_and_others_stay() -> None:
    assert with_host("tcp://*:5557", "10.0.0.7") == "tcp://10.0.0.7:5557"
    assert with_host("tcp://0.0.0.0:5557", "::1") == "tcp://[::1]:5557"
    assert with_host("tcp://[::]:5557", "h") == "tcp://h:5557"
    assert with_host("tcp://10.0.0.1:5557", "h") == "tcp://10.0.0.1:5557"
    assert with_host("ipc:///tmp/kv", "h") == "ipc:///tmp/kv"

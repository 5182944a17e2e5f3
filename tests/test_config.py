import dataclasses
import json

import pytest

from kvconnect.config import KVEventsConfig, KVTransferConfig


def test_events_defaults_match_vllm_except_loopback_endpoint() -> None:
    c = KVEventsConfig()
    assert c.enable_kv_cache_events is False
    assert c.publisher == "null"
    assert c.endpoint == "tcp://127.0.0.1:5557"
    assert c.replay_endpoint is None
    assert (c.buffer_steps, c.hwm, c.max_queue_size, c.topic) == (10_000, 100_000, 100_000, "")
    assert [f.name for f in dataclasses.fields(c)] == [
        "enable_kv_cache_events",
        "publisher",
        "endpoint",
        "replay_endpoint",
        "buffer_steps",
        "hwm",
        "max_queue_size",
        "topic",
        "bind",
        "curve_secret_key_file",
        "snapshot_endpoint",
    ]
    assert c.snapshot_endpoint is None  # vLLM PR #57789's, off: today's wire
    assert c.curve_secret_key_file is None  # kvconnect only: plain unless a key file is named
    assert c.bind is True  # no endpoint given: the loopback default is bound


def test_publisher_resolves_to_zmq_when_enabled() -> None:
    assert KVEventsConfig(enable_kv_cache_events=True).publisher == "zmq"
    assert KVEventsConfig(enable_kv_cache_events=True, publisher="null").publisher == "null"
    assert KVEventsConfig(publisher="custom").publisher == "custom"


def test_events_from_vllm_cli_json() -> None:
    text = (
        '{"enable_kv_cache_events": true, "publisher": "zmq", "topic": "kv-events", '
        '"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558", "buffer_steps": 50}'
    )
    c = KVEventsConfig.from_json(text)
    assert c == KVEventsConfig(
        True, "zmq", "tcp://*:5557", "tcp://*:5558", 50, 100_000, 100_000, "kv-events"
    )
    assert c.bind is None and c.binds_endpoint  # vLLM's rule: `*` binds
    assert KVEventsConfig.from_dict(c.to_dict()) == c


def test_unknown_key_lists_valid_keys() -> None:
    with pytest.raises(ValueError) as e:
        KVEventsConfig.from_json('{"enable_kv_cache_events": true, "bufer_steps": 5}')
    msg = str(e.value)
    assert "'bufer_steps'" in msg and "buffer_steps" in msg and "replay_endpoint" in msg
    with pytest.raises(ValueError, match="kv_connector_extra_config"):
        KVTransferConfig.from_json('{"kv_conector": "X"}')


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("enable_kv_cache_events", "yes"),
        ("publisher", ""),
        ("endpoint", "http://127.0.0.1:1"),
        ("endpoint", "tcp://127.0.0.1"),
        ("endpoint", "tcp://127.0.0.1:99999"),
        ("replay_endpoint", "udp://x:1"),
        ("buffer_steps", 0),
        ("buffer_steps", True),
        ("hwm", -1),
        ("max_queue_size", 0),
        ("topic", 5),
    ],
)
def test_bad_event_values_name_field_and_value(field: str, value: object) -> None:
    with pytest.raises(ValueError) as e:
        KVEventsConfig(**{field: value})  # type: ignore[arg-type]
    assert field in str(e.value) and repr(value) in str(e.value)


def test_replay_endpoint_must_differ() -> None:
    with pytest.raises(ValueError, match="replay_endpoint"):
        KVEventsConfig(endpoint="tcp://*:1", replay_endpoint="tcp://*:1")


def test_not_json_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="not valid JSON"):
        KVEventsConfig.from_json("{enable")
    with pytest.raises(ValueError, match="JSON object"):
        KVEventsConfig.from_json("[1]")


def test_configs_are_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        KVEventsConfig().topic = "x"  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        KVTransferConfig().kv_role = "kv_both"  # type: ignore[misc]


def test_transfer_config_from_vllm_json() -> None:
    text = json.dumps(
        {
            "kv_connector": "OffloadConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"chunk_size": 256, "cpu": {"max_bytes": 1 << 30}},
            "kv_connector_module_path": "my.module",
            "engine_id": "e1",
        }
    )
    c = KVTransferConfig.from_json(text)
    assert c.kv_connector == "OffloadConnector" and c.engine_id == "e1"
    assert c.get_from_extra_config("chunk_size", 16) == 256
    assert c.get_from_extra_config("missing", 16) == 16
    assert c.is_kv_producer and c.is_kv_consumer
    assert KVTransferConfig.from_dict(c.to_dict()) == c


def test_transfer_engine_ids_are_filled_and_distinct() -> None:
    a, b = KVTransferConfig(), KVTransferConfig()
    assert a.engine_id and b.engine_id and a.engine_id != b.engine_id


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"kv_connector": "X"}, "kv_role"),
        ({"kv_connector": "X", "kv_role": "producer"}, "kv_role"),
        ({"kv_connector": ""}, "kv_connector"),
        ({"kv_parallel_size": 0}, "kv_parallel_size"),
        ({"kv_rank": -1}, "kv_rank"),
        ({"kv_port": "80"}, "kv_port"),
        ({"kv_buffer_size": -1.0}, "kv_buffer_size"),
        ({"kv_connector_extra_config": []}, "kv_connector_extra_config"),
        ({"kv_load_failure_policy": "ignore"}, "kv_load_failure_policy"),
    ],
)
def test_bad_transfer_values_name_field(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        KVTransferConfig(**kwargs)  # type: ignore[arg-type]


def test_consumer_only_role() -> None:
    c = KVTransferConfig(kv_connector="X", kv_role="kv_consumer")
    assert c.is_kv_consumer and not c.is_kv_producer
    assert not KVTransferConfig().is_kv_consumer

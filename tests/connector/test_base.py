import pytest

from kvconnect.config import KVTransferConfig
from kvconnect.connector import (
    KVConnectorContext,
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorRole,
    KVConnectorStats,
)
from kvconnect.connector.events import KVEventsWorkerMetadata
from tests.connector.helpers import FakeRequest, Recording, transfer_config


def test_output_is_empty_covers_every_field() -> None:
    assert KVConnectorOutput().is_empty()
    assert KVConnectorOutput(expected_finished_count=3).is_empty()
    assert KVConnectorOutput(kv_connector_stats=KVConnectorStats()).is_empty()
    for news in (
        KVConnectorOutput(finished_sending={"a"}),
        KVConnectorOutput(finished_recving={"a"}),
        KVConnectorOutput(invalid_block_ids={3}),
        KVConnectorOutput(kv_connector_stats=KVConnectorStats({"n": 1})),
        # A worker whose only news is its metadata must not look empty.
        KVConnectorOutput(kv_connector_worker_meta=KVEventsWorkerMetadata()),
    ):
        assert not news.is_empty()


def test_output_has_no_events_field() -> None:
    assert "kv_cache_events" not in KVConnectorOutput.__dataclass_fields__


def test_stats_merge_reduce_reset() -> None:
    a = KVConnectorStats({"bytes": 10, "latencies": [1.0]})
    b = KVConnectorStats({"bytes": 5, "latencies": [2.0, 3.0], "errors": 1})
    assert a.aggregate(b) is a
    assert a.data == {"bytes": 15, "latencies": [1.0, 2.0, 3.0], "errors": 1}
    assert a.reduce() == {"bytes": 15, "latencies": 3, "errors": 1}
    a.reset()
    assert a.is_empty()


def test_context_validation() -> None:
    cfg = KVTransferConfig()
    with pytest.raises(ValueError, match="world_size"):
        KVConnectorContext(cfg, world_size=0)
    with pytest.raises(ValueError, match="rank"):
        KVConnectorContext(cfg, world_size=2, rank=2)
    with pytest.raises(ValueError, match="block_size"):
        KVConnectorContext(cfg, block_size=0)
    child = transfer_config("Recording")
    assert KVConnectorContext(cfg, world_size=4, rank=3).for_child(child).rank == 3


def test_metadata_binding_and_defaults() -> None:
    c = Recording(KVConnectorContext(transfer_config("Recording")), KVConnectorRole.WORKER)
    assert c.role is KVConnectorRole.WORKER
    assert not c.has_connector_metadata()
    with pytest.raises(RuntimeError, match="no connector metadata"):
        c._get_connector_metadata()
    meta = KVConnectorMetadata()
    c.bind_connector_metadata(meta)
    assert c.has_connector_metadata() and c._get_connector_metadata() is meta
    c.clear_connector_metadata()
    assert not c.has_connector_metadata()
    # Optional hooks have no-op defaults.
    req = FakeRequest.make("r", list(range(8)))
    assert c.get_finished(set()) == (None, None)
    assert c.get_block_ids_with_load_errors() == set()
    assert c.get_kv_connector_stats() is None
    assert c.build_connector_worker_meta() is None
    assert c.request_finished(req, []) == (False, None)
    assert list(c.take_events()) == []
    assert c.get_finished_count() is None and c.reset_cache() is None

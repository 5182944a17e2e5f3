import pytest

from kvconnect.connector import KVConnectorOutput, KVConnectorStats
from kvconnect.connector.aggregator import KVOutputAggregator
from kvconnect.connector.events import KVEventsWorkerMetadata
from kvconnect.events import BlockRemoved


def test_empty_outputs_give_an_empty_output() -> None:
    agg = KVOutputAggregator(2)
    out = agg.aggregate([None, KVConnectorOutput()])
    assert out.is_empty() and out.finished_sending is None and out.finished_recving is None
    assert out.expected_finished_count == 2


def test_finished_ids_wait_for_every_worker_across_steps() -> None:
    agg = KVOutputAggregator(2)
    out = agg.aggregate(
        [
            KVConnectorOutput(finished_sending={"req1"}, finished_recving={"req2"}),
            KVConnectorOutput(invalid_block_ids={1}),
        ]
    )
    assert out.finished_sending is None and out.finished_recving is None
    assert out.invalid_block_ids == {1}
    assert agg.num_pending == 2
    out = agg.aggregate(
        [
            KVConnectorOutput(invalid_block_ids={2}),
            KVConnectorOutput(finished_sending={"req1"}, invalid_block_ids={3}),
        ]
    )
    assert out.finished_sending == {"req1"} and out.invalid_block_ids == {2, 3}
    out = agg.aggregate([None, KVConnectorOutput(finished_recving={"req2"})])
    assert out.finished_recving == {"req2"}
    assert agg.num_pending == 0


def test_expected_count_change_applies_to_untracked_ids_only() -> None:
    agg = KVOutputAggregator(4)
    agg.aggregate([KVConnectorOutput(finished_sending={"req1"}), None, None, None])
    out = agg.aggregate(
        [
            KVConnectorOutput(finished_sending={"req2"}, expected_finished_count=2),
            KVConnectorOutput(finished_sending={"req2", "req1"}, expected_finished_count=2),
        ]
    )
    assert out.expected_finished_count == 2
    assert out.finished_sending == {"req2"}  # the new id needed 2 reports
    assert agg._send_remaining == {"req1": 2}  # the tracked one kept its old count (4 - 2)


def test_stats_merge_in_rank_order_and_types_must_match() -> None:
    agg = KVOutputAggregator(2)
    out = agg.aggregate(
        [
            KVConnectorOutput(kv_connector_stats=KVConnectorStats({"n": 1, "l": [1]})),
            KVConnectorOutput(kv_connector_stats=KVConnectorStats({"n": 2, "l": [2]})),
        ]
    )
    assert out.kv_connector_stats == KVConnectorStats({"n": 3, "l": [1, 2]})

    class Other(KVConnectorStats):
        pass

    with pytest.raises(TypeError, match="different stats types"):
        agg.aggregate(
            [
                KVConnectorOutput(kv_connector_stats=KVConnectorStats({"n": 1})),
                KVConnectorOutput(kv_connector_stats=Other({"n": 1})),
            ]
        )


def test_worker_metadata_folds_in_rank_order_skipping_none() -> None:
    agg = KVOutputAggregator(3)
    e0, e2 = BlockRemoved([1], "CPU"), BlockRemoved([2], "CPU")
    out = agg.aggregate(
        [
            KVConnectorOutput(kv_connector_worker_meta=KVEventsWorkerMetadata.from_rank(0, [e0])),
            KVConnectorOutput(finished_sending={"x"}),
            KVConnectorOutput(kv_connector_worker_meta=KVEventsWorkerMetadata.from_rank(2, [e2])),
        ]
    )
    assert out.kv_connector_worker_meta == KVEventsWorkerMetadata({0: [e0], 2: [e2]})


def test_bad_expected_count() -> None:
    with pytest.raises(ValueError, match="expected_finished_count"):
        KVOutputAggregator(0)

import inspect
from typing import Any

import pytest

from kvconnect.config import KVTransferConfig
from kvconnect.connector import (
    KVConnectorBase,
    KVConnectorContext,
    KVConnectorFactory,
    KVConnectorOutput,
    KVConnectorRole,
    SchedulerOutput,
)
from kvconnect.connector.multi import (
    MultiConnector,
    MultiKVConnectorMetadata,
    MultiKVConnectorStats,
    MultiKVConnectorWorkerMetadata,
    child_configs,
)
from tests.connector.helpers import (
    FakeRequest,
    Recording,
    SetMetadata,
    WorkerEventsConnector,
    multi_config,
    transfer_config,
)


def build(
    *children: KVTransferConfig,
    role: KVConnectorRole = KVConnectorRole.SCHEDULER,
    world_size: int = 1,
) -> MultiConnector:
    c = KVConnectorFactory.create_connector(
        KVConnectorContext(multi_config(*children), world_size=world_size), role
    )
    assert isinstance(c, MultiConnector)
    return c


def child(c: MultiConnector, i: int) -> Recording:
    r = c.connectors[i]
    assert isinstance(r, Recording)
    return r


def test_overrides_every_public_base_method() -> None:
    allowed_to_inherit = {"role", "has_connector_metadata"}
    public = {n for n, _ in inspect.getmembers(KVConnectorBase) if not n.startswith("_")}
    missing = {n for n in public - allowed_to_inherit if n not in MultiConnector.__dict__}
    assert not missing, f"MultiConnector must override {sorted(missing)}"


def test_worker_metadata_has_one_slot_per_child() -> None:
    none = transfer_config("Recording")
    some = transfer_config("Recording", worker_meta=["x"])
    assert build(none, none, role=KVConnectorRole.WORKER).build_connector_worker_meta() is None
    meta = build(none, some, role=KVConnectorRole.WORKER).build_connector_worker_meta()
    assert meta == MultiKVConnectorWorkerMetadata((None, SetMetadata({"x"})))
    meta = build(some, none, role=KVConnectorRole.WORKER).build_connector_worker_meta()
    assert meta == MultiKVConnectorWorkerMetadata((SetMetadata({"x"}), None))


def test_worker_metadata_aggregates_slot_by_slot() -> None:
    def m(a: set[str] | None, b: set[str] | None) -> MultiKVConnectorWorkerMetadata:
        return MultiKVConnectorWorkerMetadata(
            (None if a is None else SetMetadata(a), None if b is None else SetMetadata(b))
        )

    assert m({"0a"}, None).aggregate(m(None, {"1a"})) == m({"0a"}, {"1a"})
    merged = m({"0a"}, None).aggregate(m({"0b"}, None))
    assert merged == m({"0a", "0b"}, None) and isinstance(merged.metadata[0], SetMetadata)
    assert m({"0a"}, {"1a"}).aggregate(m({"0b"}, {"1b"})) == m({"0a", "0b"}, {"1a", "1b"})
    with pytest.raises(ValueError, match="slot counts"):
        m(None, None).aggregate(MultiKVConnectorWorkerMetadata((None,)))
    with pytest.raises(TypeError):
        m(None, None).aggregate(SetMetadata(set()))


def test_update_connector_output_gives_each_child_its_own_view() -> None:
    c = build(transfer_config("Recording"), transfer_config("Recording"))
    c.update_connector_output(KVConnectorOutput())
    assert [child(c, i).calls[-1] for i in (0, 1)] == [("update_connector_output", None)] * 2
    multi = MultiKVConnectorWorkerMetadata((SetMetadata({"a"}), None))
    shared = KVConnectorOutput(finished_sending={"r1"}, kv_connector_worker_meta=multi)
    c.update_connector_output(shared)
    assert child(c, 0).calls[-1] == ("update_connector_output", SetMetadata({"a"}))
    assert child(c, 1).calls[-1] == ("update_connector_output", None)
    # Each child changed its own copy of finished_sending; the shared output is untouched.
    assert shared.finished_sending == {"r1"} and shared.kv_connector_worker_meta is multi
    with pytest.raises(TypeError, match="MultiKVConnectorWorkerMetadata"):
        c.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=SetMetadata(set())))


def test_loads_come_from_the_first_child_with_matched_tokens() -> None:
    c = build(
        transfer_config("Recording", matched_tokens=0),
        transfer_config("Recording", matched_tokens=8),
        transfer_config("Recording", matched_tokens=12),
    )
    req = FakeRequest.make("r1", list(range(16)))
    assert c.get_num_new_matched_tokens(req, 0) == (8, False)
    assert all(child(c, i).calls[-1][0] == "get_num_new_matched_tokens" for i in range(3))
    c.update_state_after_alloc(req, [4, 5], 8)
    assert [child(c, i).calls[-1][2:] for i in range(3)] == [([], 0), ([4, 5], 8), ([], 0)]
    assert c.num_tracked_requests == 1  # it remembers who loads r1 until r1 finishes
    c.request_finished(req, [4, 5])
    assert c.num_tracked_requests == 0


def test_a_child_still_looking_makes_the_request_wait() -> None:
    c = build(
        transfer_config("Recording", matched_tokens=8),
        transfer_config("Recording", matched_tokens=None),
    )
    assert c.get_num_new_matched_tokens(FakeRequest.make("r", [1] * 8), 0) == (None, False)


def test_no_match_is_zero() -> None:
    c = build(transfer_config("Recording"), transfer_config("Recording"))
    req = FakeRequest.make("r", [1] * 8)
    assert c.get_num_new_matched_tokens(req, 0) == (0, False)
    c.update_state_after_alloc(req, [1, 2], 0)
    assert [child(c, i).calls[-1][2:] for i in range(2)] == [([], 0), ([], 0)]


def test_request_with_two_async_savers_finishes_once_after_the_last() -> None:
    slow = transfer_config("WorkerEventsConnector", medium="DISK", async_save_steps=3)
    fast = transfer_config("WorkerEventsConnector", medium="CPU", async_save_steps=1)
    sched = build(slow, fast)
    worker = build(slow, fast, role=KVConnectorRole.WORKER)
    req = FakeRequest.make("r1", list(range(8)))
    is_async, params = sched.request_finished(req, [0, 1])
    assert is_async and params == {"saved_by_DISK": 2, "saved_by_CPU": 2}
    finished: list[set[str] | None] = []
    for step in range(4):
        meta = sched.build_connector_meta(SchedulerOutput())
        assert isinstance(meta, MultiKVConnectorMetadata)
        assert meta.extra_async_saves == ({"r1": 1} if step == 0 else None)
        worker.bind_connector_metadata(meta)
        finished.append(worker.get_finished({"r1"} if step == 0 else set())[0])
        worker.clear_connector_metadata()
    assert finished == [None, None, {"r1"}, None]  # CPU done at step 0 is held back
    assert sched.num_tracked_requests == 0 and worker.num_tracked_requests == 0


def test_kv_transfer_params_clash_names_the_key() -> None:
    same = transfer_config("WorkerEventsConnector", medium="DISK")
    c = build(same, same)
    with pytest.raises(RuntimeError, match="'saved_by_DISK'"):
        c.request_finished(FakeRequest.make("r", [1] * 8), [])


def test_take_events_yields_children_in_order() -> None:
    c = build(
        transfer_config("SchedulerEventsConnector"), transfer_config("SchedulerEventsConnector")
    )
    req = FakeRequest.make("r", list(range(8)))
    assert c.request_finished(req, [])[0] is False
    events = list(c.take_events())
    assert len(events) == 2 and events[0] == events[1]
    assert list(c.take_events()) == []


def test_shutdown_reaches_every_child_then_reraises() -> None:
    c = build(
        transfer_config("Recording", shutdown_error="first"),
        transfer_config("Recording", shutdown_error="second"),
        transfer_config("Recording"),
    )
    with pytest.raises(RuntimeError, match="second"):
        c.shutdown()
    assert all(child(c, i).calls[-1] == ("shutdown",) for i in range(3))


def test_stats_are_kept_per_child_even_of_one_class() -> None:
    c = build(
        transfer_config("WorkerEventsConnector"),
        transfer_config("WorkerEventsConnector"),
        transfer_config("Recording"),
        role=KVConnectorRole.WORKER,
    )
    stats = c.get_kv_connector_stats()
    assert isinstance(stats, MultiKVConnectorStats)
    assert sorted(stats.data) == ["0:WorkerEventsConnector", "1:WorkerEventsConnector"]
    stats.aggregate(c.get_kv_connector_stats() or MultiKVConnectorStats())
    assert stats.reduce() == {
        "0:WorkerEventsConnector": {"num_stored": 0},
        "1:WorkerEventsConnector": {"num_stored": 0},
    }
    assert (
        build(transfer_config("Recording"), role=KVConnectorRole.WORKER).get_kv_connector_stats()
        is None
    )


def test_worker_calls_fan_out_in_order() -> None:
    c = build(
        transfer_config("Recording"), transfer_config("Recording"), role=KVConnectorRole.WORKER
    )
    meta = MultiKVConnectorMetadata((object(), object()))  # type: ignore[arg-type]
    c.bind_connector_metadata(meta)
    assert c.has_connector_metadata()
    c.start_load_kv(None)
    c.wait_for_layer_load("l0")
    c.save_kv_layer("l0", None)
    c.wait_for_save()
    for i in range(2):
        assert child(c, i).calls == [
            ("start_load_kv",),
            ("wait_for_layer_load", "l0"),
            ("save_kv_layer", "l0"),
            ("wait_for_save",),
        ]
        assert child(c, i)._connector_metadata is meta.metadata[i]
    c.clear_connector_metadata()
    assert not c.has_connector_metadata() and not child(c, 1).has_connector_metadata()
    with pytest.raises(ValueError, match="1 slots for 2"):
        c.bind_connector_metadata(MultiKVConnectorMetadata((object(),)))  # type: ignore[arg-type]


def test_reset_cache_is_true_unless_a_child_refuses() -> None:
    assert (
        build(
            transfer_config("Recording"), transfer_config("Recording", reset_result=True)
        ).reset_cache()
        is True
    )
    assert (
        build(
            transfer_config("Recording", reset_result=False), transfer_config("Recording")
        ).reset_cache()
        is False
    )


def test_children_inherit_role_and_engine_id() -> None:
    cfg = KVTransferConfig(
        kv_connector="MultiConnector",
        kv_role="kv_producer",
        engine_id="e7",
        kv_connector_extra_config={
            "connectors": [{"kv_connector": "A"}, {"kv_connector": "B", "engine_id": "e8"}]
        },
    )
    a, b = child_configs(cfg)
    assert (a.kv_role, a.engine_id, b.kv_role, b.engine_id) == (
        "kv_producer",
        "e7",
        "kv_producer",
        "e8",
    )


@pytest.mark.parametrize("connectors", [None, [], ["x"], [{"kv_conector": "A"}]])
def test_bad_children_config(connectors: Any) -> None:
    cfg = KVTransferConfig(
        kv_connector="MultiConnector",
        kv_role="kv_both",
        kv_connector_extra_config={"connectors": connectors},
    )
    with pytest.raises(ValueError, match=r"connectors|kv_conector"):
        child_configs(cfg)


def test_worker_events_connector_is_a_real_child() -> None:
    c = build(transfer_config("WorkerEventsConnector"), role=KVConnectorRole.WORKER)
    assert isinstance(c.connectors[0], WorkerEventsConnector)

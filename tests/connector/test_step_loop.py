"""Connectors driven end to end by vLLM's step order, with the real aggregator."""

from kvconnect.connector.events import EventQuorum
from kvconnect.connector.multi import MultiConnector
from kvconnect.events import BlockRemoved, BlockStored
from kvconnect.hashing import to_wire
from tests.connector.helpers import (
    FakeRequest,
    StepLoop,
    WorkerEventsConnector,
    multi_config,
    transfer_config,
)

R1 = FakeRequest.make("r1", list(range(8)))  # 2 blocks of 4
R2 = FakeRequest.make("r2", list(range(100, 108)))


def stored(req: FakeRequest, medium: str) -> BlockStored:
    return BlockStored([to_wire(h) for h in req.block_hashes], None, [], 4, None, medium, None)


def quorums(loop: StepLoop) -> list[EventQuorum]:
    conns = (
        loop.scheduler.connectors
        if isinstance(loop.scheduler, MultiConnector)
        else (loop.scheduler,)
    )
    return [c.quorum for c in conns if isinstance(c, WorkerEventsConnector)]


def assert_no_leaks(loop: StepLoop) -> None:
    for q in quorums(loop):
        q.check_integrity()
        assert q.num_pending == 0 and q.num_expired == 0
    assert loop.aggregator.num_pending == 0
    for c in [loop.scheduler, *loop.workers]:
        if isinstance(c, MultiConnector):
            assert c.num_tracked_requests == 0


def test_tp2_store_is_published_once_not_per_rank() -> None:
    loop = StepLoop(transfer_config("WorkerEventsConnector"), world_size=2)
    assert loop.step(new=[R1]) == [stored(R1, "DISK")]
    assert loop.step() == []
    assert_no_leaks(loop)


def test_rank_reporting_a_step_late_still_publishes_once() -> None:
    loop = StepLoop(transfer_config("WorkerEventsConnector", lagging_rank=1), world_size=2)
    assert loop.step(new=[R1]) == []
    assert loop.step() == [stored(R1, "DISK")]
    assert loop.step() == []
    assert_no_leaks(loop)


def test_evictions_are_published() -> None:
    loop = StepLoop(transfer_config("WorkerEventsConnector", capacity_blocks=2), world_size=2)
    assert loop.step(new=[R1]) == [stored(R1, "DISK")]
    assert loop.step(new=[R2]) == [
        stored(R2, "DISK"),
        BlockRemoved([to_wire(R1.block_hashes[0])], "DISK"),
        BlockRemoved([to_wire(R1.block_hashes[1])], "DISK"),
    ]
    assert_no_leaks(loop)


def test_replication_count_for_blocks_held_by_one_rank() -> None:
    loop = StepLoop(transfer_config("WorkerEventsConnector", replication=1), world_size=2)
    assert loop.step(new=[R1]) == [stored(R1, "DISK")]
    worker1 = loop.workers[1]
    assert isinstance(worker1, WorkerEventsConnector) and not worker1.store
    assert_no_leaks(loop)


def test_multiconnector_at_tp2_publishes_each_childs_events_once_in_child_order() -> None:
    config = multi_config(
        transfer_config("WorkerEventsConnector", medium="DISK"),
        transfer_config("WorkerEventsConnector", medium="CPU", lagging_rank=0),
        transfer_config("SchedulerEventsConnector"),
    )
    loop = StepLoop(config, world_size=2)
    assert loop.step(new=[R1]) == [stored(R1, "DISK")]
    announced = BlockStored(
        [to_wire(h) for h in R1.block_hashes], None, R1.all_token_ids, 4, None, "CPU", None
    )
    assert loop.step(finished=[R1]) == [stored(R1, "CPU"), announced]
    assert loop.step() == []
    assert_no_leaks(loop)


def test_async_saves_of_two_children_finish_the_request_once() -> None:
    config = multi_config(
        transfer_config("WorkerEventsConnector", medium="DISK", async_save_steps=2),
        transfer_config("WorkerEventsConnector", medium="CPU", async_save_steps=1),
    )
    loop = StepLoop(config, world_size=2)
    loop.step(new=[R1])
    loop.step(finished=[R1])
    assert loop.params["r1"] == {"saved_by_DISK": 2, "saved_by_CPU": 2}
    assert loop.finished_sending == set()  # the CPU saver finished; the DISK one has not
    loop.step()
    assert loop.finished_sending == {"r1"}
    loop.step()
    assert loop.finished_sending == {"r1"}
    assert_no_leaks(loop)
    assert_no_leaks(loop)

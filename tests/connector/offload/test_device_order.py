"""The worker's device rules (connector/offload/device.py) with its `DeviceOps` injected: an
implementation that copies real tensors on the host like `SyncOps`, logs every record, wait,
synchronize and copy, and holds the copy stream's events until the test lets them happen, so
the order of the calls and what the worker reports meanwhile are seen as on a GPU."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch

from kvconnect.connector.offload.common import LoadSpec, OffloadMetadata, SaveSpec
from kvconnect.connector.offload.device import DeviceOps, Stream, SyncOps
from tests.connector.offload.test_layouts import BLOCKS, BS, info, make_worker

WAIT = 30.0


class Event:
    def __init__(self, name: str, happened: bool) -> None:
        self.name = name
        self.happened = threading.Event()
        if happened:
            self.happened.set()


class RecordingOps(DeviceOps):
    """Compute-stream events happen at once (the forward is done); copy-stream events only
    when `release` says so, as a copy still running on a GPU."""

    def __init__(self) -> None:
        self.log: list[tuple[str, ...]] = []
        self.events: list[Event] = []
        self._logged = threading.Condition()
        self._sync = SyncOps()

    def _note(self, *entry: str) -> None:
        with self._logged:
            self.log.append(entry)
            self._logged.notify_all()

    def record(self, stream: Stream) -> Event:
        event = Event(f"{stream.value}{len(self.events)}", stream is Stream.COMPUTE)
        self.events.append(event)
        self._note("record", stream.value, event.name)
        return event

    def wait(self, stream: Stream, event: Any) -> None:
        self._note("wait", stream.value, event.name)

    def synchronize(self, event: Any) -> None:
        self._note("synchronize", event.name)
        assert event.happened.wait(WAIT)

    @contextlib.contextmanager
    def on_copy_stream(self) -> Iterator[None]:
        self._note("copy stream")
        yield
        self._note("compute stream")

    def to_host(self, chunk: torch.Tensor) -> torch.Tensor:
        self._note("to_host")
        return self._sync.to_host(chunk)

    def to_device(self, host: torch.Tensor, device: torch.device) -> torch.Tensor:
        self._note("to_device")
        return self._sync.to_device(host, device)

    def release(self, host: torch.Tensor) -> torch.Tensor:
        self._note("release")
        return host

    def let_happen(self, name: str) -> None:
        next(e for e in self.events if e.name == name).happened.set()

    def wait_logged(self, *entry: str) -> None:
        """Until the I/O thread has done `entry` (each entry is notified as it is logged)."""
        with self._logged:
            assert self._logged.wait_for(lambda: entry in self.log, WAIT), (entry, self.log)


def test_a_save_copies_after_the_forward_and_the_next_step_waits_for_the_copy() -> None:
    ops = RecordingOps()
    worker = make_worker()
    worker.device_ops = ops
    caches = {f"l{i}": torch.randn(2, BLOCKS, BS, 2, 4) for i in range(2)}
    worker.register_kv_caches(caches)
    try:
        worker.wait_for_save(OffloadMetadata(saves=[SaveSpec(info(1), [3, 4])]))
        assert ops.log == [
            ("record", "compute", "compute0"),  # after the forward that wrote blocks 3, 4
            ("copy stream",),
            ("wait", "copy", "compute0"),
            ("to_host",),
            ("record", "copy", "copy1"),
            ("compute stream",),
        ]
        ops.wait_logged("synchronize", "copy1")
        key = worker._key(info(1))
        assert not worker.tiers[0].contains(key)  # the host bytes are not complete yet
        worker.handle_preemptions()  # the next step: its writes come after the copy
        assert ops.log[-2:] in (
            [("synchronize", "copy1"), ("wait", "compute", "copy1")],
            [("wait", "compute", "copy1"), ("synchronize", "copy1")],
        )
        worker.handle_preemptions()  # once is enough
        assert ops.log.count(("wait", "compute", "copy1")) == 1
        ops.let_happen("copy1")
        assert worker.drain(WAIT)
        assert ops.log[-1] == ("release",)
        assert worker.tiers[0].contains(key)
    finally:
        worker.shutdown()


def test_a_load_is_finished_only_after_its_copy_into_the_cache_happened() -> None:
    ops = RecordingOps()
    worker = make_worker()
    worker.device_ops = ops
    caches = {f"l{i}": torch.randn(2, BLOCKS, BS, 2, 4) for i in range(2)}
    saved = {name: c[:, [0, 1]].clone() for name, c in caches.items()}
    worker.register_kv_caches(caches)
    try:
        worker.wait_for_save(OffloadMetadata(saves=[SaveSpec(info(1), [0, 1])]))
        ops.let_happen("copy1")
        assert worker.drain(WAIT)
        worker.handle_preemptions()
        ops.log.clear()
        worker.start_load_kv(OffloadMetadata(loads=[LoadSpec("r", [info(1)], [[7, 8]], [0])]))
        ops.wait_logged("synchronize", "copy3")
        assert ops.log == [
            ("record", "compute", "compute2"),  # the blocks' last reader
            ("copy stream",),
            ("wait", "copy", "compute2"),
            ("to_device",),
            ("record", "copy", "copy3"),
            ("compute stream",),
            ("synchronize", "copy3"),
        ]
        assert worker.get_finished() == (None, None)  # the copy has not happened: not finished
        ops.let_happen("copy3")
        assert worker.drain(WAIT)
        assert worker.get_finished() == (None, {"r"})
        for name, cache in caches.items():
            assert torch.equal(cache[:, [7, 8]], saved[name])
    finally:
        worker.shutdown()


def test_a_step_without_saves_or_loads_touches_no_stream() -> None:
    ops = RecordingOps()
    worker = make_worker()
    worker.device_ops = ops
    worker.register_kv_caches({"l": torch.zeros(2, BLOCKS, BS, 2, 4)})
    try:
        worker.handle_preemptions()
        worker.start_load_kv(OffloadMetadata())
        worker.wait_for_save(OffloadMetadata())
        assert ops.log == []
    finally:
        worker.shutdown()


def test_a_host_cache_keeps_no_copy_to_wait_for() -> None:
    """kvconnect's own engine never calls handle_preemptions: nothing may pile up."""
    worker = make_worker()
    worker.register_kv_caches({"l": torch.zeros(2, BLOCKS, BS, 2, 4)})
    try:
        for i in range(3):
            worker.wait_for_save(OffloadMetadata(saves=[SaveSpec(info(i + 1), [i, i + 1])]))
        assert worker.drain(WAIT)
        assert worker._unfenced == []
    finally:
        worker.shutdown()

"""How the offload worker moves KV between the paged cache and host memory: `DeviceOps`.

The rules a cache on an accelerator needs (the worker follows them with any `DeviceOps`):

    save  step thread, wait_for_save (this step's forward is queued on the compute stream):
            ready = record(COMPUTE)          the forward's writes come before ...
            on the copy stream: wait(ready); chunk = gather(blocks); host = to_host(chunk)
            gathered = record(COPY) ...      ... the gather that reads them
          next step, handle_preemptions (before anything of that step writes the cache):
            wait(COMPUTE, gathered)          nothing later on the compute stream (the next
                                             forward, a reused block's first write) runs
                                             before the gather has read the blocks
          I/O thread: synchronize(gathered)  host bytes complete -> the tiers
    load  step thread, start_load_kv: ready = record(COMPUTE)   (the blocks' last reader)
          I/O thread: on the copy stream: wait(ready); scatter(to_device(host));
            done = record(COPY); synchronize(done); only then the request is finished

The copy stream is not the compute stream, so copies run beside the forward; the host never
waits for the compute stream. vLLM 0.33's hooks: `handle_preemptions` runs first in a step
("before they are overwritten"), then the forward, `finish_forward`, `wait_for_save`,
`start_load_kv` for asynchronous loads (after the forward), `get_finished`.

`SyncOps` (a cache in host memory: kvconnect's engine, vLLM on CPU): copies are synchronous,
events are done when made. `CudaOps`: one dedicated stream, CUDA events, pinned host buffers.
A test injects its own `DeviceOps` to see the order of the calls.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Iterator
from enum import Enum
from typing import Any

import torch


class Stream(Enum):
    COMPUTE = "compute"
    """The stream the engine's forward runs on (the step thread's current stream)."""
    COPY = "copy"
    """The connector's own stream for copies."""


class DeviceOps(ABC):
    @abstractmethod
    def record(self, stream: Stream) -> Any:
        """An event marking everything queued on `stream` so far."""

    @abstractmethod
    def wait(self, stream: Stream, event: Any) -> None:
        """Work queued on `stream` from now on runs after `event` (the host does not wait)."""

    @abstractmethod
    def synchronize(self, event: Any) -> None:
        """The host waits until `event` has happened."""

    @abstractmethod
    def on_copy_stream(self) -> contextlib.AbstractContextManager[None]:
        """Tensor work inside runs on the copy stream."""

    @abstractmethod
    def to_host(self, chunk: torch.Tensor) -> torch.Tensor:
        """A host copy of `chunk` (queued on the current stream; complete after an event
        recorded next has happened)."""

    @abstractmethod
    def to_device(self, host: torch.Tensor, device: torch.device) -> torch.Tensor:
        """`host` on `device` (queued on the current stream)."""

    def release(self, host: torch.Tensor) -> torch.Tensor:
        """A complete `to_host` result as an ordinary host tensor for the tiers (a pinned
        buffer goes back to the pool rather than into a tier)."""
        return host


class SyncOps(DeviceOps):
    """A cache in host memory: every copy is done when the call returns."""

    def record(self, stream: Stream) -> None:
        return None

    def wait(self, stream: Stream, event: Any) -> None:
        return None

    def synchronize(self, event: Any) -> None:
        return None

    def on_copy_stream(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def to_host(self, chunk: torch.Tensor) -> torch.Tensor:
        return chunk if chunk.device.type == "cpu" else chunk.cpu()

    def to_device(self, host: torch.Tensor, device: torch.device) -> torch.Tensor:
        return host.to(device)


class CudaOps(DeviceOps):
    """A CUDA cache: copies on one dedicated stream, through pinned host buffers. The
    compute stream is the current stream of the thread that records on it (the step
    thread: vLLM's forward stream)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]

    def _stream(self, stream: Stream) -> Any:
        return self.stream if stream is Stream.COPY else torch.cuda.current_stream(self.device)

    def record(self, stream: Stream) -> Any:
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(self._stream(stream))
        return event

    def wait(self, stream: Stream, event: Any) -> None:
        self._stream(stream).wait_event(event)

    def synchronize(self, event: Any) -> None:
        event.synchronize()

    @contextlib.contextmanager
    def on_copy_stream(self) -> Iterator[None]:
        with torch.cuda.stream(self.stream):
            yield

    def to_host(self, chunk: torch.Tensor) -> torch.Tensor:
        host = torch.empty(chunk.shape, dtype=chunk.dtype, pin_memory=True)
        host.copy_(chunk, non_blocking=True)
        return host

    def release(self, host: torch.Tensor) -> torch.Tensor:
        return torch.empty(host.shape, dtype=host.dtype).copy_(host) if host.is_pinned() else host

    def to_device(self, host: torch.Tensor, device: torch.device) -> torch.Tensor:
        pinned = torch.empty(host.shape, dtype=host.dtype, pin_memory=True)
        pinned.copy_(host)  # contiguous and pinned, so the copy below is queued, not waited
        # torch's pinned pool keeps `pinned` from reuse until the copy queued here has run.
        return pinned.to(device, non_blocking=True)


def device_ops_for(device: torch.device) -> DeviceOps:
    """The ops for a cache on `device`: CUDA's, or synchronous copies for host memory."""
    if device.type == "cuda":
        return CudaOps(device)
    if device.type == "cpu":
        return SyncOps()
    raise ValueError(
        f"kvconnect OffloadConnector: KV cache on {device}: only cpu and cuda are supported"
    )

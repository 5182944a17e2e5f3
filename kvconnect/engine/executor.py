"""The executor: what runs the model for the engine, one step at a time.

    execute_model(scheduler_output)  every rank runs the step -> (rank 0's output: the sampled
                                     tokens and logprobs, the ranks' folded connector output)
    check_alive()                    `EngineDeadError` if a worker is gone (an idle engine asks)
    shutdown(timeout)                stop every worker; the executor is then dead
    worker_pids                      the worker processes (empty for one in this process)

Two implementations, chosen as vLLM's `distributed_executor_backend`: `uni`
(`engine/uniproc_executor.py`, the single worker in the engine's own process: no process to
start, no step pickled through a pipe; the default at tensor_parallel_size 1) and `mp`
(`engine/multiproc_executor.py`, one process per rank; the default above 1, and the choice that
survives a worker crash as an `EngineDeadError` instead of taking the engine down with it).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from kvconnect.connector.aggregator import KVOutputAggregator
from kvconnect.engine.worker import WorkerConfig, WorkerOutput
from kvconnect.messages import KVConnectorOutput, SchedulerOutput

BACKENDS = ("uni", "mp")
"""`distributed_executor_backend` values (vLLM's names)."""


def default_backend(tensor_parallel_size: int) -> str:
    """vLLM's choice: the worker in this process for one rank, processes for more."""
    return "uni" if tensor_parallel_size == 1 else "mp"


class EngineDeadError(RuntimeError):
    """A worker died, failed or hung; the engine cannot go on."""


class Executor(ABC):
    def __init__(self, config: WorkerConfig, expected_finished_count: int | None) -> None:
        self.config = config
        self.aggregator = KVOutputAggregator(expected_finished_count or config.tensor_parallel_size)
        self._has_connector = config.kv_transfer_config is not None and bool(
            config.kv_transfer_config.kv_connector
        )

    def _fold(self, results: list[WorkerOutput]) -> KVConnectorOutput | None:
        """The ranks' connector outputs as one (None without a connector)."""
        if not self._has_connector:
            return None
        return self.aggregator.aggregate([r.kv_connector_output for r in results])

    @abstractmethod
    def execute_model(
        self, scheduler_output: SchedulerOutput
    ) -> tuple[WorkerOutput, KVConnectorOutput | None]: ...

    @abstractmethod
    def check_alive(self) -> None: ...

    @abstractmethod
    def shutdown(self, timeout: float = 5.0) -> None: ...

    @property
    @abstractmethod
    def worker_pids(self) -> list[int | None]: ...

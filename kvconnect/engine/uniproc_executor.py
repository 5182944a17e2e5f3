"""`UniProcExecutor`: the one worker of a tensor_parallel_size 1 engine, in the engine's process.

As vLLM's uni backend: the step goes to the model runner as a call, not pickled through a pipe
to a spawned process (which also costs a second torch import at start). What it gives up is
isolation: a crash of the runner is a crash of the engine's process, and a hung step cannot be
timed out. An exception in a step is an `EngineDeadError`, as a worker's would be.

The runner gets the scheduler's own `SchedulerOutput`, not a copy: the scheduler builds a new
one each step and never changes one it handed out.
"""

from __future__ import annotations

import traceback

import torch

from kvconnect.engine.executor import EngineDeadError, Executor
from kvconnect.engine.worker import ModelRunner, WorkerConfig, WorkerOutput
from kvconnect.messages import KVConnectorOutput, SchedulerOutput


class UniProcExecutor(Executor):
    def __init__(self, config: WorkerConfig, expected_finished_count: int | None = None) -> None:
        if config.tensor_parallel_size != 1:
            raise ValueError(
                f"distributed_executor_backend 'uni' runs one rank; tensor_parallel_size is "
                f"{config.tensor_parallel_size} (use 'mp')"
            )
        super().__init__(config, expected_finished_count)
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        try:
            self._runner: ModelRunner | None = ModelRunner(config, rank=0)
        except Exception as e:
            raise EngineDeadError(f"worker 0 failed to start: {e!r}") from e

    @property
    def worker_pids(self) -> list[int | None]:
        return []

    def check_alive(self) -> None:
        if self._runner is None:
            raise EngineDeadError("the engine's worker is gone")

    def execute_model(
        self, scheduler_output: SchedulerOutput
    ) -> tuple[WorkerOutput, KVConnectorOutput | None]:
        runner = self._runner
        if runner is None:
            raise EngineDeadError("the engine's worker is gone")
        try:
            out = runner.execute(scheduler_output)
        except Exception as e:
            self.shutdown()
            raise EngineDeadError(f"worker 0 failed: {e!r}\n{traceback.format_exc()}") from e
        return out, self._fold([out])

    def shutdown(self, timeout: float = 5.0) -> None:
        runner, self._runner = self._runner, None
        if runner is not None:
            runner.shutdown()

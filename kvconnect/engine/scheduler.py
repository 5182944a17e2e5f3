"""Continuous batching with chunked prefill, preemption by recompute, and the connector hooks.

Each step:
  schedule()              running requests first (decode or the next prefill chunk), preempting
                          the newest running request when blocks run out; then waiting requests
                          in order (those back from a load, which hold blocks, ahead of the
                          rest): prefix-cache lookup, get_num_new_matched_tokens,
                          allocation, connector.update_state_after_alloc; then
                          connector.build_connector_meta(output)
  (workers run the step)
  update_from_output()    invalid blocks -> recompute; advance computed tokens, cache full
                          blocks, append sampled tokens, finish (connector.request_finished);
                          connector.update_connector_output; finished_recving / finished_sending;
                          block-pool events then connector events -> one KVEventBatch -> publish()

Requests waiting for an async connector load sit in `WAITING_FOR_REMOTE_KVS` until their id
comes back in `finished_recving`; requests whose async save is running keep their blocks until
`finished_sending`. Finished ids of requests the scheduler no longer tracks are ignored.
"""

from __future__ import annotations

import enum
import logging
import time
import zlib
from collections import deque
from dataclasses import dataclass
from typing import Any

from kvconnect.connector.base import KVConnectorBase
from kvconnect.engine.block_pool import BlockPool, KVCacheBlock
from kvconnect.engine.kv_cache_manager import KVCacheManager
from kvconnect.engine.request import Request, RequestStatus
from kvconnect.engine.structured_output import grammar_bitmask
from kvconnect.events import KVEventBatch
from kvconnect.messages import (
    KVConnectorOutput,
    KVConnectorStats,
    NewRequestData,
    ScheduledRequest,
    SchedulerOutput,
)
from kvconnect.stream.publisher import EventPublisher, NullEventPublisher

logger = logging.getLogger(__name__)


class AdmissionOutcome(enum.Enum):
    """What happened to a waiting request this step."""

    SCHEDULED = "scheduled"
    """Running from this step on; `num_tokens` of its tokens are computed this step."""
    LOADING = "loading"
    """Blocks allocated; it waits for the connector's async load (WAITING_FOR_REMOTE_KVS)."""
    UNDECIDED = "undecided"
    """The connector is still looking for it: ask again next step."""
    NO_ROOM = "no_room"
    """Not enough free blocks (or token budget, without chunked prefill)."""


@dataclass(frozen=True)
class Admission:
    outcome: AdmissionOutcome
    num_tokens: int = 0
    """Tokens of the step's budget it took (SCHEDULED only)."""


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 1024
    """Token budget of one step."""
    max_num_seqs: int = 64
    """Requests running at once."""
    enable_chunked_prefill: bool = True
    """Split long prompts over several steps instead of waiting for a budget that fits."""
    max_model_len: int = 4096
    """Prompt plus output tokens of one request."""


@dataclass
class SchedulerStats:
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_external_tokens: int = 0
    num_preemptions: int = 0
    num_recomputed_blocks: int = 0
    num_events_published: int = 0


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        pool: BlockPool,
        connector: KVConnectorBase | None = None,
        publisher: EventPublisher | None = None,
    ) -> None:
        self.config = config
        self.pool = pool
        self.kv_cache_manager = KVCacheManager(pool)
        self.block_size = pool.block_size
        self.connector = connector
        self.publisher = publisher or NullEventPublisher()
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._remote_waiting: dict[str, Request] = {}  # async loads in flight
        self._finished_recving: set[str] = set()  # loads done, to promote next schedule()
        self._saving: dict[str, Request] = {}  # finished, async save in flight: blocks held
        self._aborted_loading: set[str] = set()  # aborted during a load: blocks held
        self._finished_req_ids: set[str] = set()
        self.stats = SchedulerStats()
        self.connector_stats: KVConnectorStats | None = None

    # -- requests -----------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        total = request.num_tokens + request.sampling_params.max_tokens
        if total > self.config.max_model_len:
            raise ValueError(
                f"request {request.request_id!r}: prompt ({request.num_tokens}) + max_tokens "
                f"({request.sampling_params.max_tokens}) exceeds max_model_len "
                f"{self.config.max_model_len}"
            )
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def abort_request(
        self, request_id: str, status: RequestStatus = RequestStatus.FINISHED_ABORTED
    ) -> None:
        """End an unfinished request now, with `status` (a stop string ends one with
        FINISHED_STOPPED); unknown or finished ids are ignored."""
        request = self.requests.get(request_id)
        if request is None or request.status.is_finished:
            return
        if request_id in self._remote_waiting:
            del self._remote_waiting[request_id]
            self._aborted_loading.add(request_id)  # the load still writes into its blocks
        if request in self.waiting:
            self.waiting.remove(request)
        if request in self.running:
            self.running.remove(request)
        self._finish(request, status, free=request_id not in self._aborted_loading)

    @property
    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or self._remote_waiting)

    @property
    def has_pending_transfers(self) -> bool:
        return bool(self._saving or self._aborted_loading)

    # -- schedule -----------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        scheduler_output = SchedulerOutput()
        self._promote_finished_loads()
        budget = self._schedule_running(scheduler_output, self.config.max_num_batched_tokens)
        self._schedule_waiting(scheduler_output, budget)
        scheduler_output.finished_req_ids, self._finished_req_ids = self._finished_req_ids, set()
        scheduler_output.grammar_bitmask = grammar_bitmask(
            [
                (s.request_id, grammar)
                for s in scheduler_output.scheduled
                if s.sample and (grammar := self.requests[s.request_id].grammar) is not None
            ]
        )
        if self.connector is not None:
            scheduler_output.kv_connector_metadata = self.connector.build_connector_meta(
                scheduler_output
            )
        return scheduler_output

    def _schedule_running(self, scheduler_output: SchedulerOutput, budget: int) -> int:
        """Decode steps and further prefill chunks, preempting the newest request when blocks
        run out. Returns the budget left."""
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = req.num_tokens - req.num_computed_tokens
            if num_new > budget and not self.config.enable_chunked_prefill:
                i += 1
                continue
            num_new = min(num_new, budget)
            block_ids = self.kv_cache_manager.allocate_slots(req, req.num_computed_tokens + num_new)
            while block_ids is None:
                victim = self.running.pop()
                self._preempt(victim, scheduler_output)
                if victim is req:
                    break
                block_ids = self.kv_cache_manager.allocate_slots(
                    req, req.num_computed_tokens + num_new
                )
            if block_ids is None:
                break
            self._add_scheduled(scheduler_output, req, num_new, block_ids)
            budget -= num_new
            i += 1
        return budget

    def _schedule_waiting(self, scheduler_output: SchedulerOutput, budget: int) -> None:
        """Admit waiting requests in order while budget, blocks and sequence slots last."""
        undecided: list[Request] = []
        while (
            self.waiting
            and budget > 0
            and not scheduler_output.preempted_req_ids
            and len(self.running) < self.config.max_num_seqs
        ):
            req = self.waiting[0]
            admission = self._admit(req, budget, scheduler_output)
            if admission.outcome is AdmissionOutcome.NO_ROOM:
                if self._release_a_holder(req):
                    continue
                if self._never_fits(req):
                    scheduler_output.stuck_req_id = req.request_id
                break
            self.waiting.popleft()
            if admission.outcome is AdmissionOutcome.UNDECIDED:
                undecided.append(req)
            budget -= admission.num_tokens
        self.waiting.extendleft(reversed(undecided))

    def _release_a_holder(self, head: Request) -> bool:
        """Nothing runs, loads or saves and `head` cannot be admitted: the waiting requests
        back from loads hold the blocks it needs (loads of one prefix can fill the pool, each
        then a block short of computing its last tokens). The last of them other than `head`
        gives its blocks back, as a preempted request does: what it loaded stays in the
        prefix cache, where it (and `head`) find it again. True if one did."""
        if self.running or self._remote_waiting or self._saving:
            return False
        for req in reversed(self.waiting):
            if req is not head and self.kv_cache_manager.holds_blocks(req.request_id):
                self._give_back(req)
                return True
        return False

    def _never_fits(self, req: Request) -> bool:
        """`req` could not run even alone: its tokens need more blocks than the pool has, or,
        without chunked prefill, more than one step's budget."""
        blocks = -(-req.num_tokens // self.block_size)
        if blocks > self.pool.num_blocks:
            return True
        left = req.num_tokens - req.num_computed_tokens
        return not self.config.enable_chunked_prefill and left > self.config.max_num_batched_tokens

    def _admit(self, req: Request, budget: int, scheduler_output: SchedulerOutput) -> Admission:
        """Try to schedule the waiting request `req` within `budget` tokens."""
        hits: list[KVCacheBlock] = []
        num_local = req.num_computed_tokens
        num_external, load_async = 0, False
        # Not back from an async load (whose failed blocks may have taken its computed tokens
        # to 0): such a request keeps its blocks and is not looked up again.
        first_admission = not self.kv_cache_manager.holds_blocks(req.request_id)
        if first_admission:
            hits, num_local = self.kv_cache_manager.get_computed_blocks(req)
            if self.connector is not None:
                matched, load_async = self.connector.get_num_new_matched_tokens(req, num_local)
                if matched is None:
                    return Admission(AdmissionOutcome.UNDECIDED)
                num_external = matched
                if req.sampling_params.prompt_logprobs is not None:
                    num_external, load_async = 0, False  # every position's logits are needed
        num_computed = num_local + num_external
        if load_async:
            block_ids = self.kv_cache_manager.allocate_slots(req, num_computed, hits)
            if block_ids is None:
                return Admission(AdmissionOutcome.NO_ROOM)
            assert self.connector is not None
            self.connector.update_state_after_alloc(req, block_ids, num_external)
            self._record_hits(req, num_local, num_external)
            req.num_computed_tokens = num_computed
            req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
            self._remote_waiting[req.request_id] = req
            return Admission(AdmissionOutcome.LOADING)
        num_new = req.num_tokens - num_computed
        if num_new > budget:
            if not self.config.enable_chunked_prefill:
                return Admission(AdmissionOutcome.NO_ROOM)
            num_new = budget
        block_ids = self.kv_cache_manager.allocate_slots(req, num_computed + num_new, hits)
        if block_ids is None:
            return Admission(AdmissionOutcome.NO_ROOM)
        if first_admission:
            if self.connector is not None:
                self.connector.update_state_after_alloc(req, block_ids, num_external)
            self._record_hits(req, num_local, num_external)
        req.num_computed_tokens = num_computed
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        scheduler_output.scheduled_new_reqs.append(
            NewRequestData(
                req.request_id,
                list(req.all_token_ids),
                list(req.block_hashes),
                block_ids,
                num_computed,
                req.cache_salt,
            )
        )
        self._add_scheduled(scheduler_output, req, num_new, block_ids, admitted=True)
        return Admission(AdmissionOutcome.SCHEDULED, num_new)

    def _record_hits(self, req: Request, num_local: int, num_external: int) -> None:
        if req.num_cached_tokens is None:  # the first admission, not a re-admission
            req.num_cached_tokens = num_local
            req.num_external_tokens = num_external
            if num_external and self.connector is not None:
                req.external_hit_sources = self.connector.get_external_cache_hit_sources(
                    req, num_external
                )
            self.stats.num_prompt_tokens += len(req.prompt_token_ids)
            self.stats.num_cached_tokens += num_local
            self.stats.num_external_tokens += num_external

    def _add_scheduled(
        self,
        scheduler_output: SchedulerOutput,
        req: Request,
        num_new: int,
        block_ids: list[int],
        admitted: bool = False,
    ) -> None:
        start = req.num_computed_tokens
        params = req.sampling_params
        scheduler_output.scheduled.append(
            ScheduledRequest(
                request_id=req.request_id,
                token_ids=req.all_token_ids[start : start + num_new],
                start_position=start,
                block_ids=block_ids,
                sample=start + num_new == req.num_tokens,
                temperature=params.temperature,
                top_p=params.top_p,
                top_k=params.top_k,
                seed=params.seed
                if params.seed is not None
                else zlib.crc32(req.request_id.encode()),
                num_output_tokens=len(req.output_token_ids),
                sampling=req.sampling_options() if admitted else None,
            )
        )
        scheduler_output.num_scheduled_tokens[req.request_id] = num_new

    def _give_back(self, req: Request) -> None:
        """Free the request's blocks; it starts over (its cached prefix may survive)."""
        self.kv_cache_manager.free(req.request_id)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.stats.num_preemptions += 1

    def _preempt(self, req: Request, scheduler_output: SchedulerOutput) -> None:
        """A running request gives its blocks back and waits again: first, but behind the
        requests back from a load (they hold blocks, and finishing them frees those; behind
        one that cannot be admitted they would hold them for ever)."""
        self._give_back(req)
        req.status = RequestStatus.WAITING
        holds = self.kv_cache_manager.holds_blocks
        ahead = next((i for i, w in enumerate(self.waiting) if not holds(w.request_id)), None)
        self.waiting.insert(len(self.waiting) if ahead is None else ahead, req)
        scheduler_output.preempted_req_ids.add(req.request_id)
        if req.request_id in scheduler_output.num_scheduled_tokens:  # scheduled earlier
            del scheduler_output.num_scheduled_tokens[req.request_id]
            scheduler_output.scheduled = [
                s for s in scheduler_output.scheduled if s.request_id != req.request_id
            ]

    def _promote_finished_loads(self) -> None:
        for req_id in self._finished_recving:
            req = self._remote_waiting.pop(req_id, None)
            if req is None:
                continue
            self.kv_cache_manager.cache_blocks(req, req.num_computed_tokens)
            req.status = RequestStatus.WAITING
            self.waiting.appendleft(req)
        self._finished_recving.clear()

    # -- after the step -----------------------------------------------------------------------

    def update_from_output(
        self,
        scheduler_output: SchedulerOutput,
        sampled: dict[str, int],
        kv_output: KVConnectorOutput | None,
    ) -> list[Request]:
        """Apply a finished step; returns the requests that finished in it."""
        invalid = kv_output.invalid_block_ids if kv_output is not None else set()
        recompute = self._handle_invalid_blocks(invalid) if invalid else set()
        finished = self._advance_requests(scheduler_output, sampled, recompute)
        if self.connector is not None:
            self._apply_connector_output(kv_output or KVConnectorOutput())
        self._publish_events()
        return finished

    def _advance_requests(
        self, scheduler_output: SchedulerOutput, sampled: dict[str, int], recompute: set[str]
    ) -> list[Request]:
        """Computed tokens move on, full blocks enter the prefix cache, sampled tokens are
        appended and stop conditions checked."""
        finished: list[Request] = []
        for sched in scheduler_output.scheduled:
            req = self.requests.get(sched.request_id)
            if (
                req is None
                or req.status is not RequestStatus.RUNNING
                or req.request_id in recompute
            ):
                continue
            req.num_computed_tokens += len(sched.token_ids)
            self.kv_cache_manager.cache_blocks(req, req.num_computed_tokens)
            if sched.sample:
                req.append_output_token(sampled[req.request_id])
                status = req.check_stop()
                if status is not None:
                    self.running.remove(req)
                    self._finish(req, status)
                    finished.append(req)
        return finished

    def _apply_connector_output(self, kv_output: KVConnectorOutput) -> None:
        """The workers' folded connector output: stats, the connector's own state, finished
        loads (promoted next step) and finished saves (their blocks are freed)."""
        assert self.connector is not None
        if kv_output.kv_connector_stats is not None:
            self._add_connector_stats(kv_output.kv_connector_stats)
        self.connector.update_connector_output(kv_output)
        self._finished_recving |= kv_output.finished_recving or set()
        for req_id in kv_output.finished_recving or ():
            if req_id in self._aborted_loading:
                self._aborted_loading.discard(req_id)
                self.kv_cache_manager.free(req_id)
        for req_id in kv_output.finished_sending or ():
            if self._saving.pop(req_id, None) is not None:
                self.kv_cache_manager.free(req_id)

    def _add_connector_stats(self, stats: KVConnectorStats) -> None:
        """Totals since start (the workers report per-step deltas)."""
        if self.connector_stats is None:
            self.connector_stats = type(stats)()
        self.connector_stats.aggregate(stats)

    def _handle_invalid_blocks(self, invalid: set[int]) -> set[str]:
        """Requests whose blocks failed to load recompute from the first bad block; the
        tokens from there on are no longer counted as loaded."""
        affected: set[str] = set()
        for req in [*self.running, *self._remote_waiting.values()]:
            ids = self.kv_cache_manager.block_ids(req.request_id)
            bad = next((i for i, b in enumerate(ids) if b in invalid), None)
            if bad is None:
                continue
            req.num_computed_tokens = min(req.num_computed_tokens, bad * self.block_size)
            self.kv_cache_manager.truncate_computed(req, bad)
            self._uncount_recomputed(req, bad * self.block_size)
            affected.add(req.request_id)
            self.stats.num_recomputed_blocks += len(ids) - bad
        self.pool.evict_blocks(invalid)
        logger.warning(
            "%d blocks failed to load; %d requests recompute them", len(invalid), len(affected)
        )
        return affected

    def _uncount_recomputed(self, req: Request, num_kept: int) -> None:
        """A load failed from token `num_kept` on: what the request counts as loaded by the
        connector (`num_external_tokens`, hence `cached_tokens` in serve's usage and the
        loaded-tokens metric) keeps only the tokens before it, whose KV did load. Counts are
        those of the first admission: a failure after a preemption concerns a later one."""
        if req.num_cached_tokens is None or req.num_preemptions:
            return
        loaded = min(req.num_external_tokens, max(0, num_kept - req.num_cached_tokens))
        self.stats.num_external_tokens -= req.num_external_tokens - loaded
        req.num_external_tokens = loaded
        if self.connector is not None:
            req.external_hit_sources = self.connector.get_external_cache_hit_sources(req, loaded)

    def fail_all(self, reason: str) -> None:
        """The engine is gone: every unfinished request ends with an error."""
        for req in [*self.waiting, *self.running, *self._remote_waiting.values()]:
            req.status = RequestStatus.FINISHED_ERROR
            req.error = reason
        self.waiting.clear()
        self.running.clear()
        self._remote_waiting.clear()

    def _finish(self, req: Request, status: RequestStatus, free: bool = True) -> None:
        req.status = status
        self._finished_req_ids.add(req.request_id)
        del self.requests[req.request_id]
        hold, params = False, None
        if self.connector is not None:
            hold, params = self.connector.request_finished(
                req, self.kv_cache_manager.block_ids(req.request_id)
            )
        req.kv_transfer_params = params  # the answer's: the connector's alone, as vLLM's
        if hold:
            self._saving[req.request_id] = req
        elif free:
            self.kv_cache_manager.free(req.request_id)

    def _publish_events(self) -> None:
        events: list[Any] = self.pool.take_events()
        if self.connector is not None:
            events.extend(self.connector.take_events())
        if events:
            self.publisher.publish(KVEventBatch(time.time(), events))
            self.stats.num_events_published += len(events)

    def reset_prefix_cache(self, reset_connector: bool = False) -> bool:
        ok = self.pool.reset_prefix_cache()
        if ok and reset_connector and self.connector is not None:
            ok = self.connector.reset_cache() is not False
        self._publish_events()
        return ok

    def check_integrity(self) -> None:
        self.pool.check_integrity()
        held = set(self._saving) | self._aborted_loading
        live = {
            r.request_id for r in [*self.waiting, *self.running, *self._remote_waiting.values()]
        }
        assert live <= set(self.requests), "a queued request is not tracked"
        assert self.kv_cache_manager.num_requests <= len(live) + len(held), (
            "blocks held by unknown requests"
        )

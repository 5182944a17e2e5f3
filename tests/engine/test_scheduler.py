"""The scheduler's own logic, stepped by hand: the workers' sampled tokens are given."""

from typing import Any

from kvconnect.config import KVTransferConfig
from kvconnect.connector import KVConnectorContext, KVConnectorOutput, KVConnectorRole
from kvconnect.connector.base import ConnectorRequest
from kvconnect.engine.block_pool import BlockPool
from kvconnect.engine.request import Request, RequestStatus, SamplingParams
from kvconnect.engine.scheduler import Scheduler, SchedulerConfig
from kvconnect.messages import SchedulerOutput
from tests.connector.helpers import Recording

BS = 4
TOKEN = 7  # what the "workers" sample


class ScriptedConnector(Recording):
    """Scheduler half whose answers the test sets: matched tokens, async load, async save."""

    def __init__(self) -> None:
        cfg = KVTransferConfig(kv_connector="ScriptedConnector", kv_role="kv_both")
        super().__init__(KVConnectorContext(cfg, block_size=BS), KVConnectorRole.SCHEDULER)
        self.matched: dict[str, tuple[int | None, bool]] = {}
        self.async_save = False

    def get_num_new_matched_tokens(
        self, request: ConnectorRequest, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        super().get_num_new_matched_tokens(request, num_computed_tokens)
        return self.matched.get(request.request_id, (0, False))

    def request_finished(
        self, request: ConnectorRequest, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.async_save, {"blocks": len(block_ids)}


def make(
    num_blocks: int = 16,
    budget: int = 64,
    chunked: bool = True,
    connector: ScriptedConnector | None = None,
) -> Scheduler:
    cfg = SchedulerConfig(
        max_num_batched_tokens=budget, enable_chunked_prefill=chunked, max_model_len=256
    )
    return Scheduler(cfg, BlockPool(num_blocks, BS), connector)


def req(rid: str, n: int, max_tokens: int = 2, start: int = 0) -> Request:
    return Request(
        rid,
        list(range(start, start + n)),
        SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        BS,
    )


def step(s: Scheduler, kv: KVConnectorOutput | None = None) -> SchedulerOutput:
    out = s.schedule()
    s.update_from_output(out, {r.request_id: TOKEN for r in out.scheduled if r.sample}, kv)
    s.check_integrity()
    return out


def drain(s: Scheduler, limit: int = 100) -> list[SchedulerOutput]:
    """Steps until every request finished (AssertionError past `limit`); their outputs."""
    outs = []
    for _ in range(limit):
        if not s.has_unfinished_requests:
            return outs
        outs.append(step(s))
    raise AssertionError("requests did not finish")


def assert_all_free(s: Scheduler) -> None:
    assert s.pool.num_free_blocks == s.pool.num_blocks and s.kv_cache_manager.num_requests == 0
    s.check_integrity()


def test_chunked_prefill_splits_a_long_prompt_by_the_token_budget() -> None:
    s = make(budget=8)
    r = req("a", 20)
    s.add_request(r)
    outs = [step(s) for _ in range(4)]
    assert [o.num_scheduled_tokens for o in outs] == [{"a": 8}, {"a": 8}, {"a": 4}, {"a": 1}]
    assert [o.scheduled[0].sample for o in outs] == [False, False, True, True]
    assert [o.scheduled[0].start_position for o in outs] == [0, 8, 16, 20]
    assert r.output_token_ids == [TOKEN, TOKEN] and r.status is RequestStatus.FINISHED_LENGTH
    assert_all_free(s)


def test_without_chunking_a_prompt_waits_for_a_budget_that_fits() -> None:
    s = make(budget=32, chunked=False)
    s.add_request(req("a", 20))
    s.add_request(req("b", 20, start=50))
    first = step(s)
    assert first.num_scheduled_tokens == {"a": 20}
    assert step(s).num_scheduled_tokens == {"a": 1, "b": 20}
    drain(s)
    assert_all_free(s)


def test_out_of_blocks_preempts_the_newest_request_which_recomputes() -> None:
    s = make(num_blocks=5)  # 20 token slots
    a, b = req("a", 7, max_tokens=8), req("b", 7, max_tokens=8, start=50)
    s.add_request(a)
    s.add_request(b)
    preempted: set[str] = set()
    for _ in range(60):
        if not s.has_unfinished_requests:
            break
        preempted |= step(s).preempted_req_ids
    assert preempted == {"b"} and b.num_preemptions >= 1 and s.stats.num_preemptions >= 1
    assert a.output_token_ids == [TOKEN] * 8 and b.output_token_ids == [TOKEN] * 8
    assert_all_free(s)


def test_prefix_cache_hit_counts_whole_blocks_and_leaves_a_token_to_compute() -> None:
    s = make()
    s.add_request(req("a", 16))
    drain(s)
    b = req("b", 16)
    s.add_request(b)
    out = step(s)
    assert b.num_cached_tokens == 12  # 3 blocks; the 4th holds the last prompt token
    assert out.num_scheduled_tokens == {"b": 4} and out.scheduled[0].start_position == 12
    assert s.stats.num_cached_tokens == 12 and s.stats.num_prompt_tokens == 32
    drain(s)
    assert_all_free(s)


def test_prompt_logprobs_read_neither_the_prefix_cache_nor_a_connector() -> None:
    conn = ScriptedConnector()
    s = make(connector=conn)
    s.add_request(req("a", 16))
    drain(s)
    b = Request("b", list(range(16)), SamplingParams(max_tokens=2, prompt_logprobs=1), BS)
    conn.matched["b"] = (12, True)  # what the connector would load
    s.add_request(b)
    out = step(s)
    assert out.num_scheduled_tokens == {"b": 16} and out.scheduled[0].start_position == 0
    assert b.num_cached_tokens == 0 and b.num_external_tokens == 0
    (alloc,) = [c for c in conn.calls if c[:2] == ("update_state_after_alloc", "b")]
    assert alloc[2] == out.scheduled[0].block_ids and alloc[3] == 0  # 0 external tokens
    sampling = out.scheduled[0].sampling
    assert sampling is not None and sampling.prompt_logprobs == 1  # sent on admission only
    assert step(s).scheduled[0].sampling is None
    drain(s)
    assert_all_free(s)


def test_async_load_waits_for_finished_recving() -> None:
    conn = ScriptedConnector()
    s = make(connector=conn)
    r = req("a", 12)
    conn.matched["a"] = (8, True)
    s.add_request(r)
    out = step(s)
    assert out.scheduled == [] and r.status is RequestStatus.WAITING_FOR_REMOTE_KVS
    assert ("update_state_after_alloc", "a", [0, 1], 8) in conn.calls
    assert step(s).scheduled == []  # still loading
    step(s, KVConnectorOutput(finished_recving={"a"}))
    out = step(s)
    assert out.num_scheduled_tokens == {"a": 4} and out.scheduled[0].start_position == 8
    assert r.num_external_tokens == 8 and r.num_cached_tokens == 0
    drain(s)
    assert_all_free(s)


def test_connector_still_looking_skips_the_request_for_a_step() -> None:
    conn = ScriptedConnector()
    s = make(connector=conn)
    conn.matched["a"] = (None, False)
    s.add_request(req("a", 8))
    s.add_request(req("b", 8, start=40))
    assert step(s).num_scheduled_tokens == {"b": 8}
    conn.matched["a"] = (0, False)
    assert "a" in step(s).num_scheduled_tokens
    drain(s)
    assert_all_free(s)


def test_async_save_holds_blocks_until_finished_sending() -> None:
    conn = ScriptedConnector()
    conn.async_save = True
    s = make(connector=conn)
    r = req("a", 8, max_tokens=1)
    s.add_request(r)
    out = step(s)
    assert r.status is RequestStatus.FINISHED_LENGTH and r.kv_transfer_params == {"blocks": 2}
    assert s.has_pending_transfers and s.pool.num_free_blocks == 16 - 2
    assert step(s).finished_req_ids == {"a"}  # the workers learn it finished
    step(s, KVConnectorOutput(finished_sending={"a"}))
    assert not s.has_pending_transfers and out.finished_req_ids == set()
    assert_all_free(s)


def test_finished_ids_of_unknown_or_aborted_requests_are_ignored() -> None:
    conn = ScriptedConnector()
    s = make(connector=conn)
    conn.matched["a"] = (8, True)
    s.add_request(req("a", 12))
    step(s)
    s.abort_request("a")
    assert s.pool.num_free_blocks < 16  # the load still writes into its blocks
    step(s, KVConnectorOutput(finished_recving={"a", "ghost"}, finished_sending={"ghost"}))
    assert not s.has_unfinished_requests
    assert_all_free(s)


def test_invalid_blocks_are_recomputed_and_that_steps_token_dropped() -> None:
    conn = ScriptedConnector()
    s = make(connector=conn)
    r = req("a", 12, max_tokens=3)
    conn.matched["a"] = (8, False)  # a sync load of 2 blocks
    s.add_request(r)
    out = s.schedule()
    assert out.num_scheduled_tokens == {"a": 4}
    bad = out.scheduled[0].block_ids[1]
    s.update_from_output(out, {"a": TOKEN}, KVConnectorOutput(invalid_block_ids={bad}))
    assert r.num_computed_tokens == 4 and r.output_token_ids == []
    assert s.stats.num_recomputed_blocks == 2
    assert step(s).num_scheduled_tokens == {"a": 8}  # tokens 4..11 again
    drain(s)
    assert r.output_token_ids == [TOKEN] * 3
    assert_all_free(s)


def test_a_load_failed_from_its_first_block_recomputes_in_its_own_blocks() -> None:
    """The request keeps its blocks and is not looked up again: prefix hits found at that
    point (another request cached the same tokens meanwhile) must not be appended to them."""
    conn = ScriptedConnector()
    s = make(connector=conn)
    b = req("b", 12, max_tokens=2)
    conn.matched["b"] = (8, True)  # an async load of blocks 0 and 1
    s.add_request(b)
    step(s)
    assert b.status is RequestStatus.WAITING_FOR_REMOTE_KVS
    own = s.kv_cache_manager.block_ids("b")
    a = req("a", 12, max_tokens=1)  # the same tokens, computed here and cached
    s.add_request(a)
    assert step(s).num_scheduled_tokens == {"a": 12}
    lookups = [c for c in conn.calls if c[0] == "get_num_new_matched_tokens" and c[1] == "b"]
    # The whole load failed; it is reported with the load's completion.
    step(s, KVConnectorOutput(invalid_block_ids={own[0]}, finished_recving={"b"}))
    assert b.num_computed_tokens == 0
    out = step(s)
    assert out.num_scheduled_tokens == {"b": 12}
    ids = out.scheduled[0].block_ids
    assert ids[:2] == own and len(ids) == 3 and out.scheduled[0].start_position == 0
    assert [c for c in conn.calls if c[0] == "get_num_new_matched_tokens" and c[1] == "b"] == (
        lookups
    )
    drain(s)
    assert b.output_token_ids == [TOKEN] * 2
    assert_all_free(s)


def test_tokens_of_blocks_that_failed_to_load_are_not_counted_as_loaded() -> None:
    """Issue 34, finding 16: `num_external_tokens` (serve's cached_tokens, the loaded-tokens
    metric) counted the tokens of a load the workers then refused, and recomputed."""
    conn = ScriptedConnector()
    s = make(connector=conn)
    s.add_request(req("a", 16))
    drain(s)  # tokens 0..15 in the prefix cache: 4 blocks
    b = req("b", 28)  # its first 16 tokens are a's
    conn.matched["b"] = (8, False)  # a sync load of tokens 16..23 (blocks 4 and 5)
    s.add_request(b)
    out = s.schedule()
    assert out.num_scheduled_tokens == {"b": 4} and out.scheduled[0].start_position == 24
    bad = out.scheduled[0].block_ids[5]  # the second loaded block failed its checks
    s.update_from_output(out, {}, KVConnectorOutput(invalid_block_ids={bad}))
    s.check_integrity()
    assert b.num_computed_tokens == 20
    assert (b.num_cached_tokens, b.num_external_tokens) == (16, 4)  # before: (16, 8)
    assert s.stats.num_external_tokens == 4
    c = req("c", 12, start=100)
    conn.matched["c"] = (8, True)  # an async load of its first 2 blocks, both refused
    s.add_request(c)
    step(s)
    own = s.kv_cache_manager.block_ids("c")
    step(s, KVConnectorOutput(invalid_block_ids=set(own[:2]), finished_recving={"c"}))
    assert (c.num_cached_tokens, c.num_external_tokens) == (0, 0)  # before: (0, 8)
    assert s.stats.num_external_tokens == 4
    drain(s)
    assert b.output_token_ids == c.output_token_ids == [TOKEN] * 2
    assert (b.num_external_tokens, c.num_external_tokens) == (4, 0)
    assert_all_free(s)


def test_abort_frees_and_reports_the_id_to_workers() -> None:
    s = make()
    s.add_request(req("a", 8, max_tokens=50))
    step(s)
    s.abort_request("a")
    assert step(s).finished_req_ids == {"a"}
    assert_all_free(s)


def test_a_request_larger_than_the_pool_is_reported_stuck() -> None:
    s = make(num_blocks=2, budget=64)
    s.add_request(req("big", 12))  # needs 3 blocks of 4
    assert s.schedule().stuck_req_id == "big"


def test_a_request_back_from_a_load_goes_first_when_blocks_are_short() -> None:
    """A request that preempts itself lands ahead of one back from a load, which holds blocks;
    with nothing running, the first cannot be admitted until the second runs and frees its
    blocks. It is neither stuck (the engine would fail every request) nor left waiting: the
    one holding blocks goes first (bench/placement.py's pull burst met this)."""
    conn = ScriptedConnector()
    s = make(num_blocks=6, connector=conn)  # 24 token slots
    a, b = req("a", 8, max_tokens=4), req("b", 17, max_tokens=2, start=50)
    conn.matched["b"] = (16, True)  # b loads 4 blocks; a holds 2: the pool is full
    s.add_request(a)
    s.add_request(b)
    outs = [step(s, KVConnectorOutput(finished_recving={"b"}))]
    assert b.status is RequestStatus.WAITING_FOR_REMOTE_KVS and s.pool.num_free_blocks == 0
    outs.append(step(s))  # b back in waiting, holding its blocks; a needs a 3rd: preempted
    assert outs[-1].preempted_req_ids == {"a"} and not s.running
    outs += drain(s, limit=20)
    assert [o.stuck_req_id for o in outs] == [None] * len(outs)
    assert a.status is RequestStatus.FINISHED_LENGTH and b.status is RequestStatus.FINISHED_LENGTH
    assert a.output_token_ids == [TOKEN] * 4 and b.output_token_ids == [TOKEN] * 2
    assert_all_free(s)


def test_loads_that_fill_the_pool_do_not_wait_for_each_other_for_ever() -> None:
    """Two async loads of one prefix take every block; back from them, each needs one block
    more to compute its last tokens, and nothing runs to free one. One gives its blocks back
    (what it loaded stays in the prefix cache), so both finish (bench/placement.py's burst:
    8 pulls of a 2k prefix held a 16k-token pool, and the instance answered nothing more)."""
    conn = ScriptedConnector()
    s = make(num_blocks=8, connector=conn)  # 32 token slots
    a, b = req("a", 17, max_tokens=2), req("b", 17, max_tokens=2)  # one prompt: one prefix
    conn.matched["a"] = conn.matched["b"] = (16, True)  # 4 blocks each
    s.add_request(a)
    s.add_request(b)
    outs = [step(s, KVConnectorOutput(finished_recving={"a", "b"}))]
    assert s.pool.num_free_blocks == 0
    conn.matched.clear()  # asked again, it has nothing beyond the prefix cache's hit
    outs += drain(s, limit=20)
    assert [o.stuck_req_id for o in outs] == [None] * len(outs)
    assert a.status is RequestStatus.FINISHED_LENGTH and b.status is RequestStatus.FINISHED_LENGTH
    assert a.output_token_ids == b.output_token_ids == [TOKEN] * 2
    assert s.stats.num_preemptions == 1
    asked_again = [c for c in conn.calls if c[0] == "get_num_new_matched_tokens" and c[2] == 16]
    # the one that gave its blocks back found the other's cached (asked each step it waits)
    assert {c[1] for c in asked_again} in ({"a"}, {"b"})
    assert_all_free(s)

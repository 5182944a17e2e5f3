"""The engine end to end: real worker processes, real torch, real ZMQ."""

import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from kvconnect import LLM, SamplingParams
from kvconnect.engine.executor import EngineDeadError
from kvconnect.engine.request import RequestStatus
from kvconnect.engine.structured_output import StructuredOutputsParams
from kvconnect.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvconnect.hashing import to_wire
from kvconnect.model.config import TINY
from kvconnect.model.loader import tiny_state_dict
from kvconnect.model.tokenizer import BYTE_EOS
from kvconnect.stream.subscriber import KVEventSubscriber, ReceivedBatch
from tests.connector.helpers import MODULE
from tests.helpers import listening_sockets, read_through, wait_for

pytestmark = pytest.mark.slow

rng = random.Random(3)
SYSTEM = [rng.randrange(256) for _ in range(40)]
PROMPTS = [
    SYSTEM + [rng.randrange(256) for _ in range(150)],
    SYSTEM + [rng.randrange(256) for _ in range(9)],
    [rng.randrange(256) for _ in range(5)],
]
GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)


def dense_model() -> Any:
    """transformers' Llama with the tiny weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=TINY.vocab_size,
        hidden_size=TINY.hidden_size,
        intermediate_size=TINY.intermediate_size,
        num_hidden_layers=TINY.num_hidden_layers,
        num_attention_heads=TINY.num_attention_heads,
        num_key_value_heads=TINY.num_key_value_heads,
        rms_norm_eps=TINY.rms_norm_eps,
        rope_theta=TINY.rope_theta,
        max_position_embeddings=TINY.max_position_embeddings,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(cfg).eval()
    model.load_state_dict(tiny_state_dict(TINY, seed=0), strict=True)
    return model


def dense_reference(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy decoding with transformers' Llama on the tiny weights, no KV cache at all."""
    model = dense_model()
    outs = []
    with torch.no_grad():
        for prompt in prompts:
            ids = list(prompt)
            for _ in range(max_tokens):
                logits = model(torch.tensor([ids]), use_cache=False).logits[0, -1]
                ids.append(int(logits.argmax()))
            outs.append(ids[len(prompt) :])
    return outs


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    return dense_reference(PROMPTS, GREEDY.max_tokens)


@pytest.mark.parametrize(
    ("tp", "prefix_caching", "budget"),
    [(1, True, 1024), (2, False, 32), (2, True, 32)],
)
def test_greedy_matches_dense_reference(
    reference: list[list[int]], tp: int, prefix_caching: bool, budget: int
) -> None:
    with LLM(
        "tiny",
        tensor_parallel_size=tp,
        enable_prefix_caching=prefix_caching,
        max_num_batched_tokens=budget,
    ) as llm:
        first = llm.generate(PROMPTS, GREEDY)
        assert [o.outputs[0].token_ids for o in first] == reference
        assert all(o.num_cached_tokens == 0 for o in first[:1])
        again = llm.generate(PROMPTS, GREEDY)  # now from the prefix cache, when enabled
        assert [o.outputs[0].token_ids for o in again] == reference
        cached = [o.num_cached_tokens for o in again]
        if prefix_caching:
            assert cached == [(len(p) - 1) // 16 * 16 for p in PROMPTS]
        else:
            assert cached == [0, 0, 0]
        assert again[0].outputs[0].finish_reason == "length"
        llm.scheduler.check_integrity()
        assert llm.scheduler.kv_cache_manager.num_requests == 0


CONTROLS = SamplingParams(
    max_tokens=12,
    temperature=0.8,
    seed=11,
    ignore_eos=True,
    presence_penalty=0.8,
    frequency_penalty=0.4,
    repetition_penalty=1.5,
    min_p=0.02,
    logit_bias={65: 3.0},
    bad_words_token_ids=((233,), (125, 224)),
    logprobs=3,
)


GRAMMAR = SamplingParams(
    max_tokens=24,  # the regex's longest (20) and EOS fit
    temperature=1.0,
    seed=5,
    structured_outputs=StructuredOutputsParams(regex="[a-z]{2,6}( [a-z]{2,6}){2}"),
)


def test_seeded_sampling_is_reproducible_across_tp() -> None:
    """The same samples at TP 1 and 2, with the controls and with a grammar (its matcher is
    the scheduler's: the workers only get the step's bitmask)."""
    params = SamplingParams(max_tokens=12, temperature=0.8, seed=11, ignore_eos=True)
    runs, controlled, grammatical = [], [], []
    for tp in (1, 2):
        with LLM("tiny", tensor_parallel_size=tp) as llm:
            runs.append([o.outputs[0].token_ids for o in llm.generate(PROMPTS[1:], params)])
            controlled.append([o.outputs[0] for o in llm.generate(PROMPTS[1:], CONTROLS)])
            grammatical.append([o.outputs[0] for o in llm.generate(PROMPTS[1:], GRAMMAR)])
    assert runs[0] == runs[1]
    assert [o.token_ids for o in grammatical[0]] == [o.token_ids for o in grammatical[1]]
    for out in grammatical[0]:  # the grammar ended it: EOS is the only token it allows then
        assert re.fullmatch("[a-z]{2,6}( [a-z]{2,6}){2}", out.text), out.text
        assert out.finish_reason == "stop" and out.token_ids[-1] == BYTE_EOS
    assert runs[0][0] != dense_reference([PROMPTS[1]], 12)[0]  # not greedy
    ones, twos = controlled
    assert [o.token_ids for o in ones] == [o.token_ids for o in twos]
    for one, two in zip(ones, twos, strict=True):
        assert one.logprobs is not None and two.logprobs is not None
        assert [lp.token_id for lp in one.logprobs] == one.token_ids
        for a, b in zip(one.logprobs, two.logprobs, strict=True):  # TP sums in another order
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4) and a.rank == b.rank
        assert 233 not in one.token_ids and all(len(lp.top_token_ids) == 3 for lp in one.logprobs)
    assert [o.token_ids for o in ones] != runs[0]  # the controls changed the samples


def assert_nothing_held(llm: LLM) -> None:
    """The no-leak ending: no request holds a block, every block is free (or cached and free)."""
    llm.scheduler.check_integrity()
    pool = llm.scheduler.pool
    assert llm.scheduler.kv_cache_manager.num_requests == 0
    assert pool.num_free_blocks == pool.num_blocks
    assert not llm.has_unfinished_requests and not llm.has_pending_transfers


def test_step_returns_each_requests_new_tokens_and_text_then_its_end() -> None:
    greedy = SamplingParams(max_tokens=4, ignore_eos=True)
    with LLM("tiny", num_kv_blocks=64) as llm:
        (whole,) = llm.generate(["Hello"], greedy)
        # The tiny model's greedy bytes: 199 and 208 start UTF-8 sequences that never
        # complete, 148 continues none; each decodes to U+FFFD once it cannot change.
        assert whole.outputs[0].token_ids == [199, 116, 148, 208]
        assert whole.outputs[0].text == "\ufffdt\ufffd\ufffd"
        a = llm.add_request("Hello", greedy).request_id
        b = llm.add_request("Hello", replace(greedy, stop=("t",))).request_id
        steps = [
            [(d.request_id, d.token_ids, d.text, d.finish_reason, d.stop_reason) for d in step]
            for step in (llm.step() for _ in range(4))
        ]
        assert steps == [
            [(a, [199], "", None, None), (b, [199], "", None, None)],  # half a character
            [(a, [116], "\ufffdt", None, None), (b, [116], "\ufffd", "stop", "t")],
            [(a, [148], "", None, None)],  # b's delta was its last; a's byte may yet complete
            [(a, [208], "\ufffd\ufffd", "length", None)],  # the end: everything is final
        ]
        assert llm.step() == []
        assert_nothing_held(llm)


def test_an_aborted_request_is_never_reported_again_and_its_blocks_come_back() -> None:
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    with LLM("tiny", num_kv_blocks=64) as llm:
        keep = llm.add_request("Hello", params)
        gone = llm.add_request(list(range(40)), params)  # 3 blocks of 16
        assert [d.request_id for d in llm.step()] == [keep.request_id, gone.request_id]
        stats = llm.stats()
        assert (stats.num_running, stats.num_waiting, stats.kv_cache_usage) == (2, 0, 4 / 64)
        llm.abort([gone.request_id, "no such request"])
        assert gone.status is RequestStatus.FINISHED_ABORTED
        assert llm.stats().kv_cache_usage == 1 / 64
        second, third = llm.step(), llm.step()
        assert [(d.request_id, d.finish_reason) for d in second + third] == [
            (keep.request_id, None),
            (keep.request_id, "length"),
        ]
        llm.abort([keep.request_id])  # finished: nothing to do
        assert keep.status is RequestStatus.FINISHED_LENGTH
        assert llm.step() == []
        assert_nothing_held(llm)


def test_check_alive_notices_a_dead_worker_fails_every_request_and_shuts_down() -> None:
    llm = LLM("tiny", distributed_executor_backend="mp")
    llm.check_alive()  # all well: nothing happens
    waiting = llm.add_request("Hello", SamplingParams(max_tokens=4))
    (pid,) = llm.executor.worker_pids
    assert pid is not None
    os.kill(pid, signal.SIGKILL)

    def exit_seen() -> bool:
        llm.check_alive()  # raises once the fork server has reported the exit
        return False

    with pytest.raises(EngineDeadError, match="worker 0 died"):
        wait_for(exit_seen, what="check_alive never noticed the dead worker")
    assert waiting.status is RequestStatus.FINISHED_ERROR and not llm.has_unfinished_requests
    assert llm.executor.worker_pids == []  # shut down, nothing left running
    with pytest.raises(EngineDeadError):
        llm.check_alive()  # and it stays dead


@pytest.fixture
def events_llm() -> Iterator[tuple[LLM, KVEventSubscriber]]:
    with tempfile.TemporaryDirectory() as d:
        cfg = {
            "enable_kv_cache_events": True,
            "endpoint": f"ipc://{d}/ev",
            "replay_endpoint": f"ipc://{d}/replay",
            "topic": "kv",
        }
        llm = LLM(
            "tiny",
            tensor_parallel_size=1,
            block_size=4,
            num_kv_blocks=40,
            kv_events_config=cfg,
            max_num_batched_tokens=64,
        )
        # Catches up at connect through replay: nothing published is missed, whenever it joins.
        sub = KVEventSubscriber(f"ipc://{d}/ev", f"ipc://{d}/replay", topic="kv", start_seq=0)
        try:
            yield llm, sub
        finally:
            sub.close()
            llm.shutdown()


def test_published_events_match_the_cache_after_a_random_workload(
    events_llm: tuple[LLM, KVEventSubscriber],
) -> None:
    llm, sub = events_llm
    r = random.Random(5)
    prefixes = [[r.randrange(256) for _ in range(12)] for _ in range(3)]
    for _ in range(6):
        batch = [
            r.choice(prefixes) + [r.randrange(256) for _ in range(r.randrange(1, 30))]
            for _ in range(4)
        ]
        llm.generate(batch, SamplingParams(max_tokens=r.randrange(1, 6), ignore_eos=True))
    counts: Counter[int | bytes] = Counter()
    num_removed = 0
    batches = read_through(sub, llm.publisher)
    assert [b.seq for b in batches] == list(range(len(batches)))
    for item in batches:
        for ev in item.batch.events:
            if isinstance(ev, BlockStored):
                assert ev.medium == "GPU" and len(ev.token_ids) == 4 * len(ev.block_hashes)
                counts.update(ev.block_hashes)
            elif isinstance(ev, BlockRemoved):
                counts.subtract(ev.block_hashes)
                num_removed += 1
    assert num_removed > 0, "the workload should have evicted blocks"
    expected = {to_wire(h): n for h, n in llm.scheduler.pool.cached_hashes().items()}
    assert +counts == expected
    llm.scheduler.check_integrity()
    # A reset clears the cache and says so.
    assert llm.reset_prefix_cache() is True
    item = sub.recv(timeout=2.0)
    assert isinstance(item, ReceivedBatch) and item.batch.events == [AllBlocksCleared()]


def test_worker_connector_events_reach_the_stream_once_across_tp_processes() -> None:
    with tempfile.TemporaryDirectory() as d:
        events = {"enable_kv_cache_events": True, "endpoint": f"ipc://{d}/ev"}
        transfer = {
            "kv_connector": "WorkerEventsConnector",
            "kv_role": "kv_both",
            "kv_connector_module_path": MODULE,
            "kv_connector_extra_config": {"medium": "STORAGE", "lagging_rank": 1},
        }
        with LLM(
            "tiny",
            tensor_parallel_size=2,
            block_size=4,
            kv_events_config=events,
            kv_transfer_config=transfer,
        ) as llm:
            sub = KVEventSubscriber(f"ipc://{d}/ev")
            assert llm.publisher.wait_for_subscriber()  # type: ignore[attr-defined]
            prompt = list(range(30, 50))  # 5 full blocks
            llm.generate([prompt], SamplingParams(max_tokens=2, ignore_eos=True))
            disk = []
            for item in read_through(sub, llm.publisher):
                disk += [e for e in item.batch.events if e.medium == "STORAGE"]  # type: ignore[union-attr]
            sub.close()
            llm.scheduler.check_integrity()
            assert llm.scheduler.pool.num_free_blocks == llm.scheduler.pool.num_blocks
    assert len(disk) == 1 and isinstance(disk[0], BlockStored)
    assert len(disk[0].block_hashes) == 5  # stored on both ranks, published once


def test_a_killed_worker_fails_the_requests_quickly() -> None:
    llm = LLM("tiny", tensor_parallel_size=2, step_timeout=30)
    pid = llm.executor.worker_pids[1]
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(EngineDeadError, match="worker 1"):
        llm.generate(PROMPTS, GREEDY)
    assert time.monotonic() - start < 15
    assert llm.executor.worker_pids == []  # shut down, nothing left running
    with pytest.raises(RuntimeError, match="after shutdown"):
        llm.generate(PROMPTS, GREEDY)


@pytest.mark.parametrize("rank", [0, 1])
def test_a_hung_worker_times_out_is_named_and_everything_is_stopped(rank: int) -> None:
    llm = LLM("tiny", tensor_parallel_size=2, step_timeout=3)
    pids = list(llm.executor.worker_pids)
    os.kill(pids[rank], signal.SIGSTOP)  # alive but never answers; its peer waits for it
    start = time.monotonic()
    with pytest.raises(EngineDeadError) as err:
        llm.generate(PROMPTS[2:], GREEDY)
    assert str(err.value) == f"worker {rank} did not answer within 3s (stopped by a signal)"
    assert time.monotonic() - start < 15
    for pid in pids:  # no worker left behind
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_tp_workers_listen_on_loopback_only() -> None:
    """torch.distributed's TCPStore listens on every interface: the workers meet at a
    FileStore, and gloo's pair sockets are on loopback."""
    with LLM("tiny", tensor_parallel_size=2) as llm:
        pids = [p for p in llm.executor.worker_pids if p is not None]
        assert len(pids) == 2
        out = llm.generate(PROMPTS[2:], GREEDY)  # the process group works
        assert out[0].outputs[0].token_ids
        found = listening_sockets([os.getpid(), *pids])
        assert found, "gloo listens for its peers: the check would see that"
        assert {addr for addr, _ in found} <= {"127.0.0.1", "::1"}, found


def test_cli_generate_prints_outputs_and_what_was_published(tmp_path: Path) -> None:
    events = json.dumps({"enable_kv_cache_events": True, "endpoint": f"ipc://{tmp_path}/ev"})
    cmd = [
        sys.executable,
        "-m",
        "kvconnect.cli",
        "generate",
        "--model",
        "tiny",
        "--tp",
        "1",
        "--prompt",
        "x" * 40,
        "--max-tokens",
        "2",
        "--repeat",
        "2",
        "--kv-events-config",
        events,
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True).stdout
    assert "[run 1 prompt 0] 40 prompt tokens, 32 from the prefix cache" in out
    assert "published 1 batches: 1 BlockStored(GPU) [2 blocks]" in out  # run 1 hit the cache


def test_config_arguments_take_objects_dicts_and_json() -> None:
    from kvconnect.config import KVEventsConfig
    from kvconnect.engine.llm import as_config

    obj = KVEventsConfig(enable_kv_cache_events=True, topic="t")
    assert as_config(KVEventsConfig, obj) is obj
    assert as_config(KVEventsConfig, {"enable_kv_cache_events": True, "topic": "t"}) == obj
    assert as_config(KVEventsConfig, '{"enable_kv_cache_events": true, "topic": "t"}') == obj
    with pytest.raises(ValueError, match="valid keys"):
        as_config(KVEventsConfig, '{"enable": true}')

"""Two router replicas over the same instances, each following every stream, make the same
decision for every request of a replayed workload: nothing in a decision depends on which
replica makes it (its own history, its start time, what it missed)."""

import random
import tempfile
from pathlib import Path

import pytest

from kvconnect import LLM, SamplingParams
from kvconnect.model.tokenizer import load_tokenizer
from kvconnect.router.core import Router
from kvconnect.router.index import BlockIndex
from kvconnect.router.instances import Instance
from tests.helpers import wait_for

pytestmark = pytest.mark.slow

rng = random.Random(8)
TENANTS = [[rng.randrange(256) for _ in range(96)] for _ in range(3)]


def test_two_replicas_decide_alike_on_a_replayed_workload(tmp_path: Path) -> None:
    engines: dict[str, LLM] = {}
    instances = []
    try:
        for i in range(2):
            d = Path(tempfile.mkdtemp(dir=tmp_path))
            events = {
                "enable_kv_cache_events": True,
                "endpoint": f"ipc://{d}/ev",
                "replay_endpoint": f"ipc://{d}/replay",
                "buffer_steps": 8,  # a late replica gets the state as a snapshot
            }
            url = f"http://127.0.0.1:{9100 + i}"
            engines[url] = LLM("tiny", block_size=4, num_kv_blocks=64, kv_events_config=events)
            instances.append(Instance(url, events["endpoint"], events["replay_endpoint"]))
        first = Router(instances, BlockIndex(block_size=4), load_tokenizer("tiny")).start()
        second = None
        decisions: list[tuple[str, str]] = []
        for n in range(40):
            if n == 15:  # the second replica starts late, after the rings moved on
                second = Router(instances, BlockIndex(block_size=4), load_tokenizer("tiny")).start()
            tokens = rng.choice(TENANTS) + [rng.randrange(256) for _ in range(rng.randrange(4, 40))]
            replicas = [first] if second is None else [first, second]
            for r in replicas:  # the same state: every published batch applied
                wait_applied(r, engines)
            picks = []
            for r in replicas:
                picked = r.pick(r.scored(tokens), set())
                assert picked is not None
                picks.append(picked[0].name)
            if second is not None:
                decisions.append((picks[0], picks[1]))
            # Each replica routes its share of the traffic and counts what it sent: their own
            # histories differ, which must not change any decision.
            replicas[n % len(replicas)].counts.decisions[picks[0]] += 1
            engines[picks[0]].generate([tokens], SamplingParams(max_tokens=2, ignore_eos=True))
        assert len(decisions) == 25
        assert all(a == b for a, b in decisions), decisions
        assert {a for a, _ in decisions} == set(engines)  # both instances were used
        assert second is not None and second.index.stats.snapshots >= 1
    finally:
        for r in (first, second):
            if r is not None:
                r.close()
        for llm in engines.values():
            llm.shutdown()


def wait_applied(router: Router, engines: dict[str, LLM], timeout: float = 10.0) -> None:
    """Until the router's index reflects every batch each engine has published: its
    subscriber's last seq per stream equals the publisher's."""
    want = {
        name: llm.publisher.num_published - 1  # type: ignore[attr-defined]
        for name, llm in engines.items()
    }

    def seen() -> dict[str, int]:
        with router.lock:
            return dict(router.follow.last_seq)

    def applied() -> bool:
        last = seen()
        return all(last.get(n, -1) >= s for n, s in want.items())

    wait_for(applied, timeout, what=lambda: (seen(), want))

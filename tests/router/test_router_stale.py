"""A load miss the index did not know about: Redis loses chunks without announcing them (the
tier's `watch` off), the router still credits the instance, the instance computes the prompt,
and the router drops the stale entries when the answer's usage says so."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest
import redis

from tests.conftest import start_redis
from tests.helpers import wait_for
from tests.serving import RouterProcess, Serve, get, post

pytestmark = pytest.mark.slow


def test_a_silent_loss_in_redis_is_found_by_the_answer_and_counted_stale(tmp_path: Path) -> None:
    store = start_redis()
    transfer = {
        "kv_connector": "OffloadConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "chunk_size": 32,
            "tiers": [{"kind": "redis", "url": store.url, "watch": False}],
        },
    }
    # 24 blocks of 16 tokens: a few other prompts push one out of the engine's own cache.
    server = Serve(
        tmp_path,
        "--num-kv-blocks",
        "24",
        "--kv-transfer-config",
        json.dumps(transfer),
        "--enable-prompt-tokens-details",  # the router checks its index against it
    )
    router = RouterProcess(tmp_path, [server])
    try:
        server.start()
        router.start()
        rng = random.Random(3)
        prompt = [rng.randrange(256) for _ in range(150)]  # 4 chunks of 32
        body = {"prompt": prompt, "max_tokens": 1}

        def score() -> dict[str, object]:
            status, answer, _ = post(router.url + "/kv/score", {"prompt": prompt})
            assert status == 200, answer
            return dict(answer["instances"][server.url])

        assert post(router.url + "/v1/completions", body)[0] == 200
        for i in range(3):
            other = [random.Random(100 + i).randrange(256) for _ in range(150)]
            assert (
                post(server.url + "/v1/completions", {"prompt": other, "max_tokens": 1})[0] == 200
            )
        # What the router believes: the prompt's chunks in redis, nothing on the GPU.
        wait_for(lambda: score()["blocks_per_tier"] == {"STORAGE/REMOTE": 8}, 20, 0.02)
        redis.Redis(port=store.port).flushall()  # lost, and nobody says so
        status, answer, _ = post(router.url + "/v1/completions", body)
        assert status == 200 and answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        # The answer corrected the index: its 8 shared entries were dropped as stale (what
        # the engine recomputes and stores again comes back through its events later).
        _, text = get(router.url + "/metrics")
        found = re.search(
            r'^kvconnect_router_index_stale_total\{tier="STORAGE/REMOTE"\} (\S+)$', text, re.M
        )
        assert found and float(found.group(1)) == 8
        assert re.search(r'^kvconnect_router_index_removed_total\{tier="GPU"\} ', text, re.M)
    finally:
        router.stop()
        server.stop()
        store.stop()

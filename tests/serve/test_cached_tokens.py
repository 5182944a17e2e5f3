"""`cached_tokens` counts only KV that was loaded (issue 34, finding 16), on a real
`kvconnect serve` with a signed disk tier.

A chunk whose file was changed on disk fails its signature when a load reads it: its blocks
(and every block after the first bad one) are recomputed, and the answer is the one of a run
without any cache. serve's `usage.prompt_tokens_details.cached_tokens` still counted them as
loaded (and so did `kvconnect_connector_loaded_tokens_total`): 128 for a prompt whose 4
stored chunks were all refused. Now it counts the tokens before the first refused chunk.

    the prompt's 4 chunks of 32 as stored           cached_tokens 128
    the third chunk's file changed                  64 (the first two loaded)
    all four changed                                0
    every answer                                    the one without a cache

Each round first pushes the prompt's blocks out of the engine's own prefix cache (24 blocks:
three other prompts of 10 blocks take every free one), so whatever it reuses comes from the
disk tier; the untouched round (128, not 144) shows that they were gone.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvconnect.connector.offload.tiers.base import TierError, peek_key, unpack
from kvconnect.connector.offload.tiers.disk import SUFFIX
from tests.helpers import wait_for
from tests.serving import Serve, get, post

pytestmark = pytest.mark.slow

CHUNK = 32
NUM_CHUNKS = 4
rng = random.Random(34)
PROMPT = [rng.randrange(256) for _ in range(150)]  # 4 whole chunks of 32, 10 blocks of 16
KEY = b"0123456789abcdef0123456789abcdef"


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Serve, Path]]:
    tmp = tmp_path_factory.mktemp("cached-tokens")
    key_file = tmp / "deployment.key"
    key_file.write_bytes(KEY + b"\n")
    key_file.chmod(0o600)
    root = tmp / "disk"
    transfer = {
        "kv_connector": "OffloadConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "chunk_size": CHUNK,
            "tiers": [
                {
                    "kind": "disk",
                    "path": str(root),
                    "max_bytes": 1 << 28,
                    "hmac_key_file": str(key_file),
                }
            ],
        },
    }
    server = Serve(
        tmp,
        "--num-kv-blocks",
        "24",
        "--kv-transfer-config",
        json.dumps(transfer),
        "--enable-prompt-tokens-details",
    )
    server.start()
    try:
        yield server, root
    finally:
        assert server.stop() == 0, server.logs()


def complete(server: Serve, prompt: list[int], max_tokens: int = 6) -> tuple[list[int], int]:
    """The answer's token ids and its cached_tokens."""
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    status, answer, _ = post(server.url + "/v1/completions", body)
    assert status == 200, answer
    cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
    return answer["choices"][0]["token_ids"], cached


def chunk_files(root: Path) -> dict[int, Path]:
    """PROMPT's chunks (by index) whose files on disk hold them, signed with the key."""
    wanted = {tuple(PROMPT[i * CHUNK : (i + 1) * CHUNK]): i for i in range(NUM_CHUNKS)}
    found: dict[int, Path] = {}
    for path in root.glob(f"model-*/tp1-rank0/*{SUFFIX}"):
        try:
            blob = path.read_bytes()
            info, _ = unpack(blob, peek_key(blob), KEY)
        except (OSError, TierError):
            continue  # being replaced, or the file this test changed
        index = wanted.get(tuple(info.token_ids))
        if index is not None:
            found[index] = path
    return found


def stored(root: Path) -> dict[int, Path]:
    """Waits until the tier holds all of PROMPT's chunks, valid (stores run after answers)."""
    files: dict[int, Path] = {}

    def complete_set() -> bool:
        nonlocal files
        files = chunk_files(root)
        return len(files) == NUM_CHUNKS

    wait_for(complete_set, timeout=30, what=lambda: f"chunks on disk: {sorted(files)}")
    return files


def metric(server: Serve, name: str) -> float:
    status, text = get(server.url + "/metrics")
    assert status == 200, text
    found = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    assert found, f"no {name} in /metrics"
    return float(found.group(1))


def test_cached_tokens_count_only_the_chunks_that_loaded(served: tuple[Serve, Path]) -> None:
    server, root = served
    reference, cached = complete(server, PROMPT)  # nothing cached yet: computed
    assert cached == 0
    others = random.Random(3416)
    reported: list[int] = []
    # Untouched: the 4 chunks and the tail its first answer left (block 8), 144 tokens.
    for tampered, expected in (((), 144), ((2,), 64), ((0, 1, 2, 3), 0)):
        files = stored(root)
        for _ in range(3):  # push PROMPT's blocks out of the engine's own cache
            other = [others.randrange(256) for _ in range(150)]
            assert complete(server, other, max_tokens=1)[1] == 0
        for i in tampered:
            blob = bytearray(files[i].read_bytes())
            blob[-40] ^= 0x10  # a payload byte: the signature no longer matches
            files[i].write_bytes(blob)
        tokens, cached = complete(server, PROMPT)
        print(f"tampered chunks {tampered}: cached_tokens {cached}")
        reported.append(cached)
        assert tokens == reference
        assert cached == expected, (tampered, cached)
    assert metric(server, "kvconnect_connector_num_load_errors_total") == 2
    # What the connector counts as loaded is what the answers said.
    assert metric(server, "kvconnect_connector_loaded_tokens_total") == sum(reported)
    stored(root)  # the recomputed chunks are stored again, signed
    wait_for(lambda: metric(server, "vllm:num_requests_running") == 0, timeout=10)
    assert metric(server, "vllm:kv_cache_usage_perc") == 0  # no block held

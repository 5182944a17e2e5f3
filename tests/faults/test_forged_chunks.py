"""A writer to the shared stores tries to steer another instance's outputs (issue 25, point 1):
chunks with overwritten values (checksums recomputed, as anyone with the code can), prompt Q's
chunks under prompt P's keys, a payload of one KV head that would broadcast into all of them,
chunks planted for a prompt nobody has sent. In a real redis-server and on disk, under real
engines: the outputs always equal a run without tiers, each bad entry is a counted miss, and
afterwards the tiers' events match what the tiers hold."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import torch

from kvconnect import LLM, SamplingParams
from kvconnect.commands.redis_server import LocalRedis
from kvconnect.connector.offload.common import ChunkInfo, chunk_key
from kvconnect.connector.offload.connector import OffloadConnector
from kvconnect.connector.offload.scheduler import OffloadScheduler
from kvconnect.connector.offload.tiers.base import pack, peek_key, unpack
from kvconnect.connector.offload.tiers.disk import SUFFIX, DiskTier
from kvconnect.connector.offload.tiers.redis_client import KEY_PREFIX
from kvconnect.events import TIER_STORAGE_LOCAL, BlockRemoved, BlockStored
from kvconnect.hashing import block_hashes
from tests.conftest import start_redis
from tests.connector.offload.test_offload_engine import assert_no_leaks, offload, step_until
from tests.connector.offload.test_redis_removals import Instance
from tests.faults.test_tier_faults import disk_contents, held, rank_dir

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)


def prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(150)]


P, Q, X = prompt(21), prompt(22), prompt(23)
"""150 tokens each: 4 whole chunks of 32. X is never sent before the planted chunks wait."""
NUM_CHUNKS = 4
NUM_ENTRIES = NUM_CHUNKS + 1
"""What one generated prompt stores: its chunks, and a tail (blocks 128-143) when it ends."""
LOADED = NUM_CHUNKS * 32 + 16
ATTACKER_KEY = b"attacker's own key, not the one!"


@pytest.fixture(scope="module")
def reference() -> dict[str, list[int]]:
    with LLM("tiny") as llm:
        outs = llm.generate([P, Q, X], GREEDY)
    return {name: o.outputs[0].token_ids for name, o in zip("PQX", outs, strict=True)}


@pytest.fixture
def server() -> Iterator[LocalRedis]:
    s = start_redis()
    yield s
    s.stop()


@pytest.fixture
def key_file(tmp_path: Path) -> str:
    path = tmp_path / "deployment.key"
    path.write_bytes(b"0123456789abcdef0123456789abcdef\n")
    path.chmod(0o600)
    return str(path)


def instance(tmp: Path, name: str, tier: dict[str, Any]) -> Instance:
    """An engine with `tier`, its events followed (in its own directory under `tmp`)."""
    (tmp / name).mkdir()
    return Instance(tmp / name, tier)


def scheduler(inst: Instance) -> OffloadScheduler:
    return scheduler_of(inst.llm)


def scheduler_of(llm: LLM) -> OffloadScheduler:
    connector = llm.connector
    assert isinstance(connector, OffloadConnector) and connector.scheduler is not None
    return connector.scheduler


def stat(inst: Instance, name: str) -> int:
    stats = inst.llm.scheduler.connector_stats
    return 0 if stats is None else int(stats.data.get(name, 0))


def generate(inst: Instance, prompt: list[int]) -> tuple[list[int], int]:
    """The engine's own cache reset, then `prompt`: its output and the tokens it loaded; waits
    until what the request stored is published, and checks the engine leaked nothing."""
    assert inst.llm.reset_prefix_cache() is True
    [out] = inst.llm.generate([prompt], GREEDY)
    inst.until(lambda: not scheduler(inst).has_pending_work())
    inst.llm.scheduler.check_integrity()
    pool = inst.llm.scheduler.pool
    assert pool.num_free_blocks == pool.num_blocks
    return out.outputs[0].token_ids, out.num_external_tokens


def chunks_in_redis(client: redis.Redis, tokens: list[int]) -> list[tuple[str, ChunkInfo, Any]]:
    """`tokens`' chunks as Redis holds them, in order: (key, header, data)."""
    found = {}
    for raw in client.scan_iter(match=KEY_PREFIX + "*"):
        key = raw.decode().removeprefix(KEY_PREFIX)
        info, data = unpack(client.get(raw), key)
        found[info.token_ids] = (key, info, data)
    return [found[tuple(tokens[i * 32 : (i + 1) * 32])] for i in range(NUM_CHUNKS)]


def forge(kind: str, key: str, mine: ChunkInfo, data: Any, theirs: ChunkInfo, other: Any) -> bytes:
    """What an attacker writes at `key` (P's chunk `mine`, with `data`), given Q's chunk."""
    if kind == "swapped":  # Q's chunk, under P's key, its key field rewritten to match
        return b"".join(pack(key, theirs, other))
    if kind == "broadcast":  # P's header, one KV head of garbage that broadcasts to all
        return b"".join(pack(key, mine, torch.full_like(data[:, :, :, :1], 3.0)))
    if kind == "values":  # P's header, Q's values, checksums recomputed, unsigned
        return b"".join(pack(key, mine, other))
    assert kind == "wrong_key"  # signed, but not with the deployment's key
    return b"".join(pack(key, mine, other, ATTACKER_KEY))


def redis_tier(server: LocalRedis, key_file: str | None) -> dict[str, Any]:
    tier: dict[str, Any] = {"kind": "redis", "url": server.url}
    return tier | ({"hmac_key_file": key_file} if key_file else {})


@pytest.mark.parametrize(
    "kind,signed", [("swapped", False), ("broadcast", False), ("values", True), ("wrong_key", True)]
)
def test_forged_chunks_in_redis_never_change_an_output(
    tmp_path: Path,
    server: LocalRedis,
    key_file: str,
    reference: dict[str, list[int]],
    kind: str,
    signed: bool,
) -> None:
    tier = redis_tier(server, key_file if signed else None)
    writer = instance(tmp_path, "a", tier)  # an honest instance fills Redis with P and Q
    try:
        for prompt in (P, Q):
            generate(writer, prompt)
    finally:
        writer.close()
    client = redis.Redis.from_url(server.url)
    ours, theirs = chunks_in_redis(client, P), chunks_in_redis(client, Q)
    for (key, mine, data), (_, other_info, other) in zip(ours, theirs, strict=True):
        client.set(KEY_PREFIX + key, forge(kind, key, mine, data, other_info, other))
    fresh = instance(tmp_path, "b", tier)
    try:
        assert generate(fresh, P)[0] == reference["P"]
        assert stat(fresh, "num_integrity_misses") == NUM_CHUNKS
        assert stat(fresh, "num_redis_integrity_misses") == NUM_CHUNKS
        # The miss recomputed P and its save wrote P's true chunks again: they load now.
        assert generate(fresh, P) == (reference["P"], NUM_CHUNKS * 32)
        assert generate(fresh, Q) == (reference["Q"], NUM_CHUNKS * 32)  # honest entries load
        assert stat(fresh, "num_integrity_misses") == NUM_CHUNKS
    finally:
        fresh.close()


def plant(client: redis.Redis, sched: OffloadScheduler, shape: tuple[int, ...], sign: bool) -> None:
    """X's chunks, made as an attacker who knows the hashing (vLLM's public default seed) and
    the key layout (visible in any key listing), with values of their choice."""
    hashes = block_hashes(X, sched.context.block_size)
    for i in range(NUM_CHUNKS):
        info = sched.chunk_info(X, hashes, i, None)
        [key] = sched._rank_keys(info.last_block_hash)
        data = torch.full(shape, 5.0)
        blob = b"".join(pack(key, info, data, ATTACKER_KEY if sign else None))
        client.set(KEY_PREFIX + key, blob)


def test_chunks_planted_in_redis_for_an_unsent_prompt_are_misses_under_a_key(
    tmp_path: Path, server: LocalRedis, key_file: str, reference: dict[str, list[int]]
) -> None:
    tier = redis_tier(server, key_file)
    inst = Instance(tmp_path, tier)
    client = redis.Redis.from_url(server.url)
    try:
        generate(inst, P)
        shape = tuple(chunks_in_redis(client, P)[0][2].shape)
        plant(client, scheduler(inst), shape, sign=False)
        assert generate(inst, X)[0] == reference["X"]
        assert stat(inst, "num_integrity_misses") == NUM_CHUNKS
        plant(client, scheduler(inst), shape, sign=True)  # signed with the wrong key
        assert generate(inst, X)[0] == reference["X"]
        assert stat(inst, "num_integrity_misses") == 2 * NUM_CHUNKS
    finally:
        inst.close()


def disk_files(root: Path, tokens: list[int]) -> list[tuple[Path, str, ChunkInfo, Any]]:
    """`tokens`' chunk files under a disk tier's `path`, in order: (file, key, header, data)."""
    found = {}
    for f in rank_dir(root).glob("*" + SUFFIX):
        blob = f.read_bytes()
        key = peek_key(blob)
        info, data = unpack(blob, key)
        found[info.token_ids] = (f, key, info, data)
    return [found[tuple(tokens[i * 32 : (i + 1) * 32])] for i in range(NUM_CHUNKS)]


@pytest.mark.parametrize(
    "kind,signed", [("swapped", False), ("broadcast", False), ("values", True), ("wrong_key", True)]
)
def test_forged_chunks_on_disk_under_a_running_engine_never_change_an_output(
    tmp_path: Path, key_file: str, reference: dict[str, list[int]], kind: str, signed: bool
) -> None:
    root = tmp_path / "disk"
    tier: dict[str, Any] = {"kind": "disk", "path": str(root), "max_bytes": 1 << 28}
    if signed:
        tier["hmac_key_file"] = key_file
    inst = Instance(tmp_path, tier)
    try:
        for prompt in (P, Q):
            generate(inst, prompt)
        ours, theirs = disk_files(root, P), disk_files(root, Q)
        for (f, key, mine, data), (_, _, other_info, other) in zip(ours, theirs, strict=True):
            f.write_bytes(forge(kind, key, mine, data, other_info, other))
        removed = inst.count(BlockRemoved, TIER_STORAGE_LOCAL)
        assert generate(inst, P)[0] == reference["P"]
        assert stat(inst, "num_integrity_misses") == NUM_CHUNKS
        assert stat(inst, "num_disk_integrity_misses") == NUM_CHUNKS
        assert inst.count(BlockRemoved, TIER_STORAGE_LOCAL) == removed + NUM_CHUNKS
        assert generate(inst, P) == (reference["P"], LOADED)  # stored again, true
    finally:
        inst.close()
    assert held(inst, TIER_STORAGE_LOCAL) == disk_contents(root)


def test_chunks_planted_on_disk_for_an_unsent_prompt_are_left_alone_under_a_key(
    tmp_path: Path, key_file: str, reference: dict[str, list[int]]
) -> None:
    """Files planted before start: the scan finds them unsigned, never announces or loads
    them, and leaves them where they are."""
    root = tmp_path / "disk"
    tier = {"kind": "disk", "path": str(root), "max_bytes": 1 << 28, "hmac_key_file": key_file}
    first = instance(tmp_path, "a", tier)
    try:
        generate(first, P)
        sched = scheduler(first)
        shape = tuple(disk_files(root, P)[0][3].shape)
    finally:
        first.close()
    hashes = block_hashes(X, sched.context.block_size)
    planted = {}
    with DiskTier(str(rank_dir(root)), 1 << 28) as names:  # only for its file names
        for i in range(NUM_CHUNKS):
            info = sched.chunk_info(X, hashes, i, None)
            key = chunk_key(sched.namespace, 1, 0, info.last_block_hash)
            blob = b"".join(pack(key, info, torch.full(shape, 5.0)))
            names._path(key).write_bytes(blob)
            planted[names._path(key)] = blob
    inst = instance(tmp_path, "b", tier)
    try:
        inst.until(lambda: inst.count(BlockStored, TIER_STORAGE_LOCAL) == NUM_ENTRIES)  # P's
        assert all(p.read_bytes() == blob for p, blob in planted.items())  # left alone
        assert generate(inst, X) == (reference["X"], 0)
        assert inst.count(BlockStored, TIER_STORAGE_LOCAL) == 2 * NUM_ENTRIES  # X's, computed
    finally:
        inst.close()
    assert held(inst, TIER_STORAGE_LOCAL) == disk_contents(root)


def test_another_checkpoint_under_the_same_model_name_shares_no_entries(
    tmp_path: Path, server: LocalRedis
) -> None:
    """The tiny model's weights are seeded: seed 1 is another checkpoint called "tiny". Its
    instance must find none of seed 0's chunks in the shared Redis or under the same disk
    path, and answer as seed 1 does without tiers."""
    with LLM("tiny", seed=1) as llm:
        [alone] = llm.generate([P], GREEDY)
    tiers = (
        {"kind": "disk", "path": str(tmp_path / "disk"), "max_bytes": 1 << 28},
        {"kind": "redis", "url": server.url},
    )
    for seed in (0, 1):
        with LLM("tiny", seed=seed, kv_transfer_config=offload(*tiers)) as llm:
            [out] = llm.generate([P], GREEDY)
            assert out.num_external_tokens == 0, seed  # nothing of the other seed's
            if seed == 1:
                assert out.outputs[0].token_ids == alone.outputs[0].token_ids
            step_until(llm, lambda llm=llm: not scheduler_of(llm).has_pending_work())
            assert_no_leaks(llm)
    namespaces = {k.split(b"/")[0] for k in redis.Redis.from_url(server.url).scan_iter()}
    assert len(namespaces) == 2 and len(list((tmp_path / "disk").glob("model-*"))) == 2

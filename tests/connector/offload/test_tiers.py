import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from kvconnect.commands.redis_server import LocalRedis
from kvconnect.connector.offload.common import ChunkInfo, OffloadConfig, TierConfig
from kvconnect.connector.offload.kinds import TierKind
from kvconnect.connector.offload.lookup import PrefixLookup
from kvconnect.connector.offload.tiers import TierPlacement, create_tier
from kvconnect.connector.offload.tiers.base import TierError, pack, unpack
from kvconnect.connector.offload.tiers.cpu import CpuTier
from kvconnect.connector.offload.tiers.disk import DiskTier
from kvconnect.connector.offload.tiers.redis import RedisTier
from kvconnect.connector.offload.tiers.redis_client import redact

SHAPE = (2, 2, 8, 2, 4)


def chunk(i: int) -> tuple[str, ChunkInfo, torch.Tensor]:
    info = ChunkInfo(bytes([i]) * 32, (i * 10, i * 10 + 1), None if i == 0 else i, (i,) * 8, 4)
    return f"m/1/0/{i:02x}", info, torch.full(SHAPE, float(i))


def test_cpu_tier_slots_lru_and_demotion_data() -> None:
    tier = CpuTier(3 * 2 * 2 * 8 * 2 * 4 * 4, SHAPE, torch.float32)  # exactly 3 slots
    assert tier.num_slots == 3
    for i in range(3):
        assert tier.put(*chunk(i)) == []
    assert tier.get(chunk(0)[0]) is not None  # 0 is now the most recent
    evicted = tier.put(*chunk(3))
    assert [e.key for e in evicted] == [chunk(1)[0]]
    assert evicted[0].data is not None and torch.equal(evicted[0].data, chunk(1)[2])
    assert torch.equal(tier.get(chunk(3)[0]), chunk(3)[2])  # type: ignore[arg-type]
    assert tier.remove(chunk(3)[0]) == chunk(3)[1] and not tier.contains(chunk(3)[0])
    tier.check_integrity()
    assert {k for k, _ in tier.clear()} == {chunk(0)[0], chunk(2)[0]}
    tier.check_integrity()
    assert tier.entries() == [] and len(tier._free) == tier.num_slots  # every slot back
    with pytest.raises(ValueError, match="holds no chunk"):
        CpuTier(10, SHAPE, torch.float32)


def test_a_cpu_tier_with_nothing_below_evicts_without_copying_the_data_out() -> None:
    tier = CpuTier(2 * 2 * 2 * 8 * 2 * 4 * 4, SHAPE, torch.float32)  # exactly 2 slots
    tier.keep_evicted = False
    for i in range(2):
        tier.put(*chunk(i))
    [evicted] = tier.put(*chunk(2))
    assert (evicted.key, evicted.info, evicted.data) == (chunk(0)[0], chunk(0)[1], None)
    assert torch.equal(tier.get(chunk(2)[0]), chunk(2)[2])  # type: ignore[arg-type]
    tier.check_integrity()


def test_a_cpu_slot_reserved_for_a_pull_holds_nothing_until_committed() -> None:
    """A pull receives a whole chunk into a reserved slot: evicting as a put does, invisible
    until committed, given back when the chunk is refused; never one for a key held, and
    none when every other slot is leased."""
    tier = CpuTier(2 * 2 * 2 * 8 * 2 * 4 * 4, SHAPE, torch.float32)  # exactly 2 slots
    for i in range(2):
        tier.put(*chunk(i))
    assert tier.reserve(chunk(0)[0]) is None  # held already
    got = tier.reserve(chunk(2)[0])
    assert got is not None
    slot, view, evicted = got
    assert [e.key for e in evicted] == [chunk(0)[0]] and len(view) == tier.slot_bytes
    assert not tier.contains(chunk(2)[0])  # nothing until committed
    tier.check_integrity()
    torch.frombuffer(view, dtype=torch.float32).copy_(chunk(2)[2].flatten())
    tier.commit(slot, chunk(2)[0], chunk(2)[1])
    assert torch.equal(tier.get(chunk(2)[0]), chunk(2)[2])  # type: ignore[arg-type]
    refused = tier.reserve(chunk(3)[0])
    assert refused is not None and [e.key for e in refused[2]] == [chunk(1)[0]]
    tier.unreserve(refused[0])
    tier.check_integrity()
    assert [k for k, _ in tier.entries()] == [chunk(2)[0]] and len(tier._free) == 1
    tier.leased = lambda key: True
    tier.put(*chunk(4))  # the free slot
    assert tier.reserve(chunk(5)[0]) is None  # every slot leased
    tail = ChunkInfo(b"t" * 32, (50,), 4, (5,) * 4, 4)
    tier.leased = None
    got = tier.reserve("m/1/0/t")
    assert got is not None
    with pytest.raises(TierError, match="not a whole chunk"):
        tier.commit(got[0], "m/1/0/t", tail)
    tier.check_integrity()


def test_a_cpu_slot_holds_a_tail_in_its_first_part_and_refuses_data_its_header_denies() -> None:
    tier = CpuTier(1 << 16, SHAPE, torch.float32)
    _, info, data = chunk(5)
    tail = ChunkInfo(b"t" * 32, (50,), 4, (5,) * 4, 4)  # one block of 4 tokens
    tier.put("m/1/0/t", tail, data[:, :, :4])
    found = tier.load("m/1/0/t")
    assert found is not None and found.info == tail and torch.equal(found.data, data[:, :, :4])
    with pytest.raises(TierError, match="shape"):  # a whole chunk's data under a tail's header
        tier.put("m/1/0/u", tail, data)
    with pytest.raises(TierError, match="shape"):
        tier.put("m/1/0/v", info, data[:, :, :4])
    assert [k for k, _ in tier.entries()] == ["m/1/0/t"]
    tier.check_integrity()  # no slot taken by the refused puts


def test_pack_unpack_round_trip_and_checks() -> None:
    key, info, data = chunk(5)
    blob = b"".join(pack(key, info, data))
    got_info, got = unpack(blob, key)
    assert got_info == info and torch.equal(got, data)
    with pytest.raises(TierError, match="holds"):
        unpack(blob, "other")
    bad = bytearray(blob)
    bad[-1] ^= 0xFF
    with pytest.raises(TierError, match="checksum"):
        unpack(bytes(bad), key)
    with pytest.raises(TierError, match="magic"):
        unpack(b"\x00\x00\x00\x05junk!", key)
    bad = bytearray(blob)
    bad[12] ^= 0x01  # inside the header
    with pytest.raises(TierError, match="header checksum"):
        unpack(bytes(bad), key)


def test_disk_tier_budget_restart_and_corruption(tmp_path: Path) -> None:
    size = sum(len(p) for p in pack(*chunk(0)))
    tier = DiskTier(str(tmp_path), max_bytes=2 * size + 10)
    tier.put(*chunk(0))
    tier.put(*chunk(1))
    evicted = tier.put(*chunk(2))
    assert [e.key for e in evicted] == [chunk(0)[0]]
    assert len(list(tmp_path.glob("*.kvchunk"))) == 2 and not list(tmp_path.glob("*.tmp"))
    # A restart finds the entries again, in LRU order.
    tier.close()
    again = DiskTier(str(tmp_path), max_bytes=2 * size + 10)
    assert {k for k, _ in again.entries()} == {chunk(1)[0], chunk(2)[0]}
    assert torch.equal(again.get(chunk(2)[0]), chunk(2)[2])  # type: ignore[arg-type]
    # A corrupted file is detected, deleted and reported.
    path = again._path(chunk(1)[0])
    raw = bytearray(path.read_bytes())
    raw[-3] ^= 0x55
    path.write_bytes(bytes(raw))
    with pytest.raises(TierError, match="checksum"):
        again.get(chunk(1)[0])
    assert not again.contains(chunk(1)[0]) and not path.exists() and again.num_corrupt == 1
    again.check_integrity()
    # A chunk larger than the whole budget is refused, not half written.
    small = DiskTier(str(tmp_path / "small"), max_bytes=size - 1)
    with pytest.raises(TierError, match="exceeds max_bytes"):
        small.put(*chunk(3))
    small.check_integrity()
    assert again.clear() and again.used_bytes == 0 and not list(tmp_path.glob("*.kvchunk"))
    again.check_integrity()


def test_disk_keys_never_become_paths_outside_the_root(tmp_path: Path) -> None:
    root = tmp_path / "root"
    tier = DiskTier(str(root), max_bytes=1 << 20)
    _, info, data = chunk(1)
    for key in ("../../escape", "/etc/passwd", "a/../../b", "..\\..\\x"):
        tier.put(key, info, data)
        assert tier._path(key).parent == root.resolve()
    assert [p.name for p in tmp_path.iterdir()] == ["root"]
    assert all(p.parent == root for p in root.rglob("*"))
    tier.check_integrity()


def test_disk_tier_leaves_files_that_are_not_its_chunks_alone(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "junk.kvchunk").write_bytes(b"not a chunk")
    (tmp_path / "other.tmp").write_bytes(b"another writer's file in progress")
    with caplog.at_level("WARNING"):
        tier = DiskTier(str(tmp_path), max_bytes=1 << 20)
    assert tier.entries() == []
    assert (tmp_path / "junk.kvchunk").read_bytes() == b"not a chunk"
    assert (tmp_path / "other.tmp").exists()
    [line] = [r.getMessage() for r in caplog.records if "alone" in r.getMessage()]
    assert "2 file(s)" in line and "junk.kvchunk" in line and "other.tmp" in line
    tier.put(*chunk(1))
    tier.check_integrity()
    tier.close()


def test_redis_tier(fresh_redis: LocalRedis) -> None:
    tier = RedisTier(fresh_redis.url)
    key, info, data = chunk(7)
    assert tier.get(key) is None and not tier.contains(key)
    assert tier.put(key, info, data) == []
    assert tier.contains(key) and torch.equal(tier.get(key), data)  # type: ignore[arg-type]
    tier.check_integrity()
    tier.close()


def test_factory_builds_each_kind_with_its_own_medium(
    tmp_path: Path, fresh_redis: LocalRedis
) -> None:
    placement = TierPlacement(2, 1, SHAPE, torch.float32)
    configs = [
        TierConfig(TierKind.CPU, max_bytes=1 << 20),
        TierConfig(TierKind.DISK, path=str(tmp_path)),
        TierConfig(TierKind.REDIS, url=fresh_redis.url),
    ]
    tiers = [create_tier(c, placement) for c in configs]
    assert [(type(t).__name__, t.medium, t.kind.locality, t.shared) for t in tiers] == [
        ("CpuTier", "CPU", None, False),
        ("DiskTier", "STORAGE", "LOCAL", False),
        ("RedisTier", "STORAGE", "REMOTE", True),
    ]
    root = tiers[1].root if isinstance(tiers[1], DiskTier) else None
    assert root is not None and root.name == "tp2-rank1" and root.parent.name.startswith("model-")
    assert root.parent.parent == tmp_path.resolve()
    for t in tiers:
        t.check_integrity()
        t.close()


def test_num_held_prefix_counts_chunks_every_rank_holds(fresh_redis: LocalRedis) -> None:
    tier = RedisTier(fresh_redis.url)
    keys = [[f"m/2/{r}/{i:02x}" for r in range(2)] for i in range(4)]
    for i, per_rank in enumerate(keys):
        for r, key in enumerate(per_rank):
            if (i, r) != (2, 1):  # chunk 2 is missing on rank 1
                tier.put(key, chunk(i)[1], chunk(i)[2])
    assert tier.num_held_prefix(keys) == 2
    assert tier.num_held_prefix(keys[3:]) == 1 and tier.num_held_prefix([]) == 0
    cpu = CpuTier(1 << 20, SHAPE, torch.float32)
    cpu.put(keys[0][0], chunk(0)[1], chunk(0)[2])
    assert cpu.num_held_prefix([keys[0][:1], keys[1][:1]]) == 1  # the default, by contains
    tier.close()


class _GatedTier(RedisTier):
    """A redis tier whose lookups wait for the test to open a gate."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.gate = threading.Event()

    def num_held_prefix(self, chunks: object) -> int:  # type: ignore[override]
        assert self.gate.wait(10)
        return super().num_held_prefix(chunks)  # type: ignore[arg-type]


def test_prefix_lookup_answers_later_and_never_blocks_the_caller(
    fresh_redis: LocalRedis,
) -> None:
    tier = _GatedTier(fresh_redis.url)
    tier.put("m/1/0/00", chunk(0)[1], chunk(0)[2])
    lookup = PrefixLookup(tier)
    try:
        assert lookup.ask("r", 0, [["m/1/0/00"], ["m/1/0/01"]]) is None  # queued, not waited
        assert lookup.ask("r", 0, [["m/1/0/00"], ["m/1/0/01"]]) is None  # still in flight
        tier.gate.set()
        assert lookup.drain()
        assert lookup.ask("r", 0, [["m/1/0/00"], ["m/1/0/01"]]) == 1 and lookup.num_errors == 0
        assert lookup.ask("r", 1, [["m/1/0/01"]]) is None  # another question: asked anew
        lookup.forget("r")
        assert lookup.num_questions == 0
    finally:
        lookup.shutdown()
        tier.close()


def test_prefix_lookup_on_a_dead_tier_answers_zero_and_counts() -> None:
    tier = RedisTier("redis://127.0.0.1:1/0")
    lookup = PrefixLookup(tier)
    try:
        assert lookup.ask("r", 0, [["k"]]) is None
        assert lookup.drain()
        assert lookup.ask("r", 0, [["k"]]) == 0 and lookup.num_errors == 1
    finally:
        lookup.shutdown()
        tier.close()


def test_redis_tier_down_is_an_error_not_a_hang() -> None:
    tier = RedisTier("redis://:secret@127.0.0.1:1/0")
    with pytest.raises(TierError, match="failed"):
        tier.get("k")
    assert tier.contains("k") is False and tier.num_errors == 2
    assert "secret" not in tier.url and redact("redis://u:p@h:1/0") == "redis://h:1/0"


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({"tiers": []}, "empty"),
        ({"chunk_size": 24, "tiers": [{"kind": "cpu"}]}, "multiple of the block size 16"),
        ({"tiers": [{"kind": "tape"}]}, "kind in cpu, disk, redis"),
        ({"tiers": [{"kind": "disk"}]}, "needs a path"),
        ({"tiers": [{"kind": "redis"}]}, "needs a url"),
        ({"tiers": [{"kind": "cpu", "size": 1}]}, "unknown"),
        ({"tiers": [{"kind": "cpu"}], "chunks": 1}, "unknown kv_connector_extra_config"),
        ({"tiers": [{"kind": "cpu", "max_bytes": 0}]}, r">= 1 - at `tiers\[0\]\.max_bytes`"),
        ({"tiers": [{"kind": "cpu", "max_bytes": True}]}, r"got `bool` - at `tiers\[0\]\."),
        (
            {"tiers": [{"kind": "redis", "url": "u", "ttl_s": 0}]},
            r"> 0\.0 - at `tiers\[0\]\.ttl_s`",
        ),
        ({"tiers": [{"kind": "disk", "ttl_s": 1}]}, "redis options"),
        ({"chunk_size": "256", "tiers": [{"kind": "cpu"}]}, "got `str` - at `chunk_size`"),
        ({"max_pending_stores": 0, "tiers": [{"kind": "cpu"}]}, "at `max_pending_stores`"),
    ],
)
def test_config_errors_name_the_problem(extra: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        OffloadConfig.from_extra_config(extra, block_size=16)


def test_config_reads_each_tier_as_its_kind_with_its_defaults() -> None:
    extra = {
        "chunk_size": 32,
        "tiers": [{"kind": "cpu", "max_bytes": 4096}, {"kind": "redis", "url": "u", "ttl_s": 2}],
    }
    cfg = OffloadConfig.from_extra_config(extra, block_size=16)
    assert cfg.blocks_per_chunk == 2 and cfg.max_pending_stores == cfg.max_pending_steps == 64
    assert cfg.tiers == (
        TierConfig(TierKind.CPU, max_bytes=4096),
        TierConfig(TierKind.REDIS, url="u", ttl_s=2.0),
    )
    assert [(t.kind.medium, t.kind.locality) for t in cfg.tiers] == [
        ("CPU", None),
        ("STORAGE", "REMOTE"),
    ]


def test_each_kind_knows_its_medium_locality_and_sharing() -> None:
    table = [(k.value, k.medium, k.locality, k.tier, k.shared) for k in TierKind]
    assert table == [
        ("cpu", "CPU", None, "CPU", False),
        ("disk", "STORAGE", "LOCAL", "STORAGE/LOCAL", False),
        ("redis", "STORAGE", "REMOTE", "STORAGE/REMOTE", True),
    ]
    events = [
        ("CPU", None),
        ("STORAGE", "LOCAL"),
        ("STORAGE", "REMOTE"),
        ("DISK", None),  # the older names, still read
        ("EXTERNAL", None),
        ("STORAGE", None),  # either of two kinds: none
        ("CPU", "REMOTE"),
        ("GPU", None),
        (None, None),
    ]
    assert [TierKind.of_event(m, loc) for m, loc in events] == [
        TierKind.CPU,
        TierKind.DISK,
        TierKind.REDIS,
        TierKind.DISK,
        TierKind.REDIS,
        None,
        None,
        None,
        None,
    ]
    # The router reads this vocabulary in a process that never imports torch.
    code = "import sys, kvconnect.connector.offload.kinds; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)

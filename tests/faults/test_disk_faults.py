"""The disk tier against what can happen to its directory: flipped bits anywhere in a chunk,
truncation, planted symlinks, an unsafe root, another engine's shapes, a full filesystem,
another instance on the same root. What the start-up scan cannot use it leaves in place."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvconnect import LLM, SamplingParams
from kvconnect.connector.offload.common import ChunkInfo, TierConfig
from kvconnect.connector.offload.kinds import TierKind
from kvconnect.connector.offload.tiers.base import TierError, TierPlacement
from kvconnect.connector.offload.tiers.disk import SUFFIX, DiskTier
from tests.connector.offload.test_offload_engine import offload

SHAPE = (2, 2, 8, 2, 4)
BUDGET = 1 << 24


def chunk(i: int) -> tuple[str, ChunkInfo, torch.Tensor]:
    info = ChunkInfo(bytes([i]) * 32, (i * 10, i * 10 + 1), None if i == 0 else i, (i,) * 8, 4)
    return f"m/1/0/{i:02x}", info, torch.full(SHAPE, float(i))


def one_chunk_dir(root: Path) -> tuple[Path, bytes]:
    with DiskTier(str(root), BUDGET) as tier:
        tier.put(*chunk(3))
        path = tier._path(chunk(3)[0])
    return path, path.read_bytes()


def entries(root: Path, **kwargs: object) -> list[str]:
    """The keys a tier started on `root` finds (then closed, the scan's leftovers checked)."""
    with DiskTier(str(root), BUDGET, **kwargs) as tier:  # type: ignore[arg-type]
        tier.check_integrity()
        return [k for k, _ in tier.entries()]


def header_length(blob: bytes) -> int:
    """Bytes before the payload: magic, length, header, header checksum."""
    return 8 + int.from_bytes(blob[4:8], "big") + 8


def test_every_bit_flip_in_the_header_and_sampled_payload_flips_is_skipped_at_start(
    tmp_path: Path,
) -> None:
    path, blob = one_chunk_dir(tmp_path)
    end = header_length(blob)
    payload_bytes = range(end, len(blob), 37)
    starts = 0
    for pos in [*range(end), *payload_bytes]:
        for bit in range(8) if pos < end else (pos % 8,):
            bad = bytearray(blob)
            bad[pos] ^= 1 << bit
            path.write_bytes(bad)
            with DiskTier(str(tmp_path), BUDGET) as tier:  # always starts
                starts += 1
                assert tier.entries() == [] and tier.num_corrupt == 1, (pos, bit)
                assert path.read_bytes() == bad, (pos, bit)  # left alone, not loaded
                tier.check_integrity()
    assert starts == end * 8 + len(payload_bytes)
    path.write_bytes(blob)  # the intact file is still accepted
    assert entries(tmp_path) == [chunk(3)[0]]


def test_every_truncation_and_an_old_format_file_are_skipped_at_start(tmp_path: Path) -> None:
    path, blob = one_chunk_dir(tmp_path)
    for n in [*range(0, header_length(blob) + 1), len(blob) // 2, len(blob) - 1]:
        path.write_bytes(blob[:n])
        assert entries(tmp_path) == [] and path.read_bytes() == blob[:n], n
    path.write_bytes(b"KVC2" + blob[4:])  # the format before KVC3
    assert entries(tmp_path) == [] and path.exists()


def test_a_chunk_of_another_shape_or_dtype_is_left_alone_at_start(tmp_path: Path) -> None:
    path, blob = one_chunk_dir(tmp_path)
    # other heads; more tokens than a chunk (fewer, agreeing with its header, is a tail)
    for shape in ((2, 2, 8, 4, 4), (2, 2, 4, 2, 4)):
        with DiskTier(str(tmp_path), BUDGET, chunk_shape=shape, dtype=torch.float32) as t:
            assert t.entries() == [] and t.num_corrupt == 1 and path.read_bytes() == blob
            t.check_integrity()
    assert entries(tmp_path, chunk_shape=SHAPE, dtype=torch.float16) == []
    assert path.read_bytes() == blob
    assert entries(tmp_path, chunk_shape=SHAPE, dtype=torch.float32) == [chunk(3)[0]]


def test_a_second_instance_on_the_same_root_is_refused_until_the_first_closes(
    tmp_path: Path,
) -> None:
    placement = TierPlacement(1, 0, SHAPE, torch.float32, namespace="m@0123")
    config = TierConfig(TierKind.DISK, path=str(tmp_path), max_bytes=BUDGET)
    first = DiskTier.from_config(config, placement)
    first.put(*chunk(1))
    with pytest.raises(ValueError, match=f"in use by another instance \\(pid {os.getpid()}"):
        DiskTier.from_config(config, placement)
    # Another process too (flock is per open file: the lock holds across processes).
    code = (
        "import sys, torch\n"
        "from kvconnect.connector.offload.common import TierConfig\n"
        "from kvconnect.connector.offload.tiers.base import TierPlacement\n"
        "from kvconnect.connector.offload.tiers.disk import DiskTier\n"
        "try:\n"
        f"    DiskTier.from_config(TierConfig('disk', path={str(tmp_path)!r}), "
        f"TierPlacement(1, 0, {SHAPE}, torch.float32, namespace='m@0123'))\n"
        "except ValueError as e:\n"
        "    sys.exit(str(e))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 1 and "in use by another instance" in proc.stderr, proc.stderr
    # Another model (namespace) or rank under the same path has its own root.
    with DiskTier.from_config(config, TierPlacement(1, 0, SHAPE, namespace="m@4567")) as other:
        assert other.entries() == [] and other.root != first.root
    first.check_integrity()
    first.close()
    with DiskTier.from_config(config, placement) as again:  # released: the next one starts
        assert [k for k, _ in again.entries()] == [chunk(1)[0]]
        again.check_integrity()


def test_a_symlink_at_the_temporary_name_is_not_written_through(tmp_path: Path) -> None:
    root, outside = tmp_path / "root", tmp_path / "outside"
    outside.write_bytes(b"precious")
    tier = DiskTier(str(root), BUDGET)
    key, info, data = chunk(4)
    tmp = tier._path(key).with_suffix(".tmp")
    tmp.symlink_to(outside)
    assert tier.put(key, info, data) == []
    assert outside.read_bytes() == b"precious"
    assert not tmp.exists() and not tmp.is_symlink()
    assert torch.equal(tier.get(key), data)  # type: ignore[arg-type]
    tier.check_integrity()


def test_a_symlink_at_a_chunk_name_is_never_read_or_followed(tmp_path: Path) -> None:
    root, outside = tmp_path / "root", tmp_path / "outside.kvchunk"
    path, blob = one_chunk_dir(root)
    outside.write_bytes(blob)  # a valid chunk, but outside the root
    path.unlink()
    path.symlink_to(outside)
    (root / ("x" * 64 + SUFFIX)).symlink_to("/etc/passwd")
    tier = DiskTier(str(root), BUDGET)
    assert tier.entries() == [] and {p.name for p in root.iterdir()} == {
        path.name,
        "x" * 64 + SUFFIX,
        ".lock",
    }  # left alone: never read, followed or deleted
    assert outside.read_bytes() == blob
    # Planted after start, under a chunk the tier holds: a load error, not a read outside.
    key, info, data = chunk(5)
    tier.put(key, info, data)
    tier._path(key).unlink()
    tier._path(key).symlink_to(outside)
    with pytest.raises(TierError):
        tier.get(key)
    assert not tier.contains(key) and outside.read_bytes() == blob
    tier.check_integrity()


def test_an_unsafe_root_is_refused_with_a_clear_error(tmp_path: Path) -> None:
    open_root = tmp_path / "open"
    open_root.mkdir()
    open_root.chmod(0o777)
    with pytest.raises(ValueError, match="writable by every user"):
        DiskTier(str(open_root), BUDGET)
    placement = TierPlacement(1, 0)
    with pytest.raises(ValueError, match="writable by every user and not sticky"):
        DiskTier.from_config(TierConfig(TierKind.DISK, path=str(open_root)), placement)
    open_root.chmod(0o1777)  # sticky, like /tmp: the rank's own directory is safe in it
    with DiskTier.from_config(TierConfig(TierKind.DISK, path=str(open_root)), placement) as t:
        t.check_integrity()
    shared = TierPlacement(1, 0, namespace="m@0")
    with DiskTier.from_config(TierConfig(TierKind.DISK, path=str(open_root)), shared) as t:
        model_dir = t.root.parent
    model_dir.chmod(0o777)  # another user could swap the rank's directory out of it
    with pytest.raises(ValueError, match="writable by every user"):
        DiskTier.from_config(TierConfig(TierKind.DISK, path=str(open_root)), shared)
    mine = tmp_path / "mine"
    DiskTier(str(mine), BUDGET).close()
    assert (mine.stat().st_mode & 0o777) == 0o700  # created owner-only
    if os.geteuid() != 0:
        return  # only root can give a directory away
    foreign = tmp_path / "foreign"
    foreign.mkdir(mode=0o700)
    os.chown(foreign, 65534, 65534)
    with pytest.raises(ValueError, match="owned by uid 65534"):
        DiskTier(str(foreign), BUDGET)


def test_a_full_filesystem_fails_writes_cleanly_and_keeps_what_was_written(small_fs: Path) -> None:
    tier = DiskTier(str(small_fs / "tier"), max_bytes=1 << 30)  # the budget is not the limit
    big = (4, 2, 64, 4, 32)  # 256 KiB chunks: about 4 fit
    stored, failed = [], 0
    for i in range(8):
        key, info = f"m/1/0/{i:02x}", chunk(i)[1]
        try:
            tier.put(key, info, torch.full(big, float(i)))
            stored.append(key)
        except TierError as e:
            assert "No space left" in str(e)
            failed += 1
        tier.check_integrity()
    assert stored and failed and len(stored) + failed == 8
    assert not list((small_fs / "tier").glob("*.tmp"))  # no half-written leftovers
    for key in stored:
        assert tier.get(key) is not None
    tier.clear()
    tier.check_integrity()


def test_a_second_engine_on_the_same_disk_path_fails_at_start_naming_why(tmp_path: Path) -> None:
    config = offload({"kind": "disk", "path": str(tmp_path), "max_bytes": 1 << 26})
    with LLM("tiny", kv_transfer_config=config) as first:
        with pytest.raises(Exception, match="in use by another instance") as e:
            LLM("tiny", kv_transfer_config=config)
        assert str(tmp_path) in str(e.value)
        assert first.generate([[1, 2, 3]], SamplingParams(max_tokens=2))  # the first runs on
    with LLM("tiny", kv_transfer_config=config):  # its lock went with it
        pass

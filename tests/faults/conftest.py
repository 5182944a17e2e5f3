"""The fault-and-load suite: every test injects a real fault (a killed or stopped process, a
corrupted file, a full filesystem, a flood of clients) and asserts exact outcomes."""

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/faults/" in str(item.path):
            item.add_marker(pytest.mark.faults)


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs: writes beyond it fail with ENOSPC, as on a full disk."""
    if os.geteuid() != 0:
        pytest.fail("a full-filesystem test mounts a tmpfs, which needs root (CI runs as root)")
    mount = tmp_path / "fs"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], check=True)
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=True)

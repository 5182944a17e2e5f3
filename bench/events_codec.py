"""Event codec rates beside a bare msgspec struct of the same data (the limit).

Prints one line: encode and decode events/s for batches of 1, 10 and 100 BlockStored events
with 16 tokens each, for kvconnect's `encode_batch`/`decode_batch` and for a bare msgspec
Struct with the same fields encoded/decoded directly, and the ratio of the two.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import msgspec

from kvconnect.events import BlockStored, KVEventBatch, decode_batch, encode_batch


class BareStored(msgspec.Struct, tag="BlockStored", tag_field="type", omit_defaults=True, gc=False):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None


class BareBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[BareStored]
    data_parallel_rank: int | None = None


def rate(fn: Callable[[], object], events_per_call: int, min_time: float = 0.3) -> float:
    """Events per second of `fn`, best of 3 runs of at least `min_time` seconds."""
    best = 0.0
    for _ in range(3):
        n, start = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - start) < min_time:
            for _ in range(50):
                fn()
            n += 50
        best = max(best, n * events_per_call / elapsed)
    return best


def main() -> None:
    rng = random.Random(0)
    enc, dec = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(BareBatch)
    parts = {"enc": [], "dec": [], "bare_enc": [], "bare_dec": []}  # type: dict[str, list[str]]
    ratios_enc, ratios_dec = [], []
    for size in (1, 10, 100):
        fields = [
            ([rng.getrandbits(64)], rng.getrandbits(64), [rng.randrange(32000) for _ in range(16)])
            for _ in range(size)
        ]
        ours = KVEventBatch(
            time.time(), [BlockStored(h, p, t, 16, None, "GPU", None) for h, p, t in fields], 0
        )
        bare = BareBatch(
            ours.ts, [BareStored(h, p, t, 16, None, "GPU", None) for h, p, t in fields], 0
        )
        payload, bare_payload = encode_batch(ours), enc.encode(bare)
        # The same data (msgspec may size a map header differently for a struct with more
        # optional fields: map16 against fixmap, both valid msgpack).
        same = msgspec.msgpack.decode(payload) == msgspec.msgpack.decode(bare_payload)
        assert same, "the bare struct must encode the same data"
        r = {
            "enc": rate(partial(encode_batch, ours), size),
            "dec": rate(partial(decode_batch, payload), size),
            "bare_enc": rate(partial(enc.encode, bare), size),
            "bare_dec": rate(partial(dec.decode, bare_payload), size),
        }
        for k, v in r.items():
            parts[k].append(f"{v / 1e6:.2f}M")
        ratios_enc.append(r["enc"] / r["bare_enc"])
        ratios_dec.append(r["dec"] / r["bare_dec"])
    print(
        "events_codec (ev/s, batches of 1/10/100 BlockStored x16 tokens): "
        f"encode {'/'.join(parts['enc'])} vs bare {'/'.join(parts['bare_enc'])} "
        f"({min(ratios_enc):.2f}-{max(ratios_enc):.2f}x); "
        f"decode {'/'.join(parts['dec'])} vs bare {'/'.join(parts['bare_dec'])} "
        f"({min(ratios_dec):.2f}-{max(ratios_dec):.2f}x)"
    )


if __name__ == "__main__":
    main()

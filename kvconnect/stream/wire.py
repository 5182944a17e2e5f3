"""What the publisher and the subscriber of a KV event stream both know: frames and constants.

    live:    [topic, seq (8 bytes big-endian unsigned), payload]
    replay:  request  [b"", start_seq (8 bytes)]           from a DEALER (a REQ adds the b"")
             answer   [b"", topic, seq, payload] ...       every buffered batch >= start_seq
                      [b"", STATUS, END_SEQ, b""]          END_SEQ = -1 as 8 signed bytes
             snapshot [b"", SNAPSHOT_REQUEST]              (kvconnect's)
             answer   [b"", topic, seq, payload] ...       BlockStored batches, seq = the fence
                      [b"", STATUS, END_SEQ, b""]

    vLLM PR #57789 (open), with a snapshot endpoint only:
    live:    [topic, seq (8 bytes) + PUBLISHER_ID (16 bytes), payload]; idle: an empty batch
             every HEARTBEAT_INTERVAL_S (a heartbeat, with its own seq)
    snapshot request  any one frame (REQ), or [b"", frame] (DEALER)
             answer   [SNAPSHOT_SEQ (8 bytes, signed), PUBLISHER_ID, batch payload, ...]
                      the state as of seq SNAPSHOT_SEQ (-1: nothing yet, -2: unavailable)

    discovery GET /kv_event_sources (HTTP, of the instance's API): a JSON list, one
             `KVEventSource` per DP rank, by rank (vLLM's since PR #55844)

Everything but STATUS and SNAPSHOT_REQUEST is vLLM's. STATUS is the terminator's first frame,
where vLLM sends an empty topic and vLLM readers look only at the last two frames, so
kvconnect's publisher can name itself there (`PublisherStatus`) without breaking them.
The subscriber imports this module, never the publisher.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

END_SEQ = (-1).to_bytes(8, "big", signed=True)
"""The seq frame of a replay answer's terminator."""
SNAPSHOT_REQUEST = b"kvconnect snapshot"
"""A replay request's last frame asking for the stream's full state instead of a replay."""
_STATUS_PREFIX = b"kvconnect "

MAX_REQUEST_BYTES = 4096
"""MAXMSGSIZE of the sockets that only receive requests (the replay ROUTER, the live XPUB's
subscriptions): a request is 8 bytes, a snapshot request 18, a subscription the topic + 1.
A larger frame drops the sender's connection before anything is allocated for it."""
MAX_BATCH_BYTES = 64 << 20
"""Default MAXMSGSIZE of the subscriber's sockets (live SUB, replay DEALER), per frame. A
batch is one engine step's events; its bulk is BlockStored token ids (at most 5 bytes each in
msgpack) and block hashes (9 bytes). A step that stores 1M tokens (beyond any
max_num_batched_tokens in use) on three media (GPU, CPU, STORAGE) is about 15 MiB, and the
publisher cuts snapshot batches at `SNAPSHOT_TOKENS_PER_BATCH` tokens (about 5 MiB): 64 MiB
leaves a 4x margin over the largest legitimate batch and refuses what the issue sent
(512 MiB frames). A batch over it cuts the connection: the subscriber reconnects, and the batch
is reported lost (replay refuses it too), never silently absorbed."""


WILDCARD_HOSTS = frozenset({"*", "0.0.0.0", "::", "[::]", ""})
"""Hosts a bound address may name that nobody can connect to."""


class KVEventSource(msgspec.Struct, frozen=True):
    """Where one DP rank's stream is, as `GET /kv_event_sources` names it (vLLM's fields,
    in vLLM's order). Unknown keys are ignored when read, so a newer server still parses."""

    data_parallel_rank: int
    endpoint: str
    """The live stream's address as bound (a port 0 resolved), a wildcard host replaced by
    one the asker can reach."""
    replay_endpoint: str | None
    """The replay server's address; None: the stream has no replay."""
    topic: str
    """The first frame of its messages (subscribe by prefix)."""


def with_host(endpoint: str, host: str) -> str:
    """`endpoint` with a wildcard host (`*`, `0.0.0.0`, `::`) replaced by `host`, so that it
    names an address one can connect to; any other endpoint (ipc, a real host) unchanged."""
    if not endpoint.startswith("tcp://"):
        return endpoint
    bound_host, sep, port = endpoint.removeprefix("tcp://").rpartition(":")
    if not sep or bound_host not in WILDCARD_HOSTS:
        return endpoint
    host = f"[{host}]" if ":" in host and not host.startswith("[") else host
    return f"tcp://{host}:{port}"


HEARTBEAT_INTERVAL_S = 1.0
"""PR #57789: a publisher with a snapshot endpoint that has sent nothing for this long sends
an empty batch (its own seq), so a consumer sees the stream alive, learns the publisher's id
and notices a dropped last batch."""
PUBLISHER_ID_BYTES = 16
"""PR #57789: the publisher's lifetime UUID, after the 8 seq bytes of every live message."""
SNAPSHOT_NONE = -1
"""A #57789 snapshot's seq when nothing was published yet."""
SNAPSHOT_UNAVAILABLE = -2
"""A #57789 snapshot's seq when the publisher cannot give its state (its reply bound)."""


def split_seq_frame(frame: bytes) -> tuple[int, bytes | None] | None:
    """(seq, publisher id) of a live seq frame: 8 bytes (vLLM's, no id) or 8 + 16 (PR
    #57789); None for any other length."""
    if len(frame) == 8:
        return int.from_bytes(frame, "big"), None
    if len(frame) == 8 + PUBLISHER_ID_BYTES:
        return int.from_bytes(frame[:8], "big"), frame[8:]
    return None


def seq_frame(seq: int) -> bytes:
    return seq.to_bytes(8, "big")


@dataclass(frozen=True)
class PublisherStatus:
    """What a kvconnect publisher says about itself in a replay terminator."""

    epoch: str
    """Random per publisher: a different epoch on the same address is a restart."""
    next_seq: int
    """The seq its next batch will get."""

    def encode(self) -> bytes:
        return _STATUS_PREFIX + f"epoch={self.epoch} next_seq={self.next_seq}".encode()

    @classmethod
    def decode(cls, frame: bytes) -> PublisherStatus | None:
        """The status in a terminator's first frame; None for any other frame (vLLM's b"")."""
        if not frame.startswith(_STATUS_PREFIX):
            return None
        try:
            fields_ = dict(p.split("=", 1) for p in frame[len(_STATUS_PREFIX) :].decode().split())
            return cls(fields_["epoch"], int(fields_["next_seq"]))
        except (ValueError, KeyError, UnicodeDecodeError):
            return None


def offset_endpoint(endpoint: str | None, data_parallel_rank: int) -> str | None:
    """The endpoint of DP rank `data_parallel_rank`: tcp ports move up by the rank (port 0,
    the OS's choice, stays), ipc and inproc names get `_dp<rank>` appended (vLLM rejects ipc
    here; kvconnect does not)."""
    if not endpoint or data_parallel_rank == 0:
        return endpoint
    if endpoint.startswith(("inproc://", "ipc://")):
        return f"{endpoint}_dp{data_parallel_rank}"
    if endpoint.startswith("tcp://"):
        head, _, port = endpoint.rpartition(":")
        return endpoint if int(port) == 0 else f"{head}:{int(port) + data_parallel_rank}"
    raise ValueError(f"invalid endpoint {endpoint!r}: must be tcp://, ipc:// or inproc://")

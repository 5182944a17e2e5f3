"""Frozen configuration objects, compatible with the JSON that vLLM users already pass.

`KVEventsConfig` mirrors `--kv-events-config` and `KVTransferConfig` mirrors
`--kv-transfer-config`: same field names, same defaults, with two deliberate differences: with
no endpoint given, events bind loopback (vLLM binds every interface), and kvconnect-only fields
follow vLLM's (`bind` may force binding or connecting; `curve_secret_key_file`), so vLLM's JSON
reads the same here. Both are built with `from_json` / `from_dict` (both from `JsonConfig`); an
unknown key is a `ValueError` that lists the valid ones, and every invalid value is a
`ValueError` naming the field and the value.

This module imports nothing from the rest of the package.
"""

from __future__ import annotations

import dataclasses
import json
import stat
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Self

ENDPOINT_SCHEMES = ("tcp://", "ipc://", "inproc://")
DEFAULT_EVENTS_ENDPOINT = "tcp://127.0.0.1:5557"


def vllm_binds(endpoint: str) -> bool:
    """vLLM's rule: a publisher binds wildcard (`*`, `::`), ipc and inproc addresses and
    connects to any other (a collector's)."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


SECRET_FILE_OPEN_BITS = 0o077
"""Any permission for group or others: a secret file with one of them is refused."""


def check_secret_mode(path: str, st_mode: int) -> None:
    """`ValueError` naming `path` and its mode when group or others may read or write it (as
    ssh refuses such a key): a CURVE secret key, a tier's `hmac_key_file` or `password_file`
    that another user can read gives away the stream, the signatures or the store, and one
    that they can write lets them swap it. Every reader of a secret file calls this."""
    if st_mode & SECRET_FILE_OPEN_BITS:
        raise ValueError(
            f"{path} is mode {stat.S_IMODE(st_mode):04o}: a secret file must not be readable or "
            f"writable by group or others (chmod 600 {path})"
        )


def _fail(cls_name: str, field_name: str, value: object, why: str) -> ValueError:
    return ValueError(f"{cls_name}.{field_name}={value!r}: {why}")


class JsonConfig:
    """What every config dataclass here has: built from the JSON object (or a mapping) vLLM
    takes for it, with an unknown key a `ValueError` that lists the valid ones, and back."""

    __dataclass_fields__: ClassVar[dict[str, dataclasses.Field[Any]]]
    """Set by @dataclass on the config class (declared so the type checker knows it is one)."""

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Self:
        """Build from a mapping with vLLM's keys; unknown keys are an error."""
        if not isinstance(data, Mapping):
            raise ValueError(f"{cls.__name__} expects a JSON object, got {type(data).__name__}")
        valid = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(data) - set(valid))
        if unknown:
            raise ValueError(
                f"{cls.__name__}: unknown key(s) {', '.join(map(repr, unknown))}; "
                f"valid keys are: {', '.join(valid)}"
            )
        return cls(**data)

    @classmethod
    def from_json(cls, text: str) -> Self:
        """Build from the JSON string given to vLLM's flag for this config."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{cls.__name__}: not valid JSON ({e}): {text!r}") from e
        return cls.from_dict(data)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _check_int(cls_name: str, name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _fail(cls_name, name, value, "must be an integer")
    if value < minimum:
        raise _fail(cls_name, name, value, f"must be >= {minimum}")


def check_endpoint(cls_name: str, name: str, value: object) -> None:
    """Raise `ValueError` unless `value` is a ZMQ endpoint kvconnect can use."""
    if not isinstance(value, str) or not value.startswith(ENDPOINT_SCHEMES):
        raise _fail(cls_name, name, value, f"must start with one of {', '.join(ENDPOINT_SCHEMES)}")
    rest = value.split("://", 1)[1]
    if not rest:
        raise _fail(cls_name, name, value, "has no address after the scheme")
    if value.startswith("tcp://"):
        host, sep, port = rest.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
            raise _fail(cls_name, name, value, "a tcp endpoint needs host:port with port 0-65535")


@dataclass(frozen=True)
class KVEventsConfig(JsonConfig):
    """KV cache event publishing, with vLLM's `KVEventsConfig` fields and defaults."""

    enable_kv_cache_events: bool = False
    """Master switch. When False the engine publishes nothing (a null publisher)."""

    publisher: str | None = None
    """Publisher name: "null", "zmq", or one registered with `EventPublisherFactory`.
    Unset resolves to "zmq" when events are enabled and "null" otherwise."""

    endpoint: str = None  # type: ignore[assignment]
    """ZMQ address of the live PUB stream. As in vLLM, an address with `*` or `::`, ipc and
    inproc are bound and any other is connected to (a collector that binds it); DP rank r
    adds r to the port (port 0 stays 0: each rank's port is the OS's choice, and a tcp port 0
    is always bound). Unset: `tcp://127.0.0.1:5557`, bound (vLLM binds `tcp://*:5557`)."""

    replay_endpoint: str | None = None
    """ZMQ address of the ROUTER that serves replays; None disables replay."""

    buffer_steps: int = 10_000
    """Replay ring size, in batches (one batch per engine step)."""

    hwm: int = 100_000
    """ZMQ high-water mark of the PUB socket, in messages (0 means unlimited)."""

    max_queue_size: int = 100_000
    """Capacity of the in-process queue between `publish()` and the sending thread, in
    batches. A batch that does not fit is not sent live but stays replayable."""

    topic: str = ""
    """First frame of every live message; subscribers filter on it by prefix."""

    bind: bool | None = None
    """kvconnect only: True binds `endpoint`, False connects to it, None follows vLLM's rule
    above (set to True when `endpoint` is unset)."""

    curve_secret_key_file: str | None = None
    """kvconnect only: a ZMQ certificate file with the publisher's CURVE secret key (as
    `zmq.auth.create_certificates` writes `<name>.key_secret`). Set, the live and replay
    sockets are CURVE servers: encrypted, and only subscribers holding its public key
    (`<name>.key`) hear anything (stream/curve.py). None: plain, vLLM's wire."""

    snapshot_endpoint: str | None = None
    """vLLM PR #57789 (open): ZMQ address of a ROUTER that answers any request with the
    stream's compacted state and the exact seq it covers (`stream/snapshots.py`). Set, the
    publisher also has a 16-byte id appended to every live seq frame (24 bytes: readers that
    want exactly 8 need the update the PR names) and sends an empty batch after each idle
    second (a heartbeat, with its own seq). None: today's wire, unchanged; kvconnect's own
    snapshots on the replay socket are there either way."""

    def __post_init__(self) -> None:
        name = type(self).__name__
        if not isinstance(self.enable_kv_cache_events, bool):
            raise _fail(
                name, "enable_kv_cache_events", self.enable_kv_cache_events, "must be a bool"
            )
        if self.publisher is None:
            resolved = "zmq" if self.enable_kv_cache_events else "null"
            object.__setattr__(self, "publisher", resolved)
        elif not isinstance(self.publisher, str) or not self.publisher:
            raise _fail(name, "publisher", self.publisher, "must be a non-empty publisher name")
        given: object = self.endpoint  # None until resolved here
        if given is None:
            object.__setattr__(self, "endpoint", DEFAULT_EVENTS_ENDPOINT)
            if self.bind is None:
                object.__setattr__(self, "bind", True)
        check_endpoint(name, "endpoint", self.endpoint)
        if self.replay_endpoint is not None:
            check_endpoint(name, "replay_endpoint", self.replay_endpoint)
            if self.replay_endpoint == self.endpoint and not self.endpoint.endswith(":0"):
                raise _fail(
                    name, "replay_endpoint", self.replay_endpoint, "must differ from endpoint"
                )
        if self.snapshot_endpoint is not None:
            check_endpoint(name, "snapshot_endpoint", self.snapshot_endpoint)
            taken = {self.endpoint, self.replay_endpoint}
            if self.snapshot_endpoint in taken and not self.snapshot_endpoint.endswith(":0"):
                raise _fail(
                    name,
                    "snapshot_endpoint",
                    self.snapshot_endpoint,
                    "must differ from endpoint and replay_endpoint",
                )
        _check_int(name, "buffer_steps", self.buffer_steps, 1)
        _check_int(name, "hwm", self.hwm, 0)
        _check_int(name, "max_queue_size", self.max_queue_size, 1)
        if not isinstance(self.topic, str):
            raise _fail(name, "topic", self.topic, "must be a string")
        if self.bind is not None and not isinstance(self.bind, bool):
            raise _fail(name, "bind", self.bind, "must be a bool or null")
        key_file = self.curve_secret_key_file
        if key_file is not None and (not isinstance(key_file, str) or not key_file):
            raise _fail(name, "curve_secret_key_file", key_file, "must be a file path or null")

    @property
    def binds_endpoint(self) -> bool:
        """Whether the publisher binds `endpoint` (else it connects to it). A tcp port 0 is
        bound whatever its host (nothing can be connected to on port 0)."""
        if self.bind is not None:
            return self.bind
        return vllm_binds(self.endpoint) or (
            self.endpoint.startswith("tcp://") and (self.endpoint.endswith(":0"))
        )


KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")


@dataclass(frozen=True)
class KVTransferConfig(JsonConfig):
    """Which KV connector the engine runs, with vLLM's `--kv-transfer-config` JSON names."""

    kv_connector: str | None = None
    """Registered connector name (e.g. "OffloadConnector", "MultiConnector"), or a class name
    found in `kv_connector_module_path`. None runs no connector."""

    engine_id: str | None = None
    """Identity of this engine instance; a random UUID is filled in when unset, as vLLM does."""

    kv_buffer_device: str | None = "cuda"
    """Device of the connector's transfer buffer (vLLM's default; "cpu" on CPU-only hosts)."""

    kv_buffer_size: float = 1e9
    """Transfer buffer size in bytes, for connectors that use one."""

    kv_role: str | None = None
    """"kv_producer", "kv_consumer" or "kv_both"; required when `kv_connector` is set."""

    kv_rank: int | None = None
    """Rank of this instance in a disaggregated (P/D) deployment, if any."""

    kv_parallel_size: int = 1
    """Number of instances taking part in KV transfer."""

    kv_ip: str = "127.0.0.1"
    """Host of the KV transfer rendezvous, for connectors that use one."""

    kv_port: int = 14579
    """Port of the KV transfer rendezvous, for connectors that use one."""

    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)
    """Connector-specific settings, passed to the connector unchanged."""

    kv_connector_module_path: str | None = None
    """Python module that holds an out-of-tree connector class named `kv_connector`."""

    kv_load_failure_policy: str = "recompute"
    """What to do with blocks whose load failed: "recompute" them or "fail" the request."""

    def __post_init__(self) -> None:
        name = type(self).__name__
        if self.engine_id is None:
            object.__setattr__(self, "engine_id", str(uuid.uuid4()))
        if self.kv_connector is not None and (
            not isinstance(self.kv_connector, str) or not self.kv_connector
        ):
            raise _fail(name, "kv_connector", self.kv_connector, "must be a non-empty name")
        if self.kv_role is not None and self.kv_role not in KV_ROLES:
            raise _fail(name, "kv_role", self.kv_role, f"must be one of {', '.join(KV_ROLES)}")
        if self.kv_connector is not None and self.kv_role is None:
            raise _fail(name, "kv_role", None, "is required when kv_connector is set")
        if self.kv_rank is not None:
            _check_int(name, "kv_rank", self.kv_rank, 0)
        _check_int(name, "kv_parallel_size", self.kv_parallel_size, 1)
        _check_int(name, "kv_port", self.kv_port, 1)
        if isinstance(self.kv_buffer_size, bool) or not isinstance(
            self.kv_buffer_size, int | float
        ):
            raise _fail(name, "kv_buffer_size", self.kv_buffer_size, "must be a number")
        if self.kv_buffer_size < 0:
            raise _fail(name, "kv_buffer_size", self.kv_buffer_size, "must be >= 0")
        if not isinstance(self.kv_connector_extra_config, dict):
            raise _fail(
                name,
                "kv_connector_extra_config",
                self.kv_connector_extra_config,
                "must be an object",
            )
        if self.kv_load_failure_policy not in ("recompute", "fail"):
            raise _fail(
                name,
                "kv_load_failure_policy",
                self.kv_load_failure_policy,
                "must be 'recompute' or 'fail'",
            )

    @property
    def is_kv_producer(self) -> bool:
        return self.kv_connector is not None and self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_kv_consumer(self) -> bool:
        return self.kv_connector is not None and self.kv_role in ("kv_consumer", "kv_both")

    def get_from_extra_config(self, key: str, default: Any) -> Any:
        """A connector setting from `kv_connector_extra_config`, or `default`."""
        return self.kv_connector_extra_config.get(key, default)

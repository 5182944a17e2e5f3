"""The instances behind the router, each named once by its URL.

    Instance.parse(spec)            `--instance URL,EVENTS[,REPLAY][,peer=HOST:PORT]`
    Instances(decode, prefill)      every instance, in order: those routed to (or, in P/D,
                                    decoding), then the prefill-only ones; `by_name`,
                                    `prefill_names`

The name is used by the index, the scorer, metrics and logs alike.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

from kvconnect.transfer_params import parse_endpoint

HTTP_DEFAULT_PORT = 80
"""An instance URL without a port means this one (`Instance.port`)."""


@dataclass(frozen=True)
class Instance:
    """One engine instance behind the router. Its URL is its name everywhere: in the index,
    the scorer, metrics and logs."""

    url: str
    events_endpoint: str
    replay_endpoint: str | None = None
    peer: tuple[str, int] | None = None
    """Where its peer tier serves (host, rank 0's port): other instances may pull from it
    (`remote_kv_source`)."""

    @property
    def name(self) -> str:
        return self.url

    @property
    def port(self) -> int:
        """The instance's HTTP port: 80 when its URL gives none, as for any http:// URL."""
        return urlsplit(self.url).port or HTTP_DEFAULT_PORT

    @classmethod
    def parse(cls, spec: str) -> Instance:
        """`URL,EVENTS_ENDPOINT[,REPLAY_ENDPOINT][,peer=HOST:PORT]`, the URL an http:// one
        (`check_url`). A URL alone (`URL[,peer=...]`) is `discovery.parse_instance`'s."""
        parts = spec.split(",")
        peer = None
        if len(parts) > 2 and parts[-1].startswith("peer="):
            peer = parse_peer(spec, parts.pop().removeprefix("peer="))
        if (
            len(parts) not in (2, 3)
            or "://" not in parts[0]
            or not all(p.startswith(("tcp://", "ipc://", "inproc://")) for p in parts[1:])
        ):
            raise ValueError(
                f"--instance {spec!r}: expected URL[,EVENTS_ENDPOINT[,REPLAY_ENDPOINT]]"
                "[,peer=HOST:PORT] (e.g. http://127.0.0.1:8001,tcp://127.0.0.1:18001,"
                "tcp://127.0.0.1:28001,peer=127.0.0.1:7100)"
            )
        check_url(parts[0])
        return cls(parts[0].rstrip("/"), parts[1], parts[2] if len(parts) == 3 else None, peer)


def parse_peer(spec: str, addr: str) -> tuple[str, int]:
    """`HOST:PORT` of an instance's peer tier (`transfer_params.parse_endpoint`, the rule
    the instances' `peer.sources` follow); `ValueError` naming `spec` if it is not one."""
    return parse_endpoint(addr, f"--instance {spec!r}: peer")


def check_url(url: str) -> None:
    """`ValueError` naming `--instance` unless `url` is http:// with a host and a valid port.
    The relay speaks plain HTTP only: an https:// instance would get the client's key and
    prompt in clear (on port 80 when none is given), so it is refused, never downgraded."""
    parts = urlsplit(url)
    if parts.scheme.lower() != "http":
        raise ValueError(
            f"--instance {url!r}: TLS to instances is not supported yet (and never plaintext "
            "in its place); give an http:// URL reachable over a trusted network or a tunnel"
        )
    try:
        port = parts.port  # urlsplit checks the port only when asked for it
    except ValueError:
        port = -1
    if port is not None and not 1 <= port <= 65535:
        raise ValueError(f"--instance {url!r}: its port is not 1-65535")
    if not parts.hostname:
        raise ValueError(f"--instance {url!r}: no host")


class Instances(Sequence[Instance]):
    """Every instance behind one router, in order: `decode` (the instances requests are
    routed to; in P/D, those that decode), then `prefill` (P/D's prefill-only instances)."""

    def __init__(self, decode: Sequence[Instance], prefill: Sequence[Instance] = ()) -> None:
        if not decode:
            raise ValueError("the router needs at least one --instance (or --decode-instance)")
        self._all = (*decode, *prefill)
        self._by_name = {i.name: i for i in self._all}
        if len(self._by_name) != len(self._all):
            raise ValueError("each --instance must have its own URL")
        self.prefill_names = frozenset(i.name for i in prefill)
        """P/D's prefill instances (empty: no P/D)."""

    def __len__(self) -> int:
        return len(self._all)

    def __getitem__(self, i: int) -> Instance:  # type: ignore[override]
        return self._all[i]

    def __iter__(self) -> Iterator[Instance]:
        return iter(self._all)

    def by_name(self, name: str) -> Instance:
        return self._by_name[name]

    @property
    def names(self) -> list[str]:
        return [i.name for i in self._all]

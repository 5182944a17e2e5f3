"""Optional CURVE (libzmq's CurveZMQ) on the event stream: encrypted, and only for subscribers
that hold the publisher's public key. Off by default, so vLLM's peers keep working.

Keys are ZMQ certificate files, the format `zmq.auth` reads and writes (no pickling: text
lines `public-key = "<Z85>"`, `secret-key = "<Z85>"`). One command makes a pair of each:

    (umask 077; python -c "import zmq.auth as a; a.create_certificates('keys', 'server'); \
a.create_certificates('keys', 'client')")

which writes `keys/server.key` (public), `keys/server.key_secret` (public and secret) and the
same for `client`. Who holds what:
- the publisher: `server.key_secret` (`KVEventsConfig.curve_secret_key_file`); its XPUB and
  replay ROUTER are then CURVE servers;
- a subscriber: `server.key` and its own `client.key_secret` (`CurveClientKeys.from_files`).

A peer without the server's public key cannot complete the handshake: it receives nothing,
and whatever it sends is never read. No client list is kept (no ZAP handler): every client
that knows the server's public key is admitted, so hand that file out like a password.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
from zmq.utils import z85

from kvconnect.config import check_secret_mode


def _key(path: str, text: bytes | None, what: str) -> bytes:
    if text is None:
        raise ValueError(f"{path}: holds no {what} key")
    try:
        ok = len(z85.decode(text)) == 32
    except (ValueError, KeyError, IndexError):
        ok = False
    if not ok:
        raise ValueError(f"{path}: its {what} key is not 40 Z85 characters")
    return text


def load_keys(path: str, *, secret: bool) -> tuple[bytes, bytes | None]:
    """(public, secret) keys of the certificate at `path`; with `secret`, the file must be
    its owner's alone (`check_secret_mode`) and the secret key must be there and belong to
    the public one. ValueError naming the file otherwise."""
    if not zmq.has("curve"):
        raise ValueError("CURVE keys given, but this libzmq was built without CURVE")
    if not Path(path).is_file():
        raise ValueError(f"{path}: no such key file")
    if secret:
        check_secret_mode(path, os.stat(path).st_mode)
    try:
        public, secret_key = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: not a ZMQ certificate ({e})") from e
    public = _key(path, public, "public")
    if not secret:
        return public, None
    secret_key = _key(path, secret_key, "secret")
    if zmq.curve_public(secret_key) != public:
        raise ValueError(f"{path}: its secret key does not belong to its public key")
    return public, secret_key


@dataclass(frozen=True)
class CurveServerKeys:
    """The publisher's key pair: every socket it serves on is a CURVE server."""

    public: bytes
    secret: bytes

    @classmethod
    def from_file(cls, secret_key_file: str) -> CurveServerKeys:
        public, secret = load_keys(secret_key_file, secret=True)
        assert secret is not None
        return cls(public, secret)

    def apply(self, sock: zmq.Socket[bytes]) -> None:
        """Before bind/connect."""
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.secret)


@dataclass(frozen=True)
class CurveClientKeys:
    """A subscriber's keys: the publisher's public key and its own pair."""

    server_public: bytes
    public: bytes
    secret: bytes

    @classmethod
    def from_files(
        cls, server_public_key_file: str, client_secret_key_file: str
    ) -> CurveClientKeys:
        server_public, _ = load_keys(server_public_key_file, secret=False)
        public, secret = load_keys(client_secret_key_file, secret=True)
        assert secret is not None
        return cls(server_public, public, secret)

    def apply(self, sock: zmq.Socket[bytes]) -> None:
        """Before bind/connect."""
        sock.setsockopt(zmq.CURVE_SERVERKEY, self.server_public)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.secret)

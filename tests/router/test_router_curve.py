"""The router reads event streams with CURVE on, given the keys `events tail` takes (the same
two environment variables); without them it learns nothing from such a stream."""

from __future__ import annotations

import os
from pathlib import Path

import zmq.auth

from kvconnect.commands.events import CURVE_CLIENT_KEY_ENV, CURVE_SERVER_KEY_ENV, curve_from_env
from kvconnect.model.tokenizer import load_tokenizer
from kvconnect.router.core import Router
from kvconnect.router.index import BlockIndex
from kvconnect.router.instances import Instance
from kvconnect.stream.publisher import ZmqEventPublisher
from tests.helpers import make_batch, tcp_pair, wait_for

NAME = "http://127.0.0.1:1"


def test_a_router_with_the_keys_follows_a_curve_stream_and_one_without_learns_nothing(
    tmp_path: Path,
) -> None:
    keys = {}
    for name in ("server", "client"):
        public, secret = zmq.auth.create_certificates(tmp_path, name)
        os.chmod(secret, 0o600)  # a secret key open to others is refused
        keys[name], keys[name + "_secret"] = str(public), str(secret)
    curve = curve_from_env(
        {CURVE_SERVER_KEY_ENV: keys["server"], CURVE_CLIENT_KEY_ENV: keys["client_secret"]}
    )
    assert curve is not None
    ep, rp = tcp_pair()
    pub = ZmqEventPublisher.open(
        bind=True, endpoint=ep, replay_endpoint=rp, curve_secret_key_file=keys["server_secret"]
    )
    routers = {
        keyed: Router(
            [Instance(NAME, ep, rp)],
            BlockIndex(block_size=16),
            load_tokenizer("tiny"),
            curve=curve if keyed else None,
        ).start()
        for keyed in (False, True)
    }
    try:
        for i in range(3):
            pub.publish(make_batch(i, num_events=1))
        index = routers[True].index
        wait_for(lambda: index.num_blocks().get(NAME, 0) >= 3, 20, what=index.num_blocks)
        pub.publish(make_batch(3, num_events=1))  # and live (the first 3: replayed, decrypted)
        wait_for(lambda: index.num_blocks().get(NAME, 0) >= 4, 20, what=index.num_blocks)
        # The keyed router has both the replayed and the live batch; the plain one, started
        # first and asking the same sockets, was refused at the handshake.
        assert routers[False].index.num_blocks().get(NAME, 0) == 0
        for r in routers.values():
            r.index.check_integrity()
    finally:
        for r in routers.values():
            r.close()
        pub.shutdown()

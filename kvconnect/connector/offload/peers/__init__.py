"""Peers: instances pulling each other's chunks (issue 32), P/D in NixlConnector's handshake,
and what keeps a peer from hurting the instance (issue 46).

    transport.py   which wire a peer config speaks and the surface both give: `serve`,
                   `connect`, `PeerKeys` (the deployment's secrets for peers)
    protocol.py    the verbs, bounds, greeting, deadlines and chunk checks both wires share
    tcp.py         the default wire: plain TCP, no ZMQ, bounded connections and deadlines
    curve.py       the wire under CURVE: ZMQ, encrypted, a ZAP handler admitting key holders
    sources.py     the scheduler half: the configured peer a request names, and how much of
                   its prefix it holds (a lookup thread per configured peer)
    side.py        a worker rank's half: its server, and pulls on the worker's pull threads

Rules. A request names one of the instance's configured peers (`peer.sources`), never an
endpoint. Nothing on the engine's step thread waits on a peer: lookups run on their own
threads, pulls on the worker's pull threads, the server on its own. Every wait on a peer has
a deadline, every byte a peer sends a bound, every pulled chunk the checks of a shared
store's entry before anyone uses it.
"""

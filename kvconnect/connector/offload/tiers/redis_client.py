"""What the redis tier and its watcher share of Redis: the key prefix of every chunk, the
errors a server or cluster raises (and which of them mean it did not answer), clients made
with short timeouts, and URLs fit for logs.

Its own module so that the tier (redis.py) can make its watcher (redis_watch.py) while both
use these, with no import cycle between the two.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

import redis
from redis.cluster import RedisCluster
from redis.exceptions import RedisClusterException

KEY_PREFIX = "kvconnect:"
"""Starts every key the tier writes (then `common.chunk_key`)."""
ERRORS = (redis.RedisError, RedisClusterException)
"""What a server or cluster that is down or failing over raises (the cluster client's own
"no node reachable" is not a RedisError)."""
UNREACHABLE = (
    redis.ConnectionError,
    redis.TimeoutError,
    redis.exceptions.ClusterError,
    RedisClusterException,
)
"""The errors that say no server answered (refused, reset, timed out, a cluster with no node
or slot reachable; the tier backs off on these); another error is an answer (an OOM reply)."""


def redact(url: str) -> str:
    """The URL without its password, for logs."""
    scheme, sep, rest = url.partition("://")
    return f"{scheme}{sep}{rest.rpartition('@')[2]}" if sep else url


def with_password(url: str, password: str) -> str:
    """`url` with `password` in it (quoted; after the URL's user if it names one)."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        raise ValueError(f"redis url {url!r}: no scheme (redis:// or rediss://)")
    user, at, _ = rest.partition("/")[0].rpartition("@")
    if at and ":" in user:
        raise ValueError("the redis url has a password already")
    host = rest.rpartition("@")[2] if at else rest
    return f"{scheme}://{user}:{quote(password, safe='')}@{host}"


def connect(url: str, cluster: bool = False) -> Any:
    """A client for `url` (password and rediss:// TLS as in the URL) with short timeouts; for
    a cluster, one that finds every node from the one named and follows slot moves and
    failovers."""
    if cluster:
        return RedisCluster.from_url(url, socket_timeout=2.0, socket_connect_timeout=2.0)
    return redis.Redis.from_url(url, socket_timeout=2.0, socket_connect_timeout=2.0)

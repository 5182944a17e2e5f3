"""Throwaway redis-servers on loopback, for `kvconnect cluster --redis`, tests and benchmarks.

`LocalRedis`: one server with no persistence, in its own temporary directory, on a free port
unless one is given; `stop()` ends it and removes the directory. With `password` it requires
it (`requirepass`, written to a config file in that owner-only directory rather than given
on its command line, which every local user can read); `url` then carries it.
`LocalRedisCluster`: a Redis Cluster of masters (each with a replica) made with
`redis-cli --cluster create`, for the redis tier's `"cluster": true`.
"""

from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence

import redis


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _cluster_port() -> int:
    """A free port p <= 55535 whose cluster bus port p + 10000 is free too."""
    for _ in range(1000):
        port = random.randrange(20000, 55535)
        if _is_free(port) and _is_free(port + 10000):
            return port
    raise RuntimeError("no free port pair for a redis cluster node")


class LocalRedis:
    def __init__(
        self,
        port: int | None = None,
        timeout: float = 10.0,
        extra_args: Sequence[str] = (),
        password: str | None = None,
    ) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
        if port is None:
            port = _free_port()
        self.port = port
        self.password = password
        auth = f":{password}@" if password else ""
        self.url = f"redis://{auth}127.0.0.1:{port}/0"
        self.workdir = tempfile.mkdtemp(prefix="kvconnect-redis-")  # mode 0700
        conf = os.path.join(self.workdir, "redis.conf")
        fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            if password:  # a quoted config value: the password is generated, never a quote
                f.write(f'requirepass "{password}"\n')
        self.proc = subprocess.Popen(
            [
                exe,
                conf,
                "--port",
                str(port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                self.workdir,
                *extra_args,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self._wait(timeout)

    def _wait(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1) as conn:
                    if self.password:
                        conn.sendall(f"AUTH {self.password}\r\n".encode())
                        if not conn.recv(16).startswith(b"+OK"):
                            raise OSError("not ready for AUTH")
                    conn.sendall(b"PING\r\n")
                    if conn.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"redis-server did not start on port {self.port}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        shutil.rmtree(self.workdir, ignore_errors=True)


class LocalRedisCluster:
    """`masters` masters with one replica each, on free loopback ports. A failed master's
    replica takes over within about `node_timeout_ms` (see `kill_master`)."""

    def __init__(self, masters: int = 3, node_timeout_ms: int = 1000, timeout: float = 30.0):
        args = [
            "--cluster-enabled",
            "yes",
            "--cluster-config-file",
            "nodes.conf",
            "--cluster-node-timeout",
            str(node_timeout_ms),
            "--repl-diskless-sync-delay",
            "0",  # replicas sync at once, so a failover can happen from the start
        ]
        self.nodes: list[LocalRedis] = []
        try:
            for _ in range(2 * masters):
                self.nodes.append(LocalRedis(_cluster_port(), timeout=timeout, extra_args=args))
            exe = shutil.which("redis-cli")
            if exe is None:
                raise RuntimeError("redis-cli is not installed (apt-get install redis-tools)")
            addresses = [f"127.0.0.1:{n.port}" for n in self.nodes]
            subprocess.run(
                [
                    exe,
                    "--cluster",
                    "create",
                    *addresses,
                    "--cluster-replicas",
                    "1",
                    "--cluster-yes",
                ],
                check=True,
                capture_output=True,
                timeout=timeout,
            )
            self.wait_ok(timeout)
        except BaseException:
            self.stop()
            raise
        self.url = f"redis://127.0.0.1:{self.nodes[0].port}/0"

    def _alive(self) -> list[LocalRedis]:
        return [n for n in self.nodes if n.proc.poll() is None]

    def wait_ok(self, timeout: float = 30.0) -> None:
        """Until every live node says the cluster is ok, `masters` masters serve and every
        live replica is in sync with its master."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                if (
                    all(self._ok(n) for n in self._alive())
                    and len(self.masters()) == len(self.nodes) // 2
                ):
                    return
            except redis.RedisError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("the redis cluster did not become ok")
            time.sleep(0.05)

    @staticmethod
    def _ok(node: LocalRedis) -> bool:
        client = redis.Redis(port=node.port, socket_timeout=1)
        if client.cluster("info")["cluster_state"] != "ok":
            return False
        info = client.info("replication")
        return info["role"] == "master" or info.get("master_link_status") == "up"

    def masters(self) -> list[LocalRedis]:
        out = []
        for n in self._alive():
            try:
                role = redis.Redis(port=n.port, socket_timeout=1).info("replication")["role"]
            except redis.RedisError:
                continue
            if role == "master":
                out.append(n)
        return out

    def kill_master(self, node: LocalRedis | None = None) -> LocalRedis:
        """SIGKILL a master (the first unless given); its replica is promoted. Returns it."""
        victim = node or self.masters()[0]
        victim.proc.kill()
        victim.proc.wait()
        return victim

    def stop(self) -> None:
        for n in self.nodes:
            n.stop()

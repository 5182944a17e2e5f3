"""What a chunk must be to load: signed with the deployment key when one is set, describing the
chunk asked for, of this engine's shape; the key file checked at start; the model fingerprint
in the key namespace; Redis with a password, an ACL user and no CONFIG rights."""

from __future__ import annotations

import io
import logging
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import torch

from kvconnect.cli import build_parser
from kvconnect.commands.cluster import instance_command
from kvconnect.commands.cluster import redis_tier as cluster_redis_tier
from kvconnect.commands.cluster import start_redis as cluster_redis
from kvconnect.commands.redis_server import LocalRedis
from kvconnect.connector.offload.common import ChunkInfo, TierConfig, key_namespace
from kvconnect.connector.offload.kinds import TierKind
from kvconnect.connector.offload.tiers.base import (
    IntegrityError,
    StoredChunk,
    TierPlacement,
    mismatch,
    pack,
    read_mac_key,
    unpack,
)
from kvconnect.connector.offload.tiers.redis import RedisTier
from kvconnect.connector.offload.tiers.redis_client import with_password
from kvconnect.connector.offload.tiers.redis_watch import RedisWatcher
from kvconnect.model.source import weights_identity
from tests.helpers import free_port, wait_for

SHAPE = (2, 2, 8, 2, 4)
KEY = b"k" * 32
PLACEMENT = TierPlacement(1, 0, SHAPE, torch.float32)
ACL_COMMANDS = ["-@all", "+get", "+set", "+exists", "+ping", "+subscribe"]
"""What the redis tier and its watcher need (docs/architecture.md): no CONFIG, no other keys."""


def chunk(i: int) -> tuple[str, ChunkInfo, torch.Tensor]:
    info = ChunkInfo(bytes([i]) * 32, (i * 10, i * 10 + 1), None if i == 0 else i, (i,) * 8, 4)
    return f"m/1/0/{i:02x}", info, torch.full(SHAPE, float(i))


def test_a_signed_chunk_loads_only_with_its_key_and_unchanged() -> None:
    key, info, data = chunk(3)
    signed = b"".join(pack(key, info, data, KEY))
    got_info, got = unpack(signed, key, KEY)
    assert got_info == info and torch.equal(got, data)
    assert torch.equal(unpack(signed, key)[1], data)  # a reader without a key still can
    with pytest.raises(IntegrityError, match="wrong signature"):
        unpack(signed, key, b"x" * 32)
    forged = bytearray(signed)
    forged[-40] ^= 1  # a payload byte (the signature's 32 bytes end the blob)
    with pytest.raises(IntegrityError, match="wrong signature"):
        unpack(bytes(forged), key, KEY)
    # Values overwritten and the checksums recomputed, as anyone with the code can do.
    rewritten = b"".join(pack(key, info, torch.zeros(SHAPE)))
    assert torch.equal(unpack(rewritten, key)[1], torch.zeros(SHAPE))  # no key: accepted
    with pytest.raises(IntegrityError, match="unsigned"):
        unpack(rewritten, key, KEY)


def test_an_entry_must_describe_the_chunk_asked_for_and_this_engines_shape() -> None:
    _, asked, data = chunk(3)
    assert mismatch(asked, StoredChunk(asked, data), PLACEMENT) is None
    other = chunk(4)[1]
    assert "token ids" in str(mismatch(asked, StoredChunk(other, data), PLACEMENT))
    same_tokens = ChunkInfo(
        asked.last_block_hash, (1, 2), asked.parent_block_hash, asked.token_ids, 4
    )
    assert "block hashes" in str(mismatch(asked, StoredChunk(same_tokens, data), PLACEMENT))
    orphan = ChunkInfo(asked.last_block_hash, asked.block_hashes, 99, asked.token_ids, 4)
    assert "parent" in str(mismatch(asked, StoredChunk(orphan, data), PLACEMENT))
    # One KV head where the engine has two would broadcast into both: refused.
    narrow = data[:, :, :, :1]
    assert "shape" in str(mismatch(asked, StoredChunk(asked, narrow), PLACEMENT))
    half = data.half()
    assert "float16" in str(mismatch(asked, StoredChunk(asked, half), PLACEMENT))
    # A tail (one block of 4 tokens): its data has its own tokens, no more, no fewer.
    tail = ChunkInfo(b"t" * 32, (30,), 3, (3,) * 4, 4)
    assert mismatch(tail, StoredChunk(tail, data[:, :, :4]), PLACEMENT) is None
    assert "shape" in str(mismatch(tail, StoredChunk(tail, data), PLACEMENT))
    assert "token ids" in str(mismatch(tail, StoredChunk(asked, data), PLACEMENT))


def test_the_key_file_is_checked_at_start(tmp_path: Path) -> None:
    path = tmp_path / "key"
    with pytest.raises(ValueError, match=r"hmac_key_file .*cannot be opened"):
        read_mac_key(str(path))
    path.write_bytes(b"short\n")
    path.chmod(0o600)
    with pytest.raises(ValueError, match="holds 5 bytes, needs at least 16"):
        read_mac_key(str(path))
    path.write_bytes(b"  0123456789abcdef0123\n")
    for mode in (0o644, 0o640, 0o620):
        path.chmod(mode)
        with pytest.raises(ValueError, match=f"mode 0{mode:o}: a secret file must not"):
            read_mac_key(str(path))
    path.chmod(0o600)
    assert read_mac_key(str(path)) == b"0123456789abcdef0123"
    with pytest.raises(ValueError, match="not a regular file"):
        read_mac_key(str(tmp_path))
    with pytest.raises(ValueError, match="hmac_key_file is for the disk and redis tiers"):
        TierConfig(TierKind.CPU, hmac_key_file=str(path))
    with pytest.raises(ValueError, match="holds 0 bytes"):
        (tmp_path / "empty").touch(mode=0o600)
        RedisTier.from_config(
            TierConfig(
                TierKind.REDIS, url="redis://127.0.0.1:1/0", hmac_key_file=str(tmp_path / "empty")
            ),
            PLACEMENT,
        )


def fake_checkpoint(path: Path, weights: bytes) -> Path:
    path.mkdir()
    (path / "config.json").write_text('{"model_type": "llama"}')
    (path / "model.safetensors").write_bytes(weights)
    return path


def test_the_fingerprint_tells_checkpoints_apart_and_not_copies(tmp_path: Path) -> None:
    weights = bytes(range(256)) * (3 << 12)  # 3 MiB: head and tail samples are distinct
    a = weights_identity(str(fake_checkpoint(tmp_path / "a", weights)))
    tuned = weights[:-1] + b"\x00"  # another fine-tune: only the last byte differs
    b = weights_identity(str(fake_checkpoint(tmp_path / "b", tuned)))
    shutil.copytree(tmp_path / "a", tmp_path / "copy")  # another path, another mtime
    copy = weights_identity(str(tmp_path / "copy"))
    assert a != b and a == copy and weights_identity("tiny") == "tiny"
    ns = key_namespace("m", a, 16, 256)
    assert ns.startswith("m@") and ns == key_namespace("m", copy, 16, 256)
    others = {key_namespace("m", b, 16, 256), key_namespace("m", a, 32, 256)}
    others |= {key_namespace("m", a, 16, 512), key_namespace("n", a, 16, 256)}
    assert ns not in others and len(others) == 4


@pytest.fixture
def locked_redis() -> Iterator[LocalRedis]:
    """A server with a password and an ACL user `kv` that may use kvconnect's keys and the
    keyevent channels, but not CONFIG; keyspace notifications set by the operator."""
    server = LocalRedis(port=free_port(), password="admin-secret-0123")
    admin = redis.Redis.from_url(server.url)
    admin.config_set("notify-keyspace-events", "Eex")
    admin.acl_setuser(
        "kv",
        enabled=True,
        passwords=["+kv-secret-4567"],
        keys=["kvconnect:*"],
        channels=["__keyevent@0__:*"],
        commands=ACL_COMMANDS,
    )
    yield server
    server.stop()


def test_requirepass_and_an_acl_user_work_and_wrong_credentials_fail_clearly(
    locked_redis: LocalRedis,
) -> None:
    key, info, data = chunk(5)
    port = locked_redis.port
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(port=port).ping()  # requirepass is on
    for url in (locked_redis.url, f"redis://kv:kv-secret-4567@127.0.0.1:{port}/0"):
        tier = RedisTier(url, mac_key=KEY)
        tier.check_reachable()
        tier.put(key, info, data)
        assert tier.contains(key) and torch.equal(tier.get(key), data)  # type: ignore[arg-type]
        assert "secret" not in tier.url
        tier.close()
    acl = redis.Redis.from_url(f"redis://kv:kv-secret-4567@127.0.0.1:{port}/0")
    with pytest.raises(redis.exceptions.NoPermissionError):
        acl.config_get("notify-keyspace-events")  # the user really has no CONFIG rights
    with pytest.raises(redis.exceptions.NoPermissionError):
        acl.set("not-ours", b"")  # nor other keys
    bad = RedisTier(f"redis://kv:wrong@127.0.0.1:{port}/0")
    with pytest.raises(ValueError, match="refused the URL's credentials") as e:
        bad.check_reachable()
    assert "wrong" not in str(e.value)  # the URL in the message is redacted
    bad.close()


def watcher(url: str) -> RedisWatcher:
    ns = "m@0/1/"
    return RedisWatcher(url, ns, 1, lambda last: [f"{ns}0/{{{last.hex()}}}"])


def test_the_watcher_works_without_config_rights_when_the_operator_set_the_flags(
    locked_redis: LocalRedis,
) -> None:
    w = watcher(f"redis://kv:kv-secret-4567@127.0.0.1:{locked_redis.port}/0")
    try:
        assert w.connected.wait(10)
        assert w.notifications_checked is True and not w.enabled_by_us
        last = b"\x07" * 32
        admin = redis.Redis.from_url(locked_redis.url)
        admin.set(f"kvconnect:m@0/1/0/{{{last.hex()}}}", b"x")
        w.announce(last, [7])
        admin.pexpire(f"kvconnect:m@0/1/0/{{{last.hex()}}}", 1)
        wait_for(lambda: w.has_removed)  # the expiry's notification, heard
        assert w.take_removed() == [(last, [7])]
    finally:
        w.shutdown()


def test_the_watcher_names_the_missing_setting_when_it_may_not_set_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    server = LocalRedis(port=free_port(), password="admin-secret-0123")
    admin = redis.Redis.from_url(server.url)
    admin.acl_setuser(
        "kv",
        enabled=True,
        passwords=["+kv-secret-4567"],
        keys=["kvconnect:*"],
        channels=["__keyevent@0__:*"],
        commands=ACL_COMMANDS,
    )
    with caplog.at_level(logging.ERROR):
        w = watcher(f"redis://kv:kv-secret-4567@127.0.0.1:{server.port}/0")
        try:
            assert w.connected.wait(15)
            assert w.notifications_checked is False
        finally:
            w.shutdown()
            server.stop()
    [line] = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert "notify-keyspace-events" in line and "'Eex'" in line and "kv-secret" not in line


def test_kvconnect_cluster_starts_redis_with_a_password_it_never_prints(tmp_path: Path) -> None:
    out = io.StringIO()
    server = cluster_redis(out)
    try:
        assert server.password and len(server.password) >= 24
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=server.port).ping()
        assert redis.Redis.from_url(server.url).ping()
        assert server.password not in out.getvalue() and "password set" in out.getvalue()
        args = Path(f"/proc/{server.proc.pid}/cmdline").read_bytes()
        assert server.password.encode() not in args  # not on the server's command line
        # The instances get it in a 0600 file their tier config names, not in their argv.
        tier = cluster_redis_tier(server, str(tmp_path))
        command = instance_command(0, build_parser().parse_args(["cluster"]), tier)
        assert server.password not in " ".join(command)
        assert (Path(str(tier["password_file"])).stat().st_mode & 0o777) == 0o600
        config = TierConfig(
            kind=TierKind.REDIS, url=str(tier["url"]), password_file=str(tier["password_file"])
        )
        with RedisTier.from_config(config, PLACEMENT) as redis_tier:
            redis_tier.check_reachable()
    finally:
        server.stop()


def test_a_redis_password_file_is_checked_and_exclusive_of_a_url_password(tmp_path: Path) -> None:
    secret = tmp_path / "pw"
    secret.write_text("pw\n")
    secret.chmod(0o644)
    tier = TierConfig(kind=TierKind.REDIS, url="redis://127.0.0.1:1/0", password_file=str(secret))
    with pytest.raises(ValueError, match=r"password_file .* is mode 0644: a secret file"):
        RedisTier.from_config(tier, PLACEMENT)
    with pytest.raises(ValueError, match="a password in its url and a password_file"):
        TierConfig(kind=TierKind.REDIS, url="redis://:x@127.0.0.1:1/0", password_file=str(secret))
    with pytest.raises(ValueError, match="password_file is for the redis tier"):
        TierConfig(kind=TierKind.DISK, path=str(tmp_path), password_file=str(secret))
    assert with_password("rediss://kv@h:6380/0", "a/b:c") == "rediss://kv:a%2Fb%3Ac@h:6380/0"
    assert with_password("redis://h:1/2", "p") == "redis://:p@h:1/2"


@pytest.fixture
def tls_redis(tmp_path: Path) -> Iterator[str]:
    """A server that also speaks TLS (a throwaway CA and certificate for 127.0.0.1), with a
    password; yields its rediss:// URL."""
    if shutil.which("openssl") is None:
        pytest.fail("the TLS test makes its certificates with openssl (apt-get install openssl)")

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=tmp_path, check=True, capture_output=True)

    new_key = ["-newkey", "rsa:2048", "-nodes", "-days", "1"]
    openssl("req", "-x509", *new_key, "-keyout", "ca.key", "-out", "ca.crt", "-subj", "/CN=ca")
    openssl("req", *new_key, "-keyout", "s.key", "-out", "s.csr", "-subj", "/CN=127.0.0.1")
    (tmp_path / "ext.cnf").write_text("subjectAltName=IP:127.0.0.1\n")
    openssl(
        "x509", "-req", "-in", "s.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
        "-out", "s.crt", "-extfile", "ext.cnf", "-days", "1",
    )  # fmt: skip
    tls_port = free_port()
    args = ["--tls-port", str(tls_port), "--tls-auth-clients", "no"]
    for flag, name in (("cert", "s.crt"), ("key", "s.key"), ("ca-cert", "ca.crt")):
        args += [f"--tls-{flag}-file", str(tmp_path / name)]
    server = LocalRedis(port=free_port(), password="tls-secret-89ab", extra_args=args)
    url = f"rediss://:tls-secret-89ab@127.0.0.1:{tls_port}/0?ssl_ca_certs={tmp_path}/ca.crt"
    yield url
    server.stop()


def test_rediss_tls_carries_the_tier_and_its_watcher(tls_redis: str) -> None:
    url = tls_redis
    key, info, data = chunk(6)
    with RedisTier(url, mac_key=KEY) as tier:
        tier.check_reachable()
        tier.put(key, info, data)
        assert torch.equal(tier.get(key), data)  # type: ignore[arg-type]
    untrusted = RedisTier(url.partition("?")[0])  # no CA: the server's certificate is refused
    with pytest.raises(ValueError, match="CERTIFICATE_VERIFY_FAILED"):
        untrusted.check_reachable()
    untrusted.close()
    w = watcher(url)
    try:
        assert w.connected.wait(10) and w.notifications_checked is True
    finally:
        w.shutdown()

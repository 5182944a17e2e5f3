import io
import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from kvconnect import __version__
from kvconnect.cli import main
from kvconnect.commands.events import demo_batches, format_item, run_demo
from kvconnect.events import AllBlocksCleared, BlockStored, KVEventBatch
from kvconnect.hashing import block_hashes, to_wire
from kvconnect.stream.publisher import ZmqEventPublisher
from kvconnect.stream.subscriber import EventsLost, PublisherRestarted, ReceivedBatch, StreamId
from tests.helpers import free_port, make_batch, tcp_pair


def test_demo_publishes_and_tails_every_batch() -> None:
    out = io.StringIO()
    assert run_demo(free_port(2), 6, out) == 6
    text = out.getvalue()
    heads = [line for line in text.splitlines() if line.startswith("seq=")]
    assert [h.split()[0] for h in heads] == [f"seq={i}" for i in range(6)]
    assert "BlockStored  medium=GPU blocks=6 parent=- tokens=96" in text
    assert "medium=CPU" in text and "BlockRemoved medium=GPU" in text
    assert text.rstrip().endswith("AllBlocksCleared")


def test_demo_events_carry_real_chained_hashes() -> None:
    first = demo_batches(3)[0].events[0]
    assert isinstance(first, BlockStored)
    assert first.block_hashes == [to_wire(h) for h in block_hashes(first.token_ids, 16)]
    assert isinstance(demo_batches(3)[-1].events[0], AllBlocksCleared)


def test_format_items_readable_and_json() -> None:
    stream = StreamId("tcp://127.0.0.1:1", "kv", 0)
    item = ReceivedBatch(3, make_batch(1, num_events=2), stream)
    text = format_item(item, as_json=False)
    assert text.startswith("seq=3 rank=None") and "BlockRemoved medium=GPU blocks=1" in text
    record = json.loads(format_item(item, as_json=True))
    assert record["seq"] == 3 and record["topic"] == "kv"
    assert record["events"][0]["type"] == "BlockStored"
    assert record["events"][1] == {"type": "BlockRemoved", "block_hashes": [1001], "medium": "GPU"}
    lost = json.loads(format_item(EventsLost(stream, 4, 9), as_json=True))
    assert lost == {"events_lost": {"endpoint": stream.endpoint, "first_seq": 4, "last_seq": 9}}
    assert "restarted" in format_item(PublisherRestarted(stream, 9, 0), as_json=False)


def test_tail_snapshot_prints_the_whole_state_then_follows() -> None:
    ep, rp = tcp_pair()
    pub = ZmqEventPublisher.open(bind=True, endpoint=ep, replay_endpoint=rp, buffer_steps=2)
    try:
        for i in range(10):  # ten stored blocks; the ring keeps only the last two batches
            pub.publish(KVEventBatch(0.0, [BlockStored([i], None, [i] * 4, 4, None, "GPU", None)]))
        cmd = [sys.executable, "-m", "kvconnect.cli", "events", "tail", "--endpoint", ep]
        proc = subprocess.Popen(
            [*cmd, "--replay", rp, "--snapshot", "--json"], stdout=subprocess.PIPE, text=True
        )
        try:
            assert proc.stdout is not None
            first = json.loads(proc.stdout.readline())
            assert first["snapshot"]["seq"] == 9
            held = sorted(h for e in first["snapshot"]["events"] for h in e["block_hashes"])
            assert held == list(range(10))
            assert pub.wait_for_subscriber()
            pub.publish(KVEventBatch(0.0, [AllBlocksCleared()]))
            assert json.loads(proc.stdout.readline())["seq"] == 10
        finally:
            proc.kill()
            proc.wait()
    finally:
        pub.shutdown()


def test_tail_rejects_a_bad_endpoint(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["events", "tail", "--endpoint", "tcp://nohost"]) == 2
    assert "tcp://nohost" in capsys.readouterr().err


def test_router_rejects_bad_instances_and_weights(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["router", "--instance", "nonsense"]) == 2
    assert "URL[,EVENTS_ENDPOINT" in capsys.readouterr().err
    assert (
        main(
            [
                "router",
                "--instance",
                "http://127.0.0.1:1,tcp://127.0.0.1:2",
                "--tier-weights",
                "GPU",
            ]
        )
        == 2
    )
    assert "--tier-weights" in capsys.readouterr().err


def one_line_error(capsys: pytest.CaptureFixture[str], argv: list[str], *names: str) -> str:
    """`argv` exits 2 with one line on stderr that names each of `names`."""
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith(f"kvconnect {argv[0]}: error: "), err
    for name in names:
        assert name in err, (name, err)
    return err


@pytest.mark.parametrize(
    ("argv", "names"),
    [
        (["serve", "--tp", "0"], ["--tp", "0"]),
        (["generate", "--tp", "0", "--prompt", "x"], ["--tp"]),
        (["serve", "--port", "70000"], ["--port", "70000"]),
        (["serve", "--model", "tiny", "--kv-events-config", "{bad"], ["--kv-events-config"]),
        (["serve", "--model", "tiny", "--kv-transfer-config", "[1]"], ["--kv-transfer-config"]),
        (
            ["serve", "--model", "tiny", "--kv-events-config", '{"enable_kv_cache_events": 1}'],
            ["--kv-events-config", "enable_kv_cache_events"],
        ),
        (
            [
                "serve",
                "--model",
                "tiny",
                "--kv-events-config",
                '{"enable_kv_cache_events": true, "publisher": "nats"}',
            ],
            ["--kv-events-config", "nats"],
        ),
        (
            [
                "serve",
                "--model",
                "tiny",
                "--kv-transfer-config",
                '{"kv_connector": "Nope", "kv_role": "kv_both"}',
            ],
            ["--kv-transfer-config", "Nope"],
        ),
        (
            [
                "serve",
                "--model",
                "tiny",
                "--port",
                "50000",
                "--kv-events-config",
                '{"enable_kv_cache_events": true}',
            ],
            ["--port 50000", "replay_endpoint"],
        ),
        (["serve", "--model", "/missing/model"], ["/missing/model"]),
        (
            [
                "router",
                "--model",
                "/missing/model",
                "--instance",
                "http://127.0.0.1:1,tcp://127.0.0.1:2",
            ],
            ["/missing/model"],
        ),
        (["router", "--instance", "nonsense"], ["--instance", "URL[,EVENTS_ENDPOINT"]),
        (
            [
                "router",
                "--model",
                "tiny",
                "--instance",
                "http://127.0.0.1:1,tcp://127.0.0.1:2",
                "--tier-weights",
                "GPU",
            ],
            ["--tier-weights"],
        ),
        (["events", "tail", "--endpoint", "tcp://nohost"], ["tcp://nohost"]),
        (["serve", "--model", "tiny", "--max-num-waiting", "0"], ["--max-num-waiting"]),
        (["serve", "--model", "tiny", "--request-timeout", "-1"], ["--request-timeout"]),
        (["serve", "--model", "tiny", "--header-timeout", "nan"], ["--header-timeout"]),
        (["serve", "--model", "tiny", "--api-key", " "], ["--api-key", "empty"]),
        (["serve", "--model", "tiny", "--admin-token", ""], ["--admin-token", "empty"]),
        (
            ["router", "--instance", "http://127.0.0.1:1,tcp://127.0.0.1:2", "--api-key", ""],
            ["--api-key", "empty"],
        ),
        (
            [
                "router",
                "--instance",
                "http://127.0.0.1:1,tcp://127.0.0.1:2",
                "--instance-api-key",
                "a\nb",
            ],
            ["--instance-api-key"],
        ),
    ],
)
def test_bad_flags_and_configs_are_one_line_errors(
    capsys: pytest.CaptureFixture[str], argv: list[str], names: list[str]
) -> None:
    one_line_error(capsys, argv, *names)


def test_a_port_in_use_is_named_before_the_model_loads(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        one_line_error(
            capsys, ["serve", "--model", "tiny", "--port", str(port)], "--port", str(port)
        )
        one_line_error(
            capsys,
            [
                "router",
                "--model",
                "tiny",
                "--port",
                str(port),
                "--instance",
                "http://127.0.0.1:1,tcp://127.0.0.1:2",
            ],
            "--port",
            str(port),
        )


def test_an_unreachable_redis_tier_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    url = f"redis://127.0.0.1:{free_port()}"  # a port nothing listens on
    config = json.dumps(
        {
            "kv_connector": "OffloadConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"tiers": [{"kind": "redis", "url": url}]},
        }
    )
    argv = ["serve", "--model", "tiny", "--port", str(free_port()), "--kv-transfer-config", config]
    one_line_error(capsys, argv, url, "unreachable")


def test_version_and_help_with_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"kvconnect {__version__}"
    assert main(["serve", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: None)" not in text and "--tp TP, --tensor-parallel-size TP tensor" in text
    assert "(default: 8000)" in text and "(default: 127.0.0.1)" in text
    assert "(default: smollm2)" in text


def test_a_missing_gguf_file_is_named(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"not a gguf file")
    one_line_error(capsys, ["serve", "--model", str(broken)], str(broken))

import io
import json

import pytest

from kvconnect.cli import demo_batches, format_item, main, run_demo
from kvconnect.events import AllBlocksCleared, BlockStored
from kvconnect.hashing import block_hashes, to_wire
from kvconnect.subscriber import EventsLost, PublisherRestarted, ReceivedBatch, StreamId
from tests.helpers import free_port, make_batch


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


def test_tail_rejects_a_bad_endpoint(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["events", "tail", "--endpoint", "tcp://nohost"]) == 2
    assert "tcp://nohost" in capsys.readouterr().err


def test_router_rejects_bad_instances_and_weights(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["router", "--instance", "nonsense"]) == 2
    assert "URL,EVENTS_ENDPOINT" in capsys.readouterr().err
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

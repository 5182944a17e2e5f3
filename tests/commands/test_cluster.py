"""`make run` (`kvconnect cluster`): two SmolLM2 instances and the router, used as the README
shows, with the OpenAI client; Ctrl-C stops every process."""

from __future__ import annotations

import re
from pathlib import Path

import openai
import pytest

from tests.serving import Process, serve_port

pytestmark = pytest.mark.slow


class Cluster(Process):
    def __init__(self, tmp: Path) -> None:
        super().__init__([], tmp / "cluster.log")
        self.new_ports()
        self.ready_marker = "# serving"

    def new_ports(self) -> None:
        # The router on P, instances on P+1, P+2 (events on +10000, replay on +20000).
        self.port = serve_port(3)
        self.args = ["cluster", "--base-port", str(self.port), "--demo-rounds", "2"]

    def port_taken(self) -> bool:
        """The cluster's own log or an instance's (in the directory its first line names)."""
        dirs = [m.group(1) for line in self.seen if (m := re.search(r"logs in (\S+)", line))]
        logs = [f.read_text(errors="replace") for d in dirs for f in Path(d).glob("*.log")]
        return any("Address already in use" in text for text in [self.logs(), *logs])


@pytest.mark.realmodel
def test_make_run_answers_the_openai_client_and_stops_on_ctrl_c(tmp_path: Path) -> None:
    cluster = Cluster(tmp_path)
    cluster.start()
    try:
        out = cluster.output()
        rounds = re.findall(r"round (\d): -> (\S+)\s+(\d+)/(\d+) prompt tokens cached", out)
        assert len(rounds) == 4, out
        # The second round of each tenant goes where its system prompt is cached.
        first, second = {r[1] for r in rounds[:2]}, rounds[2:]
        assert len(first) == 2 and all(int(cached) >= 32 for _, _, cached, _ in second), out
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{cluster.port}/v1", api_key="unused", max_retries=0
        )
        chat = client.chat.completions.create(
            model="smollm2",
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=16,
            temperature=0,
        )
        assert "Paris" in (chat.choices[0].message.content or "")
        streamed = "".join(
            chunk.choices[0].text
            for chunk in client.completions.create(
                model="smollm2", prompt="One, two, three,", max_tokens=8, temperature=0, stream=True
            )
        )
        assert "four" in streamed.lower()
        children = [
            int(c)
            for c in Path(f"/proc/{cluster.pid}/task/{cluster.pid}/children").read_text().split()
        ]
        assert len(children) == 2  # the instances
    finally:
        code = cluster.stop()
    assert code == 0, cluster.logs()
    assert all(not Path(f"/proc/{pid}").exists() for pid in children)

"""deploy/grafana/kvconnect.json names only metrics that exist: a real `kvconnect serve`
(tiny model, the OffloadConnector with a cpu tier) behind a real `kvconnect router` is sent a
prompt, three others that push it out of the engine's cache, and the prompt again (loaded
from the cpu tier); then every metric name in every panel's PromQL must be in one of the two
/metrics answers, as Prometheus stores it (a counter `_total`, a histogram `_bucket`, `_sum`,
`_count`). The instances' panels use vLLM's names and the plugin's `kvconnect:offload_*`,
which serve exports too, so the dashboard reads vLLM with kvconnect's plugin as well."""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers import wait_for
from tests.serving import RouterProcess, Serve, get, post

pytestmark = pytest.mark.slow

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "kvconnect.json"
rng = random.Random(47)
PROMPT = [rng.randrange(256) for _ in range(150)]  # 4 chunks of 32, 9 blocks of 16
FILLERS = [[rng.randrange(256) for _ in range(160)] for _ in range(3)]  # 10 blocks each

KEYWORDS = frozenset(
    {"by", "without", "on", "ignoring", "group_left", "group_right", "offset", "bool",
     "and", "or", "unless", "atan2"}
)  # fmt: skip


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects. No maintained PromQL parser for Python
    exists, so this strips what cannot be a name (strings, label matchers, ranges, label
    lists of by/without/on/ignoring), then keeps every identifier that is not a keyword, a
    function or an aggregation (those are followed by "(")."""
    text = re.sub(r'"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'|`[^`]*`', '""', expr)
    text = re.sub(r"\{[^}]*\}", " ", text)
    text = re.sub(r"\[[^\]]*\]", " ", text)
    text = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    names = set()
    for m in re.finditer(r"(?<![\w.])[A-Za-z_:][\w:]*", text):
        if m.group(0) not in KEYWORDS and not text[m.end() :].lstrip().startswith("("):
            names.add(m.group(0))
    return names


def exposed(text: str) -> set[str]:
    """Every name a /metrics answer declares, as Prometheus stores its series."""
    names = set()
    for family in text_string_to_metric_families(text):
        names |= {s.name for s in family.samples}
        suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"]}
        names |= {family.name + s for s in suffixes.get(family.type, [""])}
    return names


def expressions(dashboard: dict[str, Any]) -> list[str]:
    return [t["expr"] for p in dashboard["panels"] if p["type"] != "row" for t in p["targets"]]


def missing(dashboard: dict[str, Any], present: set[str]) -> list[str]:
    """The names the dashboard's panels select that `present` does not have."""
    used = set().union(*(metric_names(e) for e in expressions(dashboard)))
    return sorted(used - present)


@pytest.fixture(scope="module")
def scraped(tmp_path_factory: pytest.TempPathFactory) -> Iterator[set[str]]:
    tmp = tmp_path_factory.mktemp("dashboard")
    transfer = {
        "kv_connector": "OffloadConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "chunk_size": 32,
            "tiers": [{"kind": "cpu", "max_bytes": 1 << 28}],
        },
    }
    serve = Serve(tmp, "--num-kv-blocks", "24", "--kv-transfer-config", json.dumps(transfer))
    serve.start()
    router = RouterProcess(tmp, [serve])
    try:
        router.start()
        for prompt in [PROMPT, *FILLERS, PROMPT]:
            status, body, _ = post(router.url + "/v1/completions", {
                "prompt": prompt, "max_tokens": 1
            })  # fmt: skip
            assert status == 200, body

        def cpu_hits() -> float:
            text = get(serve.url + "/metrics")[1]
            found = re.search(r"^kvconnect_connector_cpu_hits_total\{[^}]*\} (\S+)$", text, re.M)
            return float(found.group(1)) if found else 0.0

        # the prompt's 4 whole chunks (and the tail its answer saved) came from the cpu tier
        wait_for(lambda: cpu_hits() >= 4, 10)
        yield exposed(get(serve.url + "/metrics")[1]) | exposed(get(router.url + "/metrics")[1])
    finally:
        router.stop()
        assert serve.stop() == 0, serve.logs()


def test_every_panel_names_only_metrics_serve_or_the_router_exports(scraped: set[str]) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert len(expressions(dashboard)) >= 30
    assert missing(dashboard, scraped) == []


def test_a_panel_naming_a_metric_that_does_not_exist_is_found(scraped: set[str]) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    panel = next(p for p in dashboard["panels"] if p["type"] != "row")
    typo = "vllm:time_to_first_tokens_seconds_bucket"  # tokens: no such metric
    panel["targets"][0]["expr"] = f'sum by (le) (rate({typo}{{model_name="x"}}[5m]))'
    panel["targets"].append({"expr": "kvconnect_router_decisions / 2"})  # counters are _total
    assert missing(dashboard, scraped) == [
        "kvconnect_router_decisions", "vllm:time_to_first_tokens_seconds_bucket"
    ]  # fmt: skip


def test_metric_names_are_found_in_promql_as_prometheus_reads_it() -> None:
    expr = (
        'histogram_quantile(0.9, sum by (le, instance) (rate(a:b_bucket{x="y{", z=~"1e3"}'
        "[$__rate_interval]))) / on (instance) group_left (tier) c_total offset 5m "
        "or sum without (le) (d) > bool 1e3 and rate(e[5m:1m])"
    )
    assert metric_names(expr) == {"a:b_bucket", "c_total", "d", "e"}

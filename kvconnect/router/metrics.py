"""The router's state as Prometheus metrics (`GET /metrics`), read at scrape time.

Labels are bounded: `instance` (and `source`) by the instances the router was given,
`outcome` by the code, `tier` by the tiers the router weighs (the defaults and
`--tier-weights`): a tier only an event stream names (any medium string a publisher sends)
is counted under `tier="other"`, so a stream cannot add series without bound.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvconnect.router.core import Router

PREFIX = "kvconnect_router_"
OTHER_TIER = "other"
"""The `tier` label of the tiers the router has no weight for."""


def _one(kind: type[Any], name: str, doc: str, value: float) -> Metric:
    m: Metric = kind(PREFIX + name, doc)
    m.add_metric([], value)  # type: ignore[attr-defined]
    return m


def _labelled(
    kind: type[Any], name: str, doc: str, label: str, values: Mapping[str, float]
) -> Metric:
    m: Metric = kind(PREFIX + name, doc, labels=[label])
    for key, value in sorted(values.items()):
        m.add_metric([key], value)  # type: ignore[attr-defined]
    return m


def _by_known_tier(values: Mapping[str, float], known: Collection[str]) -> dict[str, float]:
    """`values` per tier, the tiers not in `known` summed under `OTHER_TIER`."""
    out: dict[str, float] = {}
    for tier, value in values.items():
        label = tier if tier in known else OTHER_TIER
        out[label] = out.get(label, 0) + value
    return out


class RouterMetrics(Collector):
    """Index, stream, decision and health metrics of one `Router`."""

    def __init__(self, router: Router, pd: Mapping[str, int] | None = None) -> None:
        """`pd`: P/D's outcomes (`pd.PrefillStep.outcomes`), counted where they happen."""
        self.router = router
        self.pd = pd if pd is not None else {}
        self.registry = CollectorRegistry()
        self.registry.register(self)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def collect(self) -> Iterator[Metric]:
        yield from self._index_metrics()
        yield from self._instance_metrics()
        yield from self._cost_metrics()

    def _cost_metrics(self) -> Iterator[Metric]:
        """The costs learned from answers (costs.py): the scorer's inputs, as they stand."""
        r = self.router
        own, pulls = r.costs.snapshot()
        G = GaugeMetricFamily
        for name, doc, attr in (
            ("prefill_seconds_per_token", "Fitted prefill time per computed prompt token.",
             "prefill_s_per_token"),
            ("decode_seconds_per_token", "Fitted time per generated token.",
             "decode_s_per_token"),
            ("fixed_seconds", "Fitted time of a request beyond its tokens.", "fixed_s"),
            ("queue_seconds_per_request", "Fitted time each request in flight adds.",
             "queue_s_per_request"),
        ):  # fmt: skip
            values = {n: v for n, c in own.items() if (v := getattr(c, attr)) is not None}
            yield _labelled(G, name, doc, "instance", values)
        pair = ["source", "instance"]
        per_token = G(PREFIX + "pull_seconds_per_token", "Fitted pull time per token.", labels=pair)
        fixed = G(PREFIX + "pull_fixed_seconds", "Fitted time of a pull beyond its tokens.",
                  labels=pair)  # fmt: skip
        crossover = G(
            PREFIX + "pull_crossover_tokens",
            "Pulled tokens below which the instance computes faster than it pulls.",
            labels=pair,
        )
        for (source, dest), cost in sorted(pulls.items()):
            per_token.add_metric([source, dest], cost.s_per_token)
            fixed.add_metric([source, dest], cost.fixed_s)
            cross = r.costs.crossover(source, dest)
            if cross is not None:
                crossover.add_metric([source, dest], cross)
        sent = CounterMetricFamily(
            PREFIX + "pulls",
            "Requests sent to pull their prefix from another instance (remote_kv_source, or "
            "P/D's decode step).",
            labels=pair,
        )
        for (source, dest), n in sorted(r.counts.pulls_sent.items()):
            sent.add_metric([source, dest], n)
        yield from (per_token, fixed, crossover, sent)

    def _index_metrics(self) -> Iterator[Metric]:
        r = self.router
        with r.lock:
            stats = r.index.stats
            num_entries = r.index.num_entries
            stale = sum(i.stale for i in r.index.instances.values())
        sub = r.follow.subscriber
        C, G = CounterMetricFamily, GaugeMetricFamily
        yield _one(G, "index_entries", "Block keys in the index.", num_entries)
        for name, doc, value in (
            ("events_applied", "KV events applied.", stats.events_applied),
            ("batches_applied", "KV event batches applied.", stats.batches_applied),
            ("instance_clears", "Times an instance's entries were dropped.", stats.clears),
            ("publisher_restarts", "Publisher restarts seen.", stats.restarts),
            ("event_gaps_lost", "Event gaps replay could not repair.", stats.gaps_lost),
            ("snapshots", "Instance snapshots applied (at first contact, after a loss).",
             stats.snapshots),
            ("index_evictions", "Entries evicted by the index's cap.", stats.entries_evicted),
            ("hash_mismatches", "Events contradicting their own token ids.", stats.hash_mismatches),
            ("gaps_repaired", "Sequence gaps filled from replay.",
             sub.num_gaps_repaired if sub else 0),
            ("batches_lost", "Batches replay no longer held.", sub.num_batches_lost if sub else 0),
            ("decisions_unsynced", "Decisions made while an instance in rotation was not synced "
             "(its stream's state had not come within the wait after the router's start).",
             r.follow.decisions_unsynced),
        ):  # fmt: skip
            yield _one(C, name, doc, value)
        yield _one(G, "synced_instances", "Instances whose stream state is in the index.",
                   len(r.follow.synced))  # fmt: skip
        yield _one(G, "stale_instances", "Instances awaiting a resync.", stale)

    def _instance_metrics(self) -> Iterator[Metric]:
        r = self.router
        with r.lock:
            known = set(r.index.tier_weights)
            removed = _by_known_tier(r.index.stats.removed, known)
            stale = _by_known_tier(r.index.stats.stale, known)
            schemes = r.index.schemes()
        hits = _by_known_tier(dict(r.counts.hit_blocks), known)
        names = [i.name for i in r.instances]
        C, G = CounterMetricFamily, GaugeMetricFamily
        for kind, name, doc, label, values in (
            (C, "decisions", "Requests sent to each instance.", "instance",
             {n: r.counts.decisions[n] for n in names}),
            (C, "forward_failures", "Forwards refused by each instance.", "instance",
             {n: r.counts.failures[n] for n in names}),
            (G, "in_flight", "Requests in flight per instance.", "instance",
             {n: r.loads.in_flight[n] for n in names}),
            (G, "pending_prefill_tokens", "Prompt tokens each instance is expected to "
             "compute for the requests in flight there.", "instance",
             {n: r.loads.pending[n] for n in names}),
            (G, "instance_up", "1 while an instance is in rotation.", "instance",
             {n: float(r.health.is_up(n)) for n in names}),
            (C, "hit_blocks", "Cached prefix blocks of routed requests, by tier.", "tier",
             hits),
            (C, "pd", "P/D requests by outcome (disaggregated, local: the decode instance "
             "lacked less than the pair's crossover, or --pd-min-tail until it is measured; "
             "prefill_failed, no_prefill_instance).", "outcome",
             dict(self.pd)),
            (C, "prefill_waits", "Requests that waited for another request's prefill of a "
             "prefix they share, by how the wait ended (held, ended, timeout).", "outcome",
             dict(r.bursts.waited)),
            (C, "index_removed", "Index entries taken back by BlockRemoved events, by tier.",
             "tier", removed),
            (C, "index_stale", "Index entries found stale by a load miss (an instance computed "
             "fewer cached tokens than the index credited it), by tier.", "tier", stale),
        ):  # fmt: skip
            yield _labelled(kind, name, doc, label, values)
        info = GaugeMetricFamily(
            PREFIX + "instance_hash_scheme",
            "The hash scheme learned from each instance's stream (1 per instance).",
            labels=["instance", "scheme", "block_size"],
        )
        for name, (scheme, block_size) in sorted(schemes.items()):
            info.add_metric([name, scheme, str(block_size or 0)], 1)
        yield info

"""The router's state: its instances, the block index their event streams feed, the choice.

    Router(instances, index, tokenizer)   nothing runs yet
    router.start()                        the streams followed into the index (following.py)
    router.scored(tokens, salt)           what each instance holds of a prompt, under `lock`
    router.pick(scored, exclude)          the instance to send a request to (to decode it, in
                                          P/D), and the one to pull its prefix from, if
                                          pulling wins; None when none is in rotation
    router.pick_prefill(scored)           P/D: the prefill instance for it
    router.record / mark_down / learn     what was sent where, an instance failing, an
                                          answer measured
    router.check_cached(...)              an answer's own cached-token count against the index
    router.close()                        stops the stream thread

Its rooms: `instances` (instances.py), `follow` (the stream thread, whether the index is
synced: following.py), `loads` (in flight and pending, replicas' too: loads.py), `bursts`
(a burst sharing a new prefix waits for its first prefill: bursts.py), `costs` (costs.py),
`health` (health.py), `counts` (what routing did, for metrics). Each room counts its own.
The HTTP front (`server.py`) and the relay (`forward.py`) use this state; it starts no server
and never imports torch.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from dataclasses import dataclass, field
from functools import partial
from typing import NamedTuple

import msgspec

from kvconnect.api.protocol import ApiError, ChatCompletionRequest, CompletionRequest
from kvconnect.model.tokenizer import ChatTemplateError, Tokenizer
from kvconnect.router.bursts import Bursts
from kvconnect.router.changes import Changes
from kvconnect.router.costs import CostModel
from kvconnect.router.following import Follower
from kvconnect.router.health import HealthChecker
from kvconnect.router.index import BlockIndex, PrefixScore
from kvconnect.router.instances import Instance, Instances
from kvconnect.router.loads import Loads
from kvconnect.router.replicas import Measured
from kvconnect.router.scorer import DEFAULT_LOAD_WEIGHT, Inputs, choose, spread_key
from kvconnect.stream.curve import CurveClientKeys

logger = logging.getLogger(__name__)


class _Details(msgspec.Struct):
    cached_tokens: int | None = 0


class Usage(msgspec.Struct):
    """An answer's usage, as far as the router reads it."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    prompt_tokens_details: _Details | None = None


class _Answer(msgspec.Struct):
    usage: Usage | None = None


_USAGE = msgspec.json.Decoder(_Answer)
"""An answer's usage alone (the rest of the body is skipped in C)."""


def usage_of(body: bytes) -> Usage | None:
    """A whole JSON answer's usage with its cached-token count; None if it has none (an
    instance without --enable-prompt-tokens-details) or is not JSON."""
    try:
        usage = _USAGE.decode(body).usage
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    return usage if usage is not None and usage.prompt_tokens_details is not None else None


StaleCheck = tuple[list[int], str | None]
"""(prompt token ids, cache salt): what to check an answer's cached tokens against."""


class Picked(NamedTuple):
    """Where a request goes, what the index credits it with there, and the instance to
    pull its prefix from (None: none; the instance computes what it lacks)."""

    instance: Instance
    score: PrefixScore
    source: Instance | None = None
    computed: int = 0
    """The prompt tokens the instance is expected to compute."""


class Scored(NamedTuple):
    """A prompt scored against the index once, for every choice made for it."""

    token_ids: list[int]
    cache_salt: str | None
    scores: dict[str, PrefixScore]
    """Per instance name, what it holds of the prompt's prefix."""
    num_blocks: dict[str, int]
    """Per instance name, the blocks the index holds of it."""


@dataclass
class Counts:
    """What routing did, per instance (read by metrics.py)."""

    decisions: Counter[str] = field(default_factory=Counter)
    hit_blocks: Counter[str] = field(default_factory=Counter)
    """Cached prefix blocks of routed requests, per tier."""
    failures: Counter[str] = field(default_factory=Counter)
    pulls_sent: Counter[tuple[str, str]] = field(default_factory=Counter)
    """Requests sent with `remote_kv_source`, per (source, instance)."""


class Router:
    def __init__(
        self,
        instances: list[Instance],
        index: BlockIndex,
        tokenizer: Tokenizer,
        load_weight: float = DEFAULT_LOAD_WEIGHT,
        curve: CurveClientKeys | None = None,
        prefill_instances: list[Instance] | None = None,
        pulls: bool = True,
    ) -> None:
        """`prefill_instances`: P/D (router/pd.py): these only prefill, for `instances`,
        which decode. Every instance's events feed the index and every one is health
        checked. `pulls`: a request may be sent with `remote_kv_source` naming an instance
        with a peer tier (`Instance.peer`) that holds more of its prefix (scorer.py).
        `curve`: keys for event streams with CURVE on (stream/curve.py)."""
        self.instances = Instances(instances, prefill_instances or ())
        self.index = index
        self.tokenizer = tokenizer
        self.load_weight = load_weight
        self.pulls = pulls
        self.lock = threading.Lock()
        """The index's: the stream thread applies batches under it, the choice scores."""
        names = self.instances.names
        for name in names:
            index.add_instance(name)
        self.health = HealthChecker(names)
        self.costs = CostModel()
        self.loads = Loads(names)
        self.counts = Counts()
        changes = Changes()
        self.follow = Follower(self.instances, index, self.lock, self.health, changes, curve)
        waits = pulls and len(self.instances) >= 2  # else routing is exactly as without
        self.bursts = Bursts(self.scores, index.block_size, changes, waits)

    def start(self) -> Router:
        """Follow every instance's event stream on a thread of its own; returns self."""
        self.follow.start()
        return self

    def close(self) -> None:
        self.follow.close()

    def scores(self, token_ids: list[int], cache_salt: str | None = None) -> dict[str, PrefixScore]:
        """Per instance name, what it holds of the request's prefix."""
        with self.lock:
            return self.index.score(token_ids, cache_salt)

    def scored(self, token_ids: list[int], cache_salt: str | None = None) -> Scored:
        """The prompt scored once, with the index's sizes of the same state."""
        with self.lock:
            scores = self.index.score(token_ids, cache_salt)
            num_blocks = self.index.num_blocks()
        return Scored(token_ids, cache_salt, scores, num_blocks)

    def pick(
        self, scored: Scored, exclude: set[str], costs_out: dict[str, float] | None = None
    ) -> Picked | None:
        """The instance in rotation (and not in `exclude`) to send the request to (to decode
        it, in P/D), and the one to pull its prefix from, if pulling wins."""
        up = self.health.is_up
        prefill = self.instances.prefill_names
        names = [
            i.name
            for i in self.instances
            if i.name not in exclude and i.name not in prefill and up(i.name)
        ]
        sources = [i.name for i in self.instances if self.pulls and i.peer and up(i.name)]
        return self._choose(names, scored, sources, costs_out)

    def pick_prefill(self, scored: Scored) -> Picked | None:
        """P/D: the prefill instance in rotation for the request, by prefix and load."""
        names = [n for n in self.instances.prefill_names if self.health.is_up(n)]
        return self._choose(sorted(names), scored)

    def _choose(
        self,
        names: list[str],
        scored: Scored,
        sources: list[str] | None = None,
        costs_out: dict[str, float] | None = None,
    ) -> Picked | None:
        if not names:
            return None
        in_flight, pending = self.loads.of(names)
        token_ids = scored.token_ids
        pulling = bool(sources)
        inputs = Inputs(
            scored.scores,
            in_flight,
            len(token_ids),
            load_weight=self.load_weight,
            spread_key=spread_key(token_ids),
            num_blocks=scored.num_blocks,
            sources=sources or (),
            pull_tokens=self.costs.pull_tokens if pulling else None,
            load_tokens=partial(self.costs.load_tokens, default_weight=self.load_weight)
            if pulling
            else None,
            pending=pending,
            time_scale=self.costs.time_scale(names) if pulling else None,
        )
        d = choose(names, inputs, costs_out)
        source = self.instances.by_name(d.source) if d.source else None
        return Picked(self.instances.by_name(d.instance), d.score, source, d.computed)

    def mark_down(self, name: str, reason: str) -> None:
        self.health.mark(name, False, reason)
        self.counts.failures[name] += 1

    def record(self, name: str, score: PrefixScore, source: str | None = None) -> None:
        """A request went to `name` with `score` of its prefix cached there (and `source`
        named to pull more of it from)."""
        self.counts.decisions[name] += 1
        if source is not None:
            self.counts.pulls_sent[source, name] += 1
        for tier, n in score.blocks_per_tier.items():
            self.counts.hit_blocks[tier] += n

    def learn(
        self,
        name: str,
        score: PrefixScore,
        source: str | None,
        elapsed_s: float,
        usage: Usage,
        queued: int = 0,
        ahead: int = 0,
    ) -> None:
        """A whole answer from `name` with `usage` (`usage_of`; sent with `source` to pull
        from, while `queued` other requests were in flight there, with `ahead` prompt tokens
        to compute: `Loads.pending`), `elapsed_s` after the request left: one measurement of
        its costs (costs.py), the tokens ahead of it counted with its own."""
        assert usage.prompt_tokens_details is not None
        cached = usage.prompt_tokens_details.cached_tokens or 0
        computed = max(0, usage.prompt_tokens - cached)
        pulled = max(0, cached - score.num_tokens) if source else 0
        m = Measured(
            self.loads.version + 1,
            name,
            elapsed_s,
            computed + ahead,
            usage.completion_tokens,
            source,
            pulled,
            queued,
        )
        self.take_measured(m)
        self.loads.measured_here(m)  # for the replicas: under the version it makes

    def take_measured(self, m: Measured) -> None:
        """An answer measured here or at a replica (replicas.py): into the cost model."""
        self.costs.observe(
            m.instance, m.elapsed_s, m.computed, m.completion, m.source, m.pulled, m.queued
        )

    def prompt_tokens(self, req: CompletionRequest | ChatCompletionRequest) -> list[int]:
        """The tokens the engines will see first: a chat rendered with the chat template, or
        the first prompt (a multi-prompt request goes where its first prompt is cached)."""
        if isinstance(req, ChatCompletionRequest):
            try:
                text = self.tokenizer.apply_chat_template(
                    req.conversation(), req.add_generation_prompt, req.tool_dicts()
                )
            except ChatTemplateError as e:
                raise ApiError(str(e), "messages") from None
            return self.tokenizer.encode(text)
        first = req.prompts()[0]
        return first if isinstance(first, list) else self.tokenizer.encode(first)

    def check_cached(self, name: str, score: PrefixScore, check: StaleCheck, usage: Usage) -> None:
        """The instance's own count of cached prompt tokens (`usage_of` its answer) against
        what the index credited it: fewer means the index holds entries the instance no
        longer has (`BlockIndex.mark_stale`)."""
        assert usage.prompt_tokens_details is not None
        cached = usage.prompt_tokens_details.cached_tokens or 0
        if cached < score.num_tokens:
            with self.lock:
                dropped = self.index.mark_stale(name, check[0], cached, check[1])
            if dropped:
                logger.info(
                    "router: %s computed %d cached prompt tokens where the index said %d; "
                    "dropped %d stale entries",
                    name,
                    cached,
                    score.num_tokens,
                    dropped,
                )


def stale_check(
    req: CompletionRequest | ChatCompletionRequest, token_ids: list[int]
) -> StaleCheck | None:
    """A request whose usage speaks of one prompt (chat, or a single completion prompt) and
    whose engine reads its cache: one that asks for the prompt's logprobs computes all of it,
    so its count says nothing of what the instance holds (a request's options never change
    the index). `req`'s prompt was validated already (`Router.prompt_tokens`): its shape is
    enough."""
    if req.wants_prompt_logprobs():
        return None
    if isinstance(req, CompletionRequest):
        p = req.prompt
        if not (isinstance(p, str) or len(p) == 1 or not isinstance(p[0], str | list)):
            return None
    return token_ids, req.cache_salt

"""The messages of one step between the scheduler and the workers."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvconnect.connector.base import KVConnectorMetadata


@dataclass
class ScheduledRequest:
    """What the workers compute for one request this step."""

    request_id: str
    token_ids: list[int]
    """The tokens computed this step."""
    start_position: int
    """Position of the first of them (the request's computed tokens so far)."""
    block_ids: list[int]
    """The request's whole block table."""
    sample: bool
    """The step reaches the request's last token: sample the next one."""
    temperature: float
    seed: int
    num_output_tokens: int


@dataclass
class NewRequestData:
    """A request entering the running set, as connectors see it."""

    request_id: str
    all_token_ids: list[int]
    block_hashes: list[bytes]
    block_ids: list[int]
    num_computed_tokens: int


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    finished_req_ids: set[str] = field(default_factory=set)
    """Requests that finished since the previous step (workers pass them to get_finished)."""
    preempted_req_ids: set[str] = field(default_factory=set)
    kv_connector_metadata: KVConnectorMetadata | None = None
    stuck_req_id: str | None = None
    """A waiting request that does not fit even though nothing else holds blocks."""

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

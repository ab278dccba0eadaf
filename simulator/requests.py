"""What the simulated gateway is given: its modelled delays (``Delays``, fitted against the real
stack: see ``simulator.gateway``) and one request of a workload (``SimRequest``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from loadtests.client import RequestResult


@dataclass(slots=True)
class Delays:
    hop_s: float = 0.0002
    overhead_s: float = 0.0025
    ingest_s_per_token: float = 2.5e-6
    scrape_s: float = 0.2
    kv_event_s: float = 0.001
    train_lag_s: float = 0.5
    slo_poll_s: float = 0.02


@dataclass(slots=True)
class SimRequest:
    """One request of the workload: its prompt's token ids and block hashes, its output."""

    index: int
    t: float
    prompt_ids: Sequence[int]
    hashes: Sequence[int]
    output_tokens: int
    answer: Sequence[int] = ()
    on_done: Any = None  # called with the result (sessions send their next turn)
    # prompt tokens the gateway has not counted before (a conversation's new messages; its
    # earlier ones are in the gateway's token cache): -1 means all of them
    fresh_tokens: int = -1
    flow: str = ""  # its tenant (flow control), and its band ("": the gateway's default)
    band: str = ""
    weight: float = 1.0
    routed_at: float | None = None  # when the gateway routed it (after any flow-control wait)
    engine_request: Any = None  # backend.request.Request the engine ran (the decode side)
    result: RequestResult = field(init=False)

    def __post_init__(self) -> None:
        self.result = RequestResult(sent_at=self.t, prompt_tokens=len(self.prompt_ids))

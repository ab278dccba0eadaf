"""One request's spend record: who asked, what was served, what it cost, how it ended."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class SpendRecord:
    at: float  # epoch seconds, when the request ended
    request_id: str
    tenant: str
    key: str  # the API key's name in the policy (never the key)
    model: str  # the model that served it (a fallback's, after failover)
    priority: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    dollars: float
    outcome: str  # the HTTP status, or client_gone / broken
    endpoint: str | None = None
    session: str | None = None  # x-fairness-id, when the request named one
    tier: str = "payg"  # reserved, payg or flex: what its tokens were priced at
    route: str | None = None  # the policy route it came by

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

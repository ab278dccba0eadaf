"""One request's context, as the pipeline (``gateway.pipeline``) carries it from step to
step and hands it to the attempt, migration and settlement code."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from backend.protocol import GenerationRequest, Kind
from gateway.config.policy import Route
from gateway.state import GatewayState, PolicyView


@dataclass(slots=True)
class RequestContext:
    state: GatewayState
    view: PolicyView
    kind: Kind
    tenant: str
    route: Route
    body: dict[str, Any]
    parsed: GenerationRequest
    request_id: str
    received_at: float
    raw: bytes
    slo: tuple[float | None, float | None] = (None, None)
    priority: str = "standard"
    text_ids: dict[str, list[int]] = field(default_factory=dict)  # model -> prompt ids

"""``settings.flow_control``: how requests wait in the gateway when a pool is saturated
(``gateway.flow``): the order (``mode``), the queue's bounds, the saturation thresholds and
the token weights of fair share. Tenants' shares are their ``weight``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gateway.config import schema
from gateway.config.decode import Decoder

FLOW_MODES = ("fcfs", "priority", "round_robin", "fair")


@dataclass(frozen=True, slots=True)
class FlowControl:
    mode: str = "fcfs"  # fcfs: no gateway queue, the engines' own order (as before)
    max_queued: int = 1024  # per model; beyond it the worst waiting request is shed
    max_wait_ms: float = 30_000.0  # a request waiting longer is answered 429
    flex_max_wait_ms: float = 300_000.0  # flex may wait minutes
    queue_depth: int = 5  # requests sent to an endpoint and not started: beyond, saturated
    kv_threshold: float = 0.8  # an endpoint's KV usage at or above it: saturated
    tpot_threshold_ms: float | None = None  # an endpoint's decode step this slow: saturated
    # while a tenant served less than another has requests running, the other's requests are
    # let through only while the decode step is below this (the light tenant's batch stays
    # small); None: off
    isolation_step_ms: float | None = None
    input_weight: float = 1.0  # fair share counts w_in·prompt + w_out·output tokens
    output_weight: float = 2.0
    engine_priority: bool = False  # send engines a ``priority`` (``engine_priority_of``)

    def max_wait_s(self, band: str) -> float:
        """The longest a request of ``band`` may wait for its turn."""
        return (self.flex_max_wait_ms if band == "flex" else self.max_wait_ms) / 1000.0

    def deadline(self, arrived: float, slo_ttft_ms: float | None) -> float:
        """The deadline its flow orders it by: its TTFT SLO after arrival (without one, the
        longest wait)."""
        return arrived + (slo_ttft_ms or self.max_wait_ms) / 1000.0

    @property
    def queues(self) -> bool:
        """Does the gateway hold requests at all (every mode but ``fcfs``)?"""
        return self.mode != "fcfs"


def parse_flow_control(d: Decoder, raw: Any, path: str) -> FlowControl:
    m = d.mapping(raw, path, schema.keys("flow_control"))
    kw: dict[str, Any] = {}
    if "mode" in m:
        kw["mode"] = d.choice(m["mode"], f"{path}.mode", set(FLOW_MODES))
    kw.update(d.fields(m, path, ("max_queued", "queue_depth"), d.integer))
    kw.update(d.fields(m, path, ("max_wait_ms", "flex_max_wait_ms", "input_weight",
                                 "output_weight", "tpot_threshold_ms", "isolation_step_ms"),
                        d.number))
    if "engine_priority" in m:
        kw["engine_priority"] = d.boolean(m["engine_priority"], f"{path}.engine_priority")
    if "kv_threshold" in m:
        v = d.number(m["kv_threshold"], f"{path}.kv_threshold")
        if v > 1.0:
            raise d.fail(f"{path}.kv_threshold", "expected a fraction, 0 to 1")
        kw["kv_threshold"] = v
    return FlowControl(**kw)

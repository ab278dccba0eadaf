"""Fault injection for reliability tests of whatever sits in front of the backend.

All faults are off by default and can be set at start (CLI flags) or at run time
(``POST /admin/faults``). Decisions come from a seeded RNG so a test run is reproducible.
Fault times are wall-clock seconds: they are not multiplied by ``--time-scale``, because they
stand for failures of the serving system, not for work of the modelled GPU.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

ERROR_STATUSES = (429, 500, 502, 503)


@dataclass(slots=True)
class FaultConfig:
    error_rate: float = 0.0  # share of generation requests answered with ``error_status``
    error_status: int = 503
    stall_s: float = 0.0  # hold a request this long before it enters the engine
    stall_rate: float = 1.0  # share of requests stalled when stall_s > 0
    drop_rate: float = 0.0  # share of streams whose connection is cut mid-stream
    drop_after_tokens: int = 4  # tokens sent before a dropped stream is cut
    slow_step_s: float = 0.0  # added to every engine step (a degraded GPU)

    def validate(self) -> None:
        for name in ("error_rate", "stall_rate", "drop_rate"):
            v = getattr(self, name)
            if not 0.0 <= v <= 1.0:
                raise ValueError(f"{name} must be within [0, 1], got {v}")
        if self.error_status not in ERROR_STATUSES:
            raise ValueError(f"error_status must be one of {ERROR_STATUSES}")
        if self.stall_s < 0 or self.slow_step_s < 0 or self.drop_after_tokens < 0:
            raise ValueError("fault durations and counts must be non-negative")

    def updated(self, changes: Mapping[str, Any]) -> FaultConfig:
        known = {f.name: f for f in fields(self)}
        values = asdict(self)
        for key, value in changes.items():
            if key not in known:
                raise ValueError(f"unknown fault setting {key!r}")
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ValueError(f"{key} must be a number")
            values[key] = int(value) if known[key].type == "int" else float(value)
        new = FaultConfig(**values)
        new.validate()
        return new


class Faults:
    def __init__(self, config: FaultConfig, seed: int = 0) -> None:
        config.validate()
        self.config = config
        self._rng = random.Random(seed ^ 0x5EED)

    def error_status(self) -> int | None:
        c = self.config
        if c.error_rate > 0 and self._rng.random() < c.error_rate:
            return c.error_status
        return None

    def stall_s(self) -> float:
        c = self.config
        if c.stall_s > 0 and self._rng.random() < c.stall_rate:
            return c.stall_s
        return 0.0

    def drop_after(self) -> int | None:
        c = self.config
        if c.drop_rate > 0 and self._rng.random() < c.drop_rate:
            return c.drop_after_tokens
        return None

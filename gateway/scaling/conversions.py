"""The convertible-decoder controller (TokenScale): when to switch one decode endpoint of a
disaggregated pool to prefill, and when to switch one back, with hysteresis. Pure decisions
on the predicted prefill backlog; ``gateway.scaling.autoscaler`` acts on them.

A converted decoder takes the role ``both``: it keeps decoding (its own streams and new ones)
and also prefills, for other decoders and for the requests it decodes itself whenever that
is sooner than the prefill queue (``gateway.routing.router``). So even a pool's only decoder
can absorb a burst while new prefill capacity cold-starts."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from gateway.config.scaling import Scaling
from gateway.scaling.launcher import Instance


def starting_prefill_eta_ms(instances: Iterable[Instance], cold_start_s: float | None,
                            now: float) -> float:
    """In how many ms the first instance now starting that can prefill should be ready (the
    last measured cold start after its launch); infinite when none is starting or no cold start
    has been measured yet."""
    cold_ms = (cold_start_s if cold_start_s is not None else math.inf) * 1e3
    return min((cold_ms - (now - i.started_at) * 1e3 for i in instances
                if i.ready_at is None and i.role != "decode"), default=math.inf)


@dataclass(slots=True)
class Conversions:
    """The convertible-decoder controller's state (pure decisions: ``decide``)."""

    converted: list[str] = field(default_factory=list)  # decode endpoints now also prefilling
    calm_since: float | None = None  # since when the backlog has stayed low
    done: int = 0  # role switches made, both ways

    def decide(self, backlog_ms: float, now: float, s: Scaling, *, decoders: int,
               warm_soon: bool) -> str | None:
        """``"convert"`` (one more decoder to prefill), ``"revert"`` (one back) or None.

        Convert when the backlog would break the TTFT SLO, new capacity will not be ready in
        time (``warm_soon`` False) and a pure decoder is left (``decoders``); revert one at a
        time once the backlog stayed under the low mark for ``revert_after_s``."""
        if backlog_ms > s.convert_backlog_ratio * s.ttft_slo_ms:
            self.calm_since = None
            if not warm_soon and decoders > 0:
                return "convert"
            return None
        if not self.converted:
            self.calm_since = None
            return None
        if backlog_ms < s.revert_backlog_ratio * s.ttft_slo_ms:
            if self.calm_since is None:
                self.calm_since = now
            elif now - self.calm_since >= s.revert_after_s:
                self.calm_since = now  # the next one waits a full period again
                return "revert"
        else:
            self.calm_since = None
        return None

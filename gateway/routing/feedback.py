"""What a served request teaches routing: the TTFT and TPOT it saw, credited to the endpoints
it was routed on and fed to the predictor against the rows it was predicted from. A function
of the decision and the request's times alone, so ``serve``, the EPP and the simulator learn
the same way."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import numpy.typing as npt

from gateway.routing.plugins import Candidate
from gateway.routing.router import Decision

# TPOT is learned and scored only over streams of at least this many tokens: over one or two
# gaps it is a single step's time, decided by whether a prefill chunk shared that step, which
# no feature of the endpoint can tell in advance.
TPOT_MIN_TOKENS = 8


class Learner(Protocol):
    def observe(self, row: npt.NDArray[np.float64], *, ttft_ms: float | None,
                tpot_ms: float | None, predicted_ttft_ms: float | None = None,
                predicted_tpot_ms: float | None = None, sent_at: float | None = None
                ) -> None: ...


@dataclass(frozen=True, slots=True)
class Seen:
    """What one request saw: its TTFT (from ``origin``, credited to ``lead``: the prefill
    endpoint when the prompt was prefilled elsewhere) and its TPOT (credited to the decode
    endpoint; None over fewer than ``TPOT_MIN_TOKENS`` tokens)."""

    lead: Candidate
    decode: Candidate
    ttft_ms: float
    tpot_ms: float | None


def seen(d: Decision, prefill_used: bool, origin: float, first_at: float,
         last_at: float | None, chunks: int) -> Seen:
    ttft_ms = (first_at - origin) * 1000.0
    tpot_ms = ((last_at - first_at) * 1000.0 / (chunks - 1)
               if last_at is not None and chunks >= TPOT_MIN_TOKENS else None)
    lead = d.prefill if (d.prefill is not None and prefill_used) else d.endpoint
    return Seen(lead, d.endpoint, ttft_ms, tpot_ms)


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


def learn(s: Seen, predictor: Learner, sent_at: float | None = None
          ) -> list[tuple[str, npt.NDArray[np.float64], float]]:
    """Credit ``s`` to the endpoints' live estimates and the predictor; the samples it
    learned (target, row, log latency), for replicas that share them."""
    s.lead.ep.live.observed(s.ttft_ms, None)
    s.decode.ep.live.observed(None, s.tpot_ms)
    out = []
    if s.lead.row is not None:
        predictor.observe(s.lead.row, ttft_ms=s.ttft_ms, tpot_ms=None,
                          predicted_ttft_ms=_finite(s.lead.ttft_ms), sent_at=sent_at)
        out.append(("ttft", s.lead.row, math.log(max(s.ttft_ms, 1e-3))))
    if s.decode.row is not None and s.tpot_ms is not None:
        predictor.observe(s.decode.row, ttft_ms=None, tpot_ms=s.tpot_ms,
                          predicted_tpot_ms=_finite(s.decode.tpot_ms), sent_at=sent_at)
        out.append(("tpot", s.decode.row, math.log(max(s.tpot_ms, 1e-3))))
    return out

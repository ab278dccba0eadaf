"""Benchmark metrics exactly as vLLM's ``bench serve`` defines them.

* TTFT: first content chunk − send.
* TPOT per request: (E2E − TTFT) / (output tokens − 1), for requests with more than one token.
* ITL: every gap between consecutive content chunks, pooled over all requests.
* E2E: last content chunk − send.
* Goodput: completed requests meeting every given SLO, per second of the run.
Failed requests count in ``failed`` and ``errors`` and in no latency statistic.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from loadtests.client import RequestResult


@dataclass(frozen=True, slots=True)
class SLO:
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None


def tpot(r: RequestResult) -> float | None:
    if r.ttft is None or r.latency is None or r.output_tokens < 2:
        return None
    return (r.latency - r.ttft) / (r.output_tokens - 1)


def stats_ms(values: Sequence[float]) -> dict[str, float | None]:
    """Mean and percentiles in milliseconds (None when there is nothing to summarise)."""
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None, "max": None}
    a = np.asarray(values, dtype=float) * 1e3
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    return {"mean": float(a.mean()), "p50": float(p50), "p90": float(p90), "p99": float(p99),
            "max": float(a.max())}


def meets(r: RequestResult, slo: SLO) -> bool:
    if not r.ok or r.ttft is None or r.latency is None:
        return False
    t = tpot(r)
    if slo.ttft_ms is not None and r.ttft * 1e3 > slo.ttft_ms:
        return False
    if slo.tpot_ms is not None and t is not None and t * 1e3 > slo.tpot_ms:
        return False
    return not (slo.e2e_ms is not None and r.latency * 1e3 > slo.e2e_ms)


def summarize(results: Sequence[RequestResult], duration_s: float,
              slo: SLO | None = None) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    slo = slo or SLO()
    good = sum(1 for r in ok if meets(r, slo))
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    return {
        "requests": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration_s,
        "request_throughput": len(ok) / duration_s if duration_s > 0 else 0.0,
        "output_throughput": out_tokens / duration_s if duration_s > 0 else 0.0,
        "input_throughput": in_tokens / duration_s if duration_s > 0 else 0.0,
        "total_output_tokens": out_tokens,
        "total_input_tokens": in_tokens,
        "ttft_ms": stats_ms([r.ttft for r in ok if r.ttft is not None]),
        "tpot_ms": stats_ms([t for r in ok if (t := tpot(r)) is not None]),
        "itl_ms": stats_ms([x for r in ok for x in r.itls]),
        "e2e_ms": stats_ms([r.latency for r in ok if r.latency is not None]),
        "goodput_rps": good / duration_s if duration_s > 0 else 0.0,
        "goodput_fraction": good / len(results) if results else 0.0,
        "errors": dict(Counter(r.error for r in results if r.error)),
    }

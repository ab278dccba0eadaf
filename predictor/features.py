"""The predictor's one feature list, and building a decision's feature matrix.

Every row describes (request, endpoint) at decision time. Features, in column order:

==========================  ====================================================================
``prompt_tokens``           prompt length of the request
``uncached_tokens``         prompt tokens the endpoint is expected to compute (prefix index)
``expected_output``         ``max_tokens`` (or the model's default): how long it will decode
``kv_usage``                endpoint KV-cache usage in [0, 1] (scraped ``vllm:kv_cache_usage_perc``)
``running``                 requests in the endpoint's batch (scraped ``num_requests_running``)
``waiting``                 requests queued at the endpoint (scraped ``num_requests_waiting``)
``in_flight``               requests this gateway has in flight to the endpoint (live)
``prefill_tokens``          uncached prompt tokens sent there and not yet answered (live)
``decoding``                this gateway's sequences decoding there (first token seen) (live)
``oldest_pending_ms``       how long the oldest request awaiting its first token there has
                            waited (live): how far the prefill queue's head has progressed
``prefill_queue_ms``        the endpoint's virtual prefill queue (live): uncached tokens
                            awaiting a first token, less the head's likely progress, over
                            the prefill rate observed there
``queue_estimate_ms``       ``prefill_queue_ms`` plus ``load_ms`` plus this request's uncached
                            tokens at the endpoint's observed prefill rate: the virtual
                            queue's answer for this request's first token (one column the
                            trees can cut, instead of a sum they would have to learn)
``prefill_arrivals``        uncached tokens/s recently sent there (live, decayed over 5 s):
                            prefill work that will share a decoding request's steps
``step_ms``                 the endpoint's current time between tokens per decoding sequence
                            (live: sequence-seconds over tokens relayed, 0.2 s windows,
                            smoothed): its decode step as the gateway sees it now
``recent_ttft_ms``          moving averages of the TTFT and TPOT of the streams the
``recent_tpot_ms``          endpoint recently finished (live; 0 before the first)
``role``                    0 aggregated, 1 prefill, 2 decode
``hw_bandwidth_tbs``        accelerator HBM bandwidth, TB/s (hardware class; 0 when unknown)
``hw_tflops``               accelerator dense BF16 peak, TFLOP/s (0 when unknown)
``prior_ttft_ms``           the roofline prior (``predictor.prior``) for this endpoint, 0 when
``prior_tpot_ms``           its hardware is unknown: the models learn log(actual / prior)
``load_ms``                 the modelled time to load the prompt's prefix held in lower KV
                            tiers there (host memory over PCIe, the shared pool over the KV
                            link; ``gateway.routing.tiers``), 0 when none
==========================  ====================================================================

Live counters are exact and fresh at each decision; scraped ones are up to one scrape period
old. Both are given: the model learns how much to trust each.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

FEATURES: tuple[str, ...] = (
    "prompt_tokens", "uncached_tokens", "expected_output", "kv_usage", "running", "waiting",
    "in_flight", "prefill_tokens", "decoding", "oldest_pending_ms", "prefill_queue_ms",
    "queue_estimate_ms", "prefill_arrivals", "step_ms", "recent_ttft_ms", "recent_tpot_ms",
    "role", "hw_bandwidth_tbs", "hw_tflops", "prior_ttft_ms", "prior_tpot_ms", "load_ms",
)
# tokens/ms (gateway.routing.endpoints' default: an 8B model on an H100)
DEFAULT_PREFILL_RATE = 30.0
ROLE_CODE = {"both": 0.0, "prefill": 1.0, "decode": 2.0}
F = {name: i for i, name in enumerate(FEATURES)}


@dataclass(slots=True)
class EndpointSnapshot:
    """What the router knows about one endpoint when it decides."""

    kv_usage: float = 0.0
    running: float = 0.0
    waiting: float = 0.0
    in_flight: float = 0.0
    prefill_tokens: float = 0.0
    decoding: float = 0.0
    oldest_pending_ms: float = 0.0
    prefill_queue_ms: float = 0.0
    prefill_rate: float = 0.0  # tokens/ms observed there (0: unknown, DEFAULT_PREFILL_RATE)
    prefill_arrivals: float = 0.0
    step_ms: float = 0.0
    recent_ttft_ms: float = 0.0
    recent_tpot_ms: float = 0.0
    role: str = "both"
    hw_bandwidth_tbs: float = 0.0
    hw_tflops: float = 0.0
    # the request's prefix held in lower KV tiers there: the modelled time to load it (host
    # memory over PCIe, the shared pool over the KV link), in ms
    load_ms: float = 0.0


def build_matrix(prompt_tokens: int, expected_output: int,
                 uncached: list[int] | npt.NDArray[np.int64],
                 endpoints: list[EndpointSnapshot],
                 priors: list[tuple[float, float]] | None = None) -> npt.NDArray[np.float64]:
    """One row per candidate endpoint, columns in ``FEATURES`` order (the only place that
    knows the order: the router builds its rows here)."""
    pri = priors or [(0.0, 0.0)] * len(endpoints)
    return np.array([(prompt_tokens, u, expected_output, e.kv_usage, e.running, e.waiting,
                      e.in_flight, e.prefill_tokens, e.decoding, e.oldest_pending_ms,
                      e.prefill_queue_ms,
                      e.prefill_queue_ms + e.load_ms
                      + u / (e.prefill_rate or DEFAULT_PREFILL_RATE),
                      e.prefill_arrivals, e.step_ms, e.recent_ttft_ms,
                      e.recent_tpot_ms, ROLE_CODE.get(e.role, 0.0), e.hw_bandwidth_tbs,
                      e.hw_tflops, pt, pp, e.load_ms)
                     for u, e, (pt, pp) in zip(uncached, endpoints, pri, strict=True)],
                    dtype=np.float64).reshape(len(endpoints), len(FEATURES))

"""Scheduling plugins: filters, scorers and pickers, registered by name; strategies are named
profiles of them, and a policy may configure its own per pool.

A decision runs ``filters`` (each narrows the candidates, and never to nothing: a filter that
would reject everyone is skipped, so the request still goes to the least-bad endpoint), then
every ``scorer`` (each returns one score per candidate in [0, 1], higher is better), sums them
with their weights, and lets the ``picker`` choose. Scorers that need predictions or prefix
matches read them from the candidates, which the router fills in once per decision.

Strategies:

=================  ===========================================================================
``round_robin``    every endpoint in turn
``least_request``  fewest requests in flight from this gateway
``prefix``         prefix affinity with load: cached share ×3, in-flight ×2, free KV ×1, under
                   the bounded-load guard (the SGLang / llm-d style heuristic)
``predicted``      lowest predicted TTFT among endpoints predicted to hold the TPOT SLO
                   (default)
=================  ===========================================================================

and, as baselines, faithful re-implementations of the peers' published policies:
``sglang_cache_aware`` (sglang-router), ``llm_d`` (llm-d's default scorer profile) and
``dynamo_kv`` (NVIDIA Dynamo's KV router cost).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from gateway.routing.endpoints import EndpointState

Scores = npt.NDArray[np.float64]


@dataclass(slots=True)
class Candidate:
    ep: EndpointState
    cached_tokens: int = 0
    uncached_tokens: int = 0
    ttft_ms: float = math.nan
    tpot_ms: float = math.nan
    tpot_p90_ms: float = math.nan  # the calibrated 90th percentile the TPOT SLO is held to
    row: npt.NDArray[np.float64] | None = None  # predictor features
    matched_blocks: int = 0  # leading prompt blocks the index says it holds
    index_blocks: int = 0  # blocks the prefix index holds for this endpoint (its "tree size")
    host_tokens: int = 0  # of cached_tokens, those to load from host memory there
    pool_tokens: int = 0  # and those to fetch from the shared KV pool
    load_ms: float = 0.0  # the modelled time of those loads


@dataclass(slots=True)
class RequestInfo:
    prompt_tokens: int
    expected_output: int
    hashes: Sequence[int] = ()
    block_size: int = 16
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    priority: str = "standard"


@dataclass(slots=True)
class PluginConfig:
    load_factor: float = 1.5
    state: dict[str, int] = field(default_factory=dict)  # pickers' memory (round robin)


Filter = Callable[[RequestInfo, list[Candidate], PluginConfig], list[Candidate]]
Scorer = Callable[[RequestInfo, list[Candidate]], Scores]
Picker = Callable[[list[Candidate], Scores, random.Random, PluginConfig], Candidate]


# -- filters ----------------------------------------------------------------------------------

def bounded_load(req: RequestInfo, cands: list[Candidate], cfg: PluginConfig
                 ) -> list[Candidate]:
    """Consistent hashing with bounded loads (Mirrokni et al.): no endpoint may take a request
    that puts it above ``load_factor`` × the mean in-flight (plus this request)."""
    total = sum(c.ep.live.in_flight for c in cands) + 1
    cap = math.ceil(cfg.load_factor * total / len(cands))
    return [c for c in cands if c.ep.live.in_flight + 1 <= cap]


def tpot_slo(req: RequestInfo, cands: list[Candidate], cfg: PluginConfig) -> list[Candidate]:
    """Endpoints whose calibrated TPOT p90 (the point estimate when there is none) is
    within the request's TPOT SLO."""
    if req.slo_tpot_ms is None:
        return cands
    return [c for c in cands
            if not (c.tpot_p90_ms if not math.isnan(c.tpot_p90_ms) else c.tpot_ms)
            > req.slo_tpot_ms]


def ttft_slo(req: RequestInfo, cands: list[Candidate], cfg: PluginConfig) -> list[Candidate]:
    """Endpoints predicted to answer within the request's TTFT SLO."""
    if req.slo_ttft_ms is None:
        return cands
    return [c for c in cands if not c.ttft_ms > req.slo_ttft_ms]


FILTERS: dict[str, Filter] = {"bounded_load": bounded_load, "tpot_slo": tpot_slo,
                              "ttft_slo": ttft_slo}


# -- scorers ----------------------------------------------------------------------------------

def _lower_is_better(x: Scores) -> Scores:
    lo, hi = float(x.min()), float(x.max())
    if hi - lo <= 1e-12:
        return np.ones_like(x)
    out: Scores = (hi - x) / (hi - lo)
    return out


def least_request(req: RequestInfo, cands: list[Candidate]) -> Scores:
    return _lower_is_better(np.array([c.ep.live.in_flight for c in cands], dtype=np.float64))


def least_tokens(req: RequestInfo, cands: list[Candidate]) -> Scores:
    return _lower_is_better(np.array([c.ep.live.tokens_outstanding for c in cands],
                                     dtype=np.float64))


def queue(req: RequestInfo, cands: list[Candidate]) -> Scores:
    """Shortest engine queue (scraped ``num_requests_waiting``)."""
    return _lower_is_better(np.array([c.ep.engine.waiting for c in cands], dtype=np.float64))


def kv_free(req: RequestInfo, cands: list[Candidate]) -> Scores:
    usage = np.array([c.ep.engine.kv_usage for c in cands], dtype=np.float64)
    return np.clip(1.0 - usage, 0.0, 1.0)


def prefix(req: RequestInfo, cands: list[Candidate]) -> Scores:
    """Share of the prompt the endpoint already caches."""
    if req.prompt_tokens <= 0:
        return np.zeros(len(cands))
    return np.array([c.cached_tokens / req.prompt_tokens for c in cands], dtype=np.float64)


def predicted_ttft(req: RequestInfo, cands: list[Candidate]) -> Scores:
    t = np.array([c.ttft_ms for c in cands], dtype=np.float64)
    out: Scores = np.maximum(t.min(), 1e-3) / np.maximum(t, 1e-3)
    return out


def predicted_tpot(req: RequestInfo, cands: list[Candidate]) -> Scores:
    t = np.array([c.tpot_ms for c in cands], dtype=np.float64)
    out: Scores = np.maximum(t.min(), 1e-3) / np.maximum(t, 1e-3)
    return out


def dynamo_cost(req: RequestInfo, cands: list[Candidate]) -> Scores:
    """NVIDIA Dynamo's KV router cost (docs: "Router Guide", cost function), lower is better:
    ``overlap weight (1) × prefill blocks + decode blocks``, where prefill blocks are the
    prompt blocks the worker must compute (this request's uncached ones plus the prefill it
    already has queued) and decode blocks the KV blocks active on it, this request's included.
    With Dynamo's default temperature 0 the lowest cost wins, as it does under ``max_score``."""
    bs = max(req.block_size, 1)
    cost = []
    for c in cands:
        e = c.ep
        active = e.engine.kv_usage * e.engine.num_gpu_blocks if e.engine.num_gpu_blocks \
            else e.live.tokens_outstanding / bs
        cost.append((e.live.prefill_tokens + c.uncached_tokens) / bs
                    + active + req.prompt_tokens / bs)
    return _lower_is_better(np.array(cost, dtype=np.float64))


SCORERS: dict[str, Scorer] = {
    "least_request": least_request, "least_tokens": least_tokens, "queue": queue,
    "kv_free": kv_free, "prefix": prefix, "predicted_ttft": predicted_ttft,
    "predicted_tpot": predicted_tpot, "dynamo_cost": dynamo_cost}
NEEDS_PREDICTION = frozenset({"predicted_ttft", "predicted_tpot", "tpot_slo", "ttft_slo"})
NEEDS_PREFIX = frozenset({"prefix"}) | NEEDS_PREDICTION


# -- pickers ----------------------------------------------------------------------------------

def max_score(cands: list[Candidate], scores: Scores, rng: random.Random, cfg: PluginConfig
              ) -> Candidate:
    """The best score; ties broken at random (seeded)."""
    best = float(scores.max())
    tied = [c for c, s in zip(cands, scores, strict=True) if s >= best - 1e-9]
    return tied[0] if len(tied) == 1 else rng.choice(tied)


def round_robin(cands: list[Candidate], scores: Scores, rng: random.Random, cfg: PluginConfig
                ) -> Candidate:
    """The next endpoint after the last one picked (by URL order, skipping the excluded)."""
    last = cfg.state.get("rr", -1)
    cfg.state["rr"] = last + 1
    return sorted(cands, key=lambda c: c.ep.url)[(last + 1) % len(cands)]


def weighted_random(cands: list[Candidate], scores: Scores, rng: random.Random,
                    cfg: PluginConfig) -> Candidate:
    w = np.maximum(scores, 0.0)
    if float(w.sum()) <= 0:
        return rng.choice(cands)
    return rng.choices(cands, weights=list(w))[0]


# sglang-router 0.3.2's defaults for ``cache_aware`` (``sglang_router/router_args.py``)
SGLANG_CACHE_THRESHOLD = 0.3
SGLANG_BALANCE_ABS = 64
SGLANG_BALANCE_REL = 1.5


def sglang_cache_aware(cands: list[Candidate], scores: Scores, rng: random.Random,
                       cfg: PluginConfig) -> Candidate:
    """sglang-router's ``cache_aware`` policy: when the load is imbalanced (in-flight
    requests: max − min > ``balance_abs_threshold`` and max > min × ``balance_rel_threshold``)
    the least loaded worker; otherwise the worker with the longest prefix match if its match
    rate exceeds ``cache_threshold``, else the worker whose approximate tree is smallest
    (most room). Its tree is the prefix index of what was routed; ties go at random."""
    loads = [c.ep.live.in_flight for c in cands]
    hi, lo = max(loads), min(loads)
    if hi - lo > SGLANG_BALANCE_ABS and hi > lo * SGLANG_BALANCE_REL:
        return rng.choice([c for c, n in zip(cands, loads, strict=True) if n == lo])
    rates = [c.cached_tokens / max(c.cached_tokens + c.uncached_tokens, 1) for c in cands]
    best = max(rates)
    if best > SGLANG_CACHE_THRESHOLD:
        return rng.choice([c for c, r in zip(cands, rates, strict=True) if r == best])
    small = min(c.index_blocks for c in cands)
    return rng.choice([c for c in cands if c.index_blocks == small])


PICKERS: dict[str, Picker] = {"max_score": max_score, "round_robin": round_robin,
                              "weighted_random": weighted_random,
                              "sglang_cache_aware": sglang_cache_aware}


@dataclass(frozen=True, slots=True)
class Profile:
    filters: tuple[str, ...]
    scorers: Mapping[str, float]
    picker: str

    @property
    def needs_prediction(self) -> bool:
        return bool(NEEDS_PREDICTION & (set(self.filters) | set(self.scorers)))

    @property
    def needs_prefix(self) -> bool:
        return bool(NEEDS_PREFIX & (set(self.filters) | set(self.scorers)))


STRATEGIES: dict[str, Profile] = {
    "round_robin": Profile((), {}, "round_robin"),
    "least_request": Profile((), {"least_request": 1.0}, "max_score"),
    "prefix": Profile(("bounded_load",), {"prefix": 3.0, "least_request": 2.0, "kv_free": 1.0},
                      "max_score"),
    "predicted": Profile(("tpot_slo",), {"predicted_ttft": 1.0}, "max_score"),
    # The peers' published policies, as baselines (see each plugin):
    "sglang_cache_aware": Profile((), {"prefix": 1.0}, "sglang_cache_aware"),
    # llm-d's default profile (its epplib chart): queue ×2, KV utilization ×2, prefix ×3
    "llm_d": Profile((), {"queue": 2.0, "kv_free": 2.0, "prefix": 3.0}, "max_score"),
    "dynamo_kv": Profile((), {"dynamo_cost": 1.0}, "max_score"),
}


def run(profile: Profile, req: RequestInfo, cands: list[Candidate], rng: random.Random,
        cfg: PluginConfig) -> tuple[Candidate, Scores]:
    if len(cands) == 1 and profile.picker != "round_robin":
        return cands[0], np.ones(1)
    for name in profile.filters:
        kept = FILTERS[name](req, cands, cfg)
        if kept:
            cands = kept
    total = np.zeros(len(cands))
    for name, weight in profile.scorers.items():
        if weight:
            total += weight * SCORERS[name](req, cands)
    return PICKERS[profile.picker](cands, total, rng, cfg), total

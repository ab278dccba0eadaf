"""How many instances a many-model workload needs (``tokengate plan --pooling``): the fewest
whose SLO attainment reaches a target, searched with the fleet simulator
(``simulator.multimodel``), for fleets whose instances do both phases or, split, for fleets of
prefill and decode instances (the split searched at each size)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from roofline.timing import TimingModel
from simulator.longtail import ModelRequest
from simulator.multimodel import FleetConfig, run_fleet


def prefill_fraction(requests: Sequence[ModelRequest], cfg: FleetConfig) -> float:
    """The share of the fleet's GPU time that prefill takes, from the roofline alone: each
    prompt prefilled on its own; each model's output tokens in decode steps of the batch its
    requests keep running on average (Little's law: its arrival rate × output tokens × a
    token every half TPOT SLO, at least one), at the mean context. A first guess at the
    prefill instances' share of a disaggregated fleet: a many-model pool decodes in small
    per-model batches, each step reading a model's weights whole."""
    if not requests:
        return 0.5
    tm = TimingModel(cfg.profile, cfg.hardware, jitter=0.0)
    span = max(max(r.t for r in requests) - min(r.t for r in requests), 1.0)
    ctx = max(1, int(sum(r.prompt_tokens + r.output_tokens / 2 for r in requests)
                     / len(requests)))
    out: dict[str, int] = {}
    for r in requests:
        out[r.model] = out.get(r.model, 0) + r.output_tokens
    dec = 0.0
    for tokens in out.values():
        batch = max(1, round(tokens / span * cfg.tpot_slo_s / 2))
        dec += tokens * tm.decode_step_seconds(batch, ctx) / batch
    pre = sum(tm.prefill_seconds(r.prompt_tokens, cfg.max_num_batched_tokens)
              for r in requests)
    return pre / max(pre + dec, 1e-12)


def fewest_gpus(requests: Sequence[ModelRequest], base: FleetConfig, target: float,
                max_instances: int, log: Any = None, split: bool = False
                ) -> tuple[int | None, list[dict[str, Any]]]:
    """The fewest instances whose SLO attainment reaches ``target``, with every trial.

    Attainment is taken as non-decreasing in instances. The search gallops up from the fewest
    instances that can host every model (doubling until one suffices), then bisects: a trial
    that falls short stops early and is cheap, one with many instances is not, so the largest
    size tried is at most twice the answer rather than ``max_instances``.

    ``split``: disaggregated fleets (``FleetConfig.prefill_instances``). At each size the
    first split gives prefill instances the prefill's share of the work
    (``prefill_fraction``); a split that falls short moves one instance toward the side
    where more requests missed their SLO (``ttft_misses_in_prefill`` for the prefill side,
    the other late first tokens and the slow paces for the decode side), until one meets
    the target or the direction turns."""
    trials: list[dict[str, Any]] = []
    cache: dict[int, float] = {}
    models = len({r.model for r in requests})
    per = 1 if base.mode == "dedicated" else base.per_instance
    group = max(1, math.ceil(models / per))  # instances that can host every model
    share = prefill_fraction(requests, base) if split else 0.0

    def trial(n: int, prefill: int) -> dict[str, Any]:
        cfg = FleetConfig(**{**{f: getattr(base, f) for f in base.__dataclass_fields__},
                             "instances": n, "prefill_instances": prefill})
        res = run_fleet(requests, cfg, int((1.0 - target) * len(requests)))
        row = res.summary(base.ttft_slo_s, base.tpot_slo_s)
        row["gpus"] = res.gpus
        trials.append(row)
        if log is not None:
            log(row)
        return row

    def best_split(n: int) -> float:
        p = min(max(round(n * share), group), n - group)
        tried: dict[int, float] = {}
        step = 0
        while p not in tried and group <= p <= n - group:
            row = trial(n, p)
            tried[p] = row["attainment"]
            if row["attainment"] >= target:
                break
            pre = row["ttft_misses_in_prefill"]
            d = 1 if pre >= row["ttft_misses"] - pre + row["tpot_misses"] else -1
            if step and d != step:
                break  # the direction turned: the best split is behind
            step = d
            p += d
        return max(tried.values())

    def attain(n: int) -> float:
        if n not in cache:
            cache[n] = best_split(n) if split else trial(n, 0)["attainment"]
        return cache[n]

    lo = 2 * group if split else group
    hi = max(lo, max_instances)
    if attain(lo) >= target:
        return lo, trials  # the fewest that can host every model already suffice
    while True:
        step = min(hi, 2 * lo)
        if attain(step) >= target:
            lo, hi = lo + 1, step
            break
        if step == hi:
            return None, trials
        lo = step + 1
    while lo < hi:
        mid = (lo + hi) // 2
        if attain(mid) >= target:
            hi = mid
        else:
            lo = mid + 1
    return hi, trials


def best_per_size(trials: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The trial with the highest attainment at each size (a split fleet tries several
    splits a size), by size."""
    best: dict[int, dict[str, Any]] = {}
    for t in trials:
        if t["instances"] not in best or t["attainment"] > best[t["instances"]]["attainment"]:
            best[t["instances"]] = t
    return [best[n] for n in sorted(best)]

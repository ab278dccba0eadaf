"""Admission and settlement of a request's quota on every scope it touches.

Admission reserves, in one store call, one request and ``prompt + expected output`` tokens (and
their estimated dollars) on the tenant, tenant×model, model and route scopes that have limits.
If the model's buckets refuse, the model's fallback chain is tried in order (each candidate's own
quotas, with its own tokenizer's count), unless the route disables failover.

Settlement brings every bucket to what the request really used, exactly once: the unused output
is refunded, an overrun charged, a failure before the first token refunds everything, and a
cancelled stream is charged what was streamed. Long streams are charged progressively so that
concurrent long generations cannot overshoot a limit by more than one step each.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime

from gateway.config.policy import Limits, Model, Policy, Route
from gateway.quota import calendar
from gateway.quota.limiter.bucket import Limit, spend_cap
from gateway.quota.limiter.store import (
    SETTLE_MARGIN_S,
    BucketState,
    Charge,
    Decision,
    RateStore,
    Reservation,
    Settlement,
    StoreUnavailable,
)
from protocol.errors import APIError


def charges(policy: Policy, tenant: str, route: Route, model: Model, prompt_tokens: int,
            expected_output: int, session: str | None = None) -> list[Charge]:
    t = policy.tenants[tenant]
    scopes: list[tuple[str, Limits]] = [
        (f"tenant:{tenant}", t.limits),
        (f"tenant:{tenant}|model:{model.name}", t.model_limits.get(model.name, Limits())),
        (f"model:{model.name}", model.limits),
        (f"route:{route.name}", route.limits),
    ]
    tokens = float(prompt_tokens + expected_output)
    dollars = model.price.cost(prompt_tokens, expected_output)
    costs = {"requests": 1.0, "tokens": tokens, "tokens_day": tokens, "budget": dollars,
             "budget_daily": dollars, "budget_monthly": dollars}
    now = time.time()
    out = [c for scope, limits in scopes
           for c in _scope_charges(scope, limits, costs, now, policy.settings.time_zone)]
    cap = policy.settings.sentry.session_budget
    if cap and session is not None:  # the sentry's hard cap: exact, as every budget
        out.append(Charge(f"session:{session}", spend_cap(
            "session_budget", cap, now + policy.settings.sentry.session_ttl_s), dollars))
    return out


def every_bucket(policy: Policy) -> list[Charge]:
    """Every bucket the policy sets (calendar budgets in their current window), at no cost:
    what ``/admin/limiter`` reports."""
    scopes: list[tuple[str, Limits]] = []
    for t in policy.tenants.values():
        scopes.append((f"tenant:{t.name}", t.limits))
        scopes += [(f"tenant:{t.name}|model:{m}", lim) for m, lim in t.model_limits.items()]
    scopes += [(f"model:{m.name}", m.limits) for m in policy.models.values()]
    scopes += [(f"route:{r.name}", r.limits) for r in policy.routes.values()]
    now = time.time()
    return [c for scope, limits in scopes
            for c in _scope_charges(scope, limits, {}, now, policy.settings.time_zone)]


def _scope_charges(scope: str, limits: Limits, costs: Mapping[str, float], now: float,
                   tz: str) -> list[Charge]:
    """One scope's buckets, calendar budgets in the window ``now`` falls in, each charged
    ``costs[kind]`` (0 when absent)."""
    out = [Charge(scope, lim, costs.get(lim.kind, 0.0)) for lim in limits.buckets()]
    for kind, amount in limits.calendar():
        suffix, cal = calendar.limit(kind, amount, now, tz)
        out.append(Charge(scope + suffix, cal, costs.get(kind, 0.0)))
    return out


@dataclass(slots=True)
class Admission:
    model: Model
    prompt_tokens: int
    expected_output: int
    decision: Decision
    failover_from: str | None = None
    settlement: Settlement | None = None
    refused: list[Decision] = field(default_factory=list)
    settling: bool = False  # settlement was handed to the response's ``finish``

    @property
    def open(self) -> bool:
        """Admitted, and neither settled nor handed to a settlement."""
        st = self.settlement
        return st is not None and not st.final and not self.settling


class Unfit(APIError):
    """The request cannot run on this model (a fallback may still take it)."""


class ImagesRefused(Unfit):
    def __init__(self, message: str, param: str | None, code: str) -> None:
        super().__init__(400, message, param=param, code=code)


class ContextTooLong(Unfit):
    """The prompt, with the output asked for, does not fit the model's context (OpenAI's
    wording and code)."""

    def __init__(self, limit: int, prompt: int, asked: int | None, kind: str, *,
                 at_least: bool = False) -> None:
        where = "messages" if kind == "chat" else "prompt"
        least = "at least " if at_least else ""  # a bound known before tokenizing
        if asked is None:
            text = (f"This model's maximum context length is {limit} tokens. However, your "
                    f"{where} resulted in {least}{prompt} tokens. Please reduce the length of "
                    f"the {where}.")
        else:
            text = (f"This model's maximum context length is {limit} tokens. However, you "
                    f"requested {least}{prompt + asked} tokens ({least}{prompt} in the {where}, "
                    f"{asked} in the completion). Please reduce the length of the {where} or "
                    "completion.")
        super().__init__(400, text, param=where, code="context_length_exceeded")



async def admit(store: RateStore, policy: Policy, tenant: str, route: Route, model: Model,
                count_prompt: Callable[[Model], Awaitable[int]],
                expected_output: Callable[[Model], int],
                session: str | None = None,
                floor_prompt: Callable[[Model], int] | None = None,
                optional: Callable[[Model, int], Sequence[Charge]] | None = None) -> Admission:
    """Reserve on the model or, when its quota refuses, on the first fallback that admits.
    ``floor_prompt``: a lower bound on the prompt's tokens, known without tokenizing it: a
    model whose context or whose limits could never take that many is passed over before the
    prompt is counted (``never_fits``). ``optional``: a candidate's optional charges for a
    request of that many tokens (``tier_charges``), taken in the same call when they fit."""
    chain: list[Model] = [model]
    if route.failover:
        chain += [policy.models[n] for n in model.fallback if n in route.models]
    refused: list[Decision] = []
    last: Admission | None = None
    for candidate in chain:
        try:
            if floor_prompt is not None:
                lo = floor_prompt(candidate)
                early = never_fits(charges(policy, tenant, route, candidate, lo, 0, session))
                if early is not None:
                    refused.append(early)
                    last = last or Admission(candidate, lo, 0, early,
                                             model.name if candidate is not model else None,
                                             refused=refused)
                    continue
            prompt = await count_prompt(candidate)
        except Unfit:
            if candidate is model:
                raise
            continue  # a fallback with a shorter context (or no images) cannot take it
        out = expected_output(candidate)
        cs = charges(policy, tenant, route, candidate, prompt, out, session)
        extra = optional(candidate, prompt + out) if optional is not None else ()
        rid = uuid.uuid4().hex
        # No limits on any scope: nothing to reserve, no store round trip.
        life = reservation_life_s(route)
        d = (await store.reserve(cs, rid, life_s=life, optional=extra) if cs or extra else
             Decision(True, Reservation(rid, (), life)))
        adm = Admission(candidate, prompt, out, d,
                        model.name if candidate is not model else None, refused=refused)
        if d.allowed:
            assert d.reservation is not None
            adm.settlement = Settlement(d.reservation)
            return adm
        refused.append(d)
        last = last or adm
        if d.denied is not None and math.isinf(d.denied.retry_after_s) and candidate is model:
            continue  # too large for this model's burst: a fallback may still fit
    assert last is not None
    return last


def never_fits(cs: list[Charge]) -> Decision | None:
    """The refusal of a request that costs more than a bucket can ever hold (the store's own
    verdict on it, ``retry_after`` infinite), or None."""
    for c in cs:
        if c.cost > c.limit.burst:
            state = BucketState(c.scope, c.limit, c.limit.burst, 0.0, c.cost, math.inf)
            return Decision(False, None, (), state)
    return None


def tier_charges(policy: Policy, tenant: str, model: Model, priority: str, tokens: int,
                 endpoints: int) -> list[Charge]:
    """The optional charge that makes a request ``reserved``: ``tokens`` on the tenant's
    reserved throughput on ``model`` (a bucket in the rate store, so exact across replicas;
    a share of the pool is sized on the ``endpoints`` healthy now), taken in the quota's own
    reservation when it has room and settled with it (``RateStore.reserve``'s ``optional``).
    None for ``flex`` (its band) or without a reservation."""
    if priority == "flex":
        return []
    tpm = policy.tenants[tenant].reserved_tpm(model, endpoints)
    if not tpm:
        return []
    return [Charge(f"reserved:{tenant}|model:{model.name}", Limit("tokens", tpm, 60.0, tpm),
                   float(tokens))]


def tier_of(priority: str, d: Decision) -> str:
    """The request's capacity tier: ``flex`` (its band), ``reserved`` when its reservation
    took the tier charge (the tenant's reserved throughput covered its tokens), else
    ``payg``. The tier orders and prices a request, it never refuses one."""
    return "flex" if priority == "flex" else "reserved" if d.optional else "payg"


def reservation_life_s(route: Route) -> float:
    """The longest a request admitted on ``route`` can take to be settled: held while a pool
    wakes, queued for its SLO, then its whole timeout, plus a margin for the settlement
    itself. Its idempotency markers live this long (``limiter.store.Reservation``)."""
    return (route.hold_timeout_ms + route.queue_ms) / 1000.0 + route.timeouts.total_s + \
        SETTLE_MARGIN_S


def _duration(seconds: float) -> str:
    """OpenAI's reset format: ``20ms``, ``1s``, ``6m0s``, ``1h2m3s``."""
    if seconds < 1:
        return f"{max(0, round(seconds * 1000))}ms"
    s = math.ceil(seconds)
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    if h:
        return f"{h}h{m}m{sec}s"
    if m:
        return f"{m}m{sec}s"
    return f"{sec}s"


def ratelimit_headers(states: Sequence[BucketState]) -> dict[str, str]:
    """``x-ratelimit-*`` for the tightest requests and tokens buckets among ``states``."""
    out: dict[str, str] = {}
    for kind, suffix in (("requests", "requests"), ("tokens", "tokens")):
        mine = [s for s in states if s.limit.kind == kind]
        if not mine:
            continue
        tight = min(mine, key=lambda s: s.remaining / s.limit.burst)
        out[f"x-ratelimit-limit-{suffix}"] = str(int(tight.limit.amount))
        out[f"x-ratelimit-remaining-{suffix}"] = str(int(tight.remaining))
        out[f"x-ratelimit-reset-{suffix}"] = _duration(tight.reset_s)
    return out


_KIND_LABEL = {"requests": "requests per min (RPM)", "tokens": "tokens per min (TPM)",
               "tokens_day": "tokens per day (TPD)", "budget": "dollars per day (budget)",
               "budget_daily": "dollars per calendar day (budget_daily)",
               "budget_monthly": "dollars per calendar month (budget_monthly)",
               "session_budget": "dollars per session (sentry.session_budget)"}
_DOLLARS = ("budget", "budget_daily", "budget_monthly")


def rate_limit_error(d: Decision) -> APIError:
    s = d.denied
    assert s is not None
    kind = s.limit.kind
    retry = s.retry_after_s
    if kind == "session_budget":
        return APIError(429, f"Runaway session stopped: {s.scope} has spent "
                        f"${s.used:.4g} of its ${s.limit.amount:g} cap and this request "
                        f"needs ${s.requested:.4g}. Start a new session if the work must go "
                        "on.", type="runaway", code="session_budget_exceeded",
                        headers={"retry-after": str(max(1, math.ceil(
                            (s.limit.expires_at or 0.0) - time.time())))})
    if s.limit.expires_at is not None:  # a calendar budget: spent until its window ends
        retry = max(0.0, s.limit.expires_at - time.time())
        ends = datetime.fromtimestamp(s.limit.expires_at, UTC).isoformat()
        msg = (f"Budget exhausted for {_KIND_LABEL[kind]} on {s.scope}: limit "
               f"${s.limit.amount:g}, used ${s.used:.4g}, requested ${s.requested:.4g}. It "
               f"resets at {ends} (in {_duration(retry)}).")
    elif math.isinf(retry):
        msg = (f"Request too large for {_KIND_LABEL[kind]} on {s.scope}: limit "
               f"{s.limit.amount:g}, requested {s.requested:g}.")
        retry = s.limit.period_s
    else:
        msg = (f"Rate limit reached for {_KIND_LABEL[kind]} on {s.scope}: limit "
               f"{s.limit.amount:g}, used {s.used:g}, requested {s.requested:g}. Please try "
               f"again in {_duration(retry)}.")
    headers = {"retry-after": str(max(1, math.ceil(retry))),
               "retry-after-ms": str(max(1, math.ceil(retry * 1000))),
               **ratelimit_headers(d.states)}
    if kind in _DOLLARS:  # a dollar allowance spent: say so, not "tokens"
        return APIError(429, msg, type="dollars", code="budget_exceeded", headers=headers)
    return APIError(429, msg, type="requests" if kind == "requests" else "tokens",
                    code="rate_limit_exceeded", headers=headers)


async def settle(store: RateStore, adm: Admission, *, output_tokens: int | None,
                 prompt_tokens: int | None, failed_before_first_token: bool,
                 tier: str = "payg") -> None:
    """Bring the reservation to actual use, once (the ``final`` step), after any progressive
    charge still in flight (so its deltas are counted exactly once). Budgets are charged the
    dollars the request costs in its ``tier`` (what its spend record says it cost)."""
    st = adm.settlement
    if st is None or st.final:
        return
    st.final = True
    if st.in_flight:
        await asyncio.gather(*st.in_flight, return_exceptions=True)
    if failed_before_first_token:
        totals = {"requests": 0.0, "tokens": 0.0, "tokens_day": 0.0, "budget": 0.0,
                  "budget_daily": 0.0, "budget_monthly": 0.0, "session_budget": 0.0}
    else:
        p = prompt_tokens if prompt_tokens is not None else adm.prompt_tokens
        o = output_tokens or 0
        tokens = float(p + o)
        dollars = adm.model.price.cost_at(tier, p, o)
        totals = {"tokens": tokens, "tokens_day": tokens, "budget": dollars,
                  "budget_daily": dollars, "budget_monthly": dollars,
                  "session_budget": dollars}
    deltas = st.deltas_to(totals)
    if deltas:
        await store.adjust(st.reservation, deltas, "final")
        st.record(deltas)


async def refund(store: RateStore, adm: Admission) -> None:
    """Nothing was served: give the whole reservation back (the request included), leaving
    the buckets where a refused request would have."""
    await settle(store, adm, output_tokens=0, prompt_tokens=None,
                 failed_before_first_token=True)


async def charge_progress(store: RateStore, adm: Admission, streamed: int) -> None:
    """Charge a long stream's tokens beyond what was reserved, as they are generated. The
    store call runs as a task of its own that records what it applied when it ends, so a
    stream cancelled meanwhile (the client left) neither loses nor double-counts it."""
    st = adm.settlement
    if st is None or st.final:
        return
    tokens = float(adm.prompt_tokens + streamed)
    deltas = {k: d for k, d in st.deltas_to({"tokens": tokens, "tokens_day": tokens}).items()
              if d > 0}
    if not deltas:
        return
    st.steps += 1
    task = asyncio.ensure_future(store.adjust(st.reservation, deltas, f"p{st.steps}"))
    st.in_flight.add(task)

    def done(t: asyncio.Future[bool]) -> None:
        st.in_flight.discard(t)
        if not t.cancelled() and t.exception() is None:
            st.record(deltas)

    task.add_done_callback(done)
    with contextlib.suppress(StoreUnavailable):
        await asyncio.shield(task)

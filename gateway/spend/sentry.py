"""The cost sentry: stops an agent session that runs away before its bill does.

A session is a flow named by ``x-fairness-id`` (``tenant/ID``). Three checks, as
``settings.sentry`` sets them:

* **hard cap** (``session_budget``): dollars one session may spend. Enforced exactly, across
  replicas, by the rate store like any budget (a bucket per session that does not refill,
  kept ``session_ttl_s`` after the session's last request; ``gateway.quota.ledger``), so it is
  not here;
* **repeats** (``repeat_limit``): the same request body sent ``repeat_limit`` times within
  ``repeat_window_s`` by one session — an agent stuck in a loop — is refused until the window
  has passed;
* **velocity** (``velocity_factor``): a session spending, over the last ``velocity_window_s``,
  more than ``velocity_factor`` times the tenant's usual rate per session (its spend over the
  last hour, per session active in it) is throttled for a window.

Repeats and velocity are judged by each replica on what it served (a session's requests
usually reach one replica; with N replicas a loop is caught within N times the limit). Each
action is a 429 in OpenAI's shape (``type: runaway``), a count in
``tokengate_sentry_actions_total`` and a warning on the logger ``tokengate.sentry``.
"""

from __future__ import annotations

import hashlib
import logging
import math
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

import orjson

from gateway.config.sentry import SentryConfig
from gateway.metrics import GatewayMetrics
from protocol.errors import APIError

log = logging.getLogger("tokengate.sentry")
BASELINE_S = 3600.0


SWEEP_EVERY = 1024  # checks between sweeps of idle sessions


@dataclass(slots=True)
class _Session:
    bodies: deque[tuple[float, bytes]] = field(default_factory=deque)
    spend: deque[tuple[float, float]] = field(default_factory=deque)
    last: float = 0.0  # its latest request


@dataclass(slots=True)
class _Tenant:
    """Its sessions' spend over the last hour, with running sums (read on every check)."""

    spend: deque[tuple[float, float, str]] = field(default_factory=deque)  # (t, $, session)
    total: float = 0.0
    sessions: Counter[str] = field(default_factory=Counter)  # entries per session

    def add(self, now: float, dollars: float, session: str) -> None:
        self.spend.append((now, dollars, session))
        self.total += dollars
        self.sessions[session] += 1
        while self.spend and self.spend[0][0] < now - BASELINE_S:
            _, d, s = self.spend.popleft()
            self.total -= d
            self.sessions[s] -= 1
            if not self.sessions[s]:
                del self.sessions[s]


class Sentry:
    def __init__(self, metrics: GatewayMetrics) -> None:
        self.metrics = metrics
        self.sessions: dict[str, _Session] = {}
        self.tenants: dict[str, _Tenant] = {}
        self.caught = 0
        self._checks = 0

    def check(self, cfg: SentryConfig, tenant: str, session: str | None, body: Any,
              now: float) -> APIError | None:
        """Refuse this request of ``session`` (None: not in a session), or None. ``body``:
        the request as parsed (compared as canonical JSON: spacing and key order do not
        make a repeat new), or its bytes."""
        if session is None:
            return None
        self._checks += 1
        if self._checks % SWEEP_EVERY == 0:
            self._sweep(now, max(cfg.repeat_window_s, cfg.velocity_window_s))
        s = self.sessions.setdefault(session, _Session())
        s.last = now
        if cfg.repeat_limit is not None:
            canonical = body if isinstance(body, bytes) else orjson.dumps(
                body, option=orjson.OPT_SORT_KEYS)
            digest = hashlib.blake2b(canonical, digest_size=16).digest()
            while s.bodies and s.bodies[0][0] < now - cfg.repeat_window_s:
                s.bodies.popleft()
            same = sum(1 for _, d in s.bodies if d == digest)
            if same >= cfg.repeat_limit:
                return self._stop(tenant, session, "repeated_prompt", cfg.repeat_window_s,
                                  f"this session sent the same request {same + 1} times in "
                                  f"{cfg.repeat_window_s:g}s (limit {cfg.repeat_limit})")
            s.bodies.append((now, digest))
        if cfg.velocity_factor is not None:
            window = cfg.velocity_window_s
            while s.spend and s.spend[0][0] < now - window:
                s.spend.popleft()
            mine = sum(d for _, d in s.spend) / window
            usual = self._usual(tenant, now)
            if usual > 0 and mine > cfg.velocity_factor * usual:
                return self._stop(tenant, session, "spend_velocity", window,
                                  f"this session is spending ${mine * 60:.4g}/min, over "
                                  f"{cfg.velocity_factor:g}x the tenant's usual "
                                  f"${usual * 60:.4g}/min per session")
        return None

    def spent(self, tenant: str, session: str | None, dollars: float, now: float) -> None:
        if session is None or dollars <= 0:
            return
        s = self.sessions.setdefault(session, _Session(last=now))
        s.spend.append((now, dollars))
        self.tenants.setdefault(tenant, _Tenant()).add(now, dollars, session)

    def _sweep(self, now: float, window: float) -> None:
        """Forget sessions idle past every window (ids are the clients': bounded by them
        only while they are active)."""
        idle = [k for k, s in self.sessions.items() if s.last < now - window]
        for k in idle:
            del self.sessions[k]

    def capped(self, tenant: str, scope: str) -> None:
        """A session's hard cap refused a request (the rate store's decision)."""
        self.caught += 1
        self.metrics.series("sentry_actions", tenant, "session_budget_exceeded").inc()
        log.warning("sentry stopped %s of tenant %s: its session_budget is spent", scope,
                    tenant)

    def _usual(self, tenant: str, now: float) -> float:
        """The tenant's dollars per second per session over the last hour."""
        t = self.tenants.get(tenant)
        if t is None or not t.spend:
            return 0.0
        span = max(now - t.spend[0][0], 1.0)
        return t.total / span / max(len(t.sessions), 1)

    def _stop(self, tenant: str, session: str, reason: str, retry_s: float,
              why: str) -> APIError:
        self.caught += 1
        self.metrics.series("sentry_actions", tenant, reason).inc()
        log.warning("sentry stopped session %s of tenant %s: %s", session, tenant, why)
        return APIError(429, f"Runaway session stopped: {why}. Please check the agent's loop.",
                        type="runaway", code=reason,
                        headers={"retry-after": str(max(1, math.ceil(retry_s)))})

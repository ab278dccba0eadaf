"""One model's flow-control gate, without a clock or an event loop of its own: ``serve`` and
the EPP drive it from asyncio (``gateway.flow.control``), the simulator from its event loop.

A request ``offer``s itself; it goes at once when nothing waits and the pool has a free slot
(``saturation.free_slots``), or with ``fcfs`` (no gateway queue); otherwise it waits in the
``FairQueue`` (the driver then ``pump``s: the pool may have room the queue has not used,
and a shed request must be answered). Whenever room may have appeared (a request started or
ended on an endpoint, a granted one was sent, a scrape) the driver calls ``pump``, which lets
waiting requests through in the queue's order while slots are free: the gate is
work-conserving. Every request let
through is charged to its flow's fair-share counter; ``settled`` makes the charge exact.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from gateway.config.flow import FlowControl
from gateway.flow.fair import FairQueue, Mode
from gateway.flow.saturation import Thresholds, free_slots
from gateway.flow.waiter import BANDS, Waiter, engine_priority, tenant_of
from gateway.routing.endpoints import EndpointState

BURST = 8  # requests a light tenant may be served ahead of the fair queue's head (headroom)


@dataclass(slots=True)
class Offer:
    """What became of an offered request: ``go`` now, or wait; ``shed``: a waiting request
    (possibly the one offered) that must be refused to make room."""

    go: bool
    shed: Waiter | None = None


class Gate:
    def __init__(self, cfg: FlowControl, endpoints: Callable[[], Sequence[EndpointState]],
                 mode: str | None = None) -> None:
        self.cfg = cfg
        self.mode = mode or cfg.mode
        self.queue = FairQueue(self._mode(self.mode), max_queued=cfg.max_queued,
                               w_in=cfg.input_weight, w_out=cfg.output_weight)
        self.thresholds = Thresholds(cfg.queue_depth, cfg.kv_threshold, cfg.tpot_threshold_ms)
        # the headroom: one more request waiting per endpoint, whatever its decode step and
        # as this replica alone sees the queue (``Thresholds.elsewhere``)
        self._headroom = Thresholds(cfg.queue_depth + 1, cfg.kv_threshold, elsewhere=False)
        self.endpoints = endpoints
        self.let_through = 0  # granted, not yet sent
        self.running: dict[str, int] = {}  # requests granted and not settled, by tenant
        # tenants with requests running through other replicas (``share.CounterShare``)
        self.running_elsewhere: frozenset[str] = frozenset()
        # the tighter step for a tenant served more than one with requests running
        self._isolating = Thresholds(cfg.queue_depth, cfg.kv_threshold, cfg.isolation_step_ms) \
            if cfg.isolation_step_ms is not None and self.mode == "fair" else None

    @staticmethod
    def _mode(mode: str) -> Mode:
        return mode if mode in ("priority", "round_robin", "fair") else "fcfs"  # type: ignore[return-value]

    @property
    def queues(self) -> bool:
        return self.mode != "fcfs"

    def free(self, now: float, w: Waiter | None = None) -> int:
        """Slots free now (for ``w``: fewer when ``isolation_step_ms`` holds its tenant to a
        smaller batch, ``_over``)."""
        t = self.thresholds
        if self._isolating is not None and w is not None and self._over(w):
            t = self._isolating
        return free_slots(self.endpoints(), t, self.let_through, now)

    def _over(self, w: Waiter) -> bool:
        """Has ``w``'s tenant been served more than another tenant with requests running
        (through this replica or another)?"""
        counters, mine = self.queue.counters, _tenant(w)
        served = counters.get(mine, 0.0)
        return any(counters.get(t, 0.0) < served
                   for ts in (self.running, self.running_elsewhere) for t in ts if t != mine)

    def offer(self, w: Waiter, now: float) -> Offer:
        if not self.queues:
            return Offer(True)
        if self.queue.size == 0 and self.free(now, w) > 0 and \
                not self.queue.behind_elsewhere(tenant_of(w.flow), w.band):
            self._grant(w)
            return Offer(True)
        shed = self.queue.push(w)
        if w.queued and self._light(w) and self.headroom(now) > 0:
            # a request of a tenant within its share may use the margin the saturation
            # thresholds keep below the engines' limits: it does not wait for the busiest
            # tenant's requests to finish (reserved capacity is reclaimed at once)
            self.queue.take(w)
            self._grant(w)
            return Offer(True, shed)
        return Offer(False, shed)

    def _light(self, w: Waiter) -> bool:
        """May ``w`` use the headroom? Within its tenant's reserved throughput; or, nothing
        of a higher band waiting, when it is the fair queue's head ahead of other tenants
        (served less), or its tenant has fewer than half as many requests waiting as another
        tenant that waits (the one over its share is the one whose queue grows: a burst of a
        light tenant does not wait behind a flood because VTC gives it no credit) and has
        been served no more than ``BURST`` requests like this one beyond the head's tenant (so
        between two flooders the shorter queue cannot run ahead: the bound grows by
        ``BURST``·U at most)."""
        if w.band == "reserved":
            return True
        q = self.queue
        here = q.backlogged()
        # a tenant waiting at another replica and served less holds it back, unless that
        # tenant also waits here (its counter is the same everywhere, and the rules below
        # weigh it against the head's): else a light tenant's burst loses its headroom as soon
        # as the flooder it shares a replica with waits at another one as well
        if q.behind_elsewhere(_tenant(w), w.band, but=here):
            return False
        head = q.peek()
        if head is None or BANDS.index(head.band) < BANDS.index(w.band):
            return False
        others = here - {w.tenant}
        if not others:
            return False
        if head is w:
            return True
        if q.mode == "fair" and q.counters.get(w.tenant, 0.0) - q.counters.get(head.tenant, 0.0) \
                > BURST * q.service(w.cost_in, w.cost_out, w.weight):
            return False  # served well ahead of the head already: its turn comes in order
        mine = q.waiting_of(w.tenant)
        return any(q.waiting_of(t) > 2 * mine for t in others)

    def saturated(self, now: float) -> bool:
        """Would a request offered now wait (others wait already, or no slot is free)?"""
        return self.queues and (self.queue.size > 0 or self.free(now) <= 0)

    def headroom(self, now: float) -> int:
        """Slots beyond saturation: one more request waiting per endpoint, whatever its
        decode step (the KV threshold still holds)."""
        return free_slots(self.endpoints(), self._headroom, self.let_through, now)

    def pump(self, now: float) -> list[Waiter]:
        """Let waiting requests through while the pool has room; returns them, in order."""
        out: list[Waiter] = []
        while self.queue.size and self.free(now) > 0:
            head = self.queue.peek()
            if head is None or self.queue.behind_elsewhere(_tenant(head), head.band):
                break  # a tenant waiting at another replica is served less: its turn
            if self._isolating is not None and self.free(now, head) <= 0:
                break  # the head's tenant is held to a smaller batch: it waits
            w = self.queue.pop(head)
            if w is None:
                break
            self._grant(w)
            out.append(w)
        while self.queue.size and self.mode in ("fair", "round_robin"):
            w = self._lightest()  # the headroom: for tenants within their share
            if w is None or not self._light(w) or self.headroom(now) <= 0:
                break
            self.queue.take(w)
            self._grant(w)
            out.append(w)
        return out

    def _lightest(self) -> Waiter | None:
        """The next request of the waiting tenant with the fewest requests waiting."""
        tenants = self.queue.backlogged()
        if len(tenants) < 2:
            return None
        t = min(tenants, key=lambda t: (self.queue.waiting_of(t), t))
        return self.queue.head_of(t)

    def sent(self) -> None:
        """A request let through has been sent to an endpoint (or will not be)."""
        self.let_through = max(0, self.let_through - 1)

    def engine_priority(self, w: Waiter) -> int:
        """``w``'s ``priority`` for the engine's queue as it is let through
        (``fair.engine_priority``); 0 unless ``engine_priority`` is on."""
        if not self.cfg.engine_priority:
            return 0
        return engine_priority(w.band, self.queue.has_waiting(w.flow, w.band))

    def withdraw(self, w: Waiter) -> None:
        self.queue.remove(w)

    def settled(self, w: Waiter, prompt: float, output: float) -> None:
        """``w`` was served ``prompt`` + ``output`` tokens (0, 0: nothing): correct its
        charge, made with its reserved output."""
        if not self.queues:
            return
        t = _tenant(w)
        n = self.running.get(t, 0) - 1
        if n > 0:
            self.running[t] = n
        else:
            self.running.pop(t, None)
        self._charge(w, prompt - w.cost_in, output - w.cost_out)

    def _grant(self, w: Waiter) -> None:
        self.let_through += 1
        t = _tenant(w)
        self.running[t] = self.running.get(t, 0) + 1
        self._charge(w, w.cost_in, w.cost_out)

    def _charge(self, w: Waiter, cost_in: float, cost_out: float) -> None:
        if self.mode == "fair":
            self.queue.charge(w.flow, cost_in, cost_out, w.weight, w.sub)


def _tenant(w: Waiter) -> str:
    """``w``'s tenant (set when it was queued; from its flow otherwise)."""
    return w.tenant or tenant_of(w.flow)

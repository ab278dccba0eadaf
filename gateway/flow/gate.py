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
from gateway.flow.fair import FairQueue, Mode, Waiter, engine_priority
from gateway.flow.saturation import Thresholds, free_slots
from gateway.routing.endpoints import EndpointState


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
        # the headroom: one more request waiting per endpoint, whatever its decode step
        self._headroom = Thresholds(cfg.queue_depth + 1, cfg.kv_threshold)
        self.endpoints = endpoints
        self.let_through = 0  # granted, not yet sent

    @staticmethod
    def _mode(mode: str) -> Mode:
        return mode if mode in ("priority", "round_robin", "fair") else "fcfs"  # type: ignore[return-value]

    @property
    def queues(self) -> bool:
        return self.mode != "fcfs"

    def free(self, now: float) -> int:
        return free_slots(self.endpoints(), self.thresholds, self.let_through, now)

    def offer(self, w: Waiter, now: float) -> Offer:
        if not self.queues:
            return Offer(True)
        if self.queue.size == 0 and self.free(now) > 0:
            self._grant(w)
            return Offer(True)
        shed = self.queue.push(w)
        if (w.queued and self.queue.peek() is w
                and (w.band == "reserved" or self.queue.backlogged() - {w.tenant})
                and self.headroom(now) > 0):
            # the fair queue's head, ahead of other flows that wait (it has been served less)
            # or within its tenant's reserved throughput, may use the margin the saturation
            # thresholds keep below the engines' limits: it does not wait for the busiest
            # flow's requests to finish (reserved capacity is reclaimed at once)
            self.queue.pop()
            self._grant(w)
            return Offer(True, shed)
        return Offer(False, shed)

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
            w = self.queue.pop()
            if w is None:
                break
            self._grant(w)
            out.append(w)
        return out

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
        self._charge(w, prompt - w.cost_in, output - w.cost_out)

    def _grant(self, w: Waiter) -> None:
        self.let_through += 1
        self._charge(w, w.cost_in, w.cost_out)

    def _charge(self, w: Waiter, cost_in: float, cost_out: float) -> None:
        if self.mode == "fair":
            self.queue.charge(w.flow, cost_in, cost_out, w.weight, w.sub)

"""The gateway's flow control (``gateway.flow.gate``) on the simulator's clock: the same gate,
queue and saturation reading, driven by the event loop. A request that arrives while its pool
is saturated waits; it is let through when an endpoint starts or finishes a request (the pool's
tickets call the watchers, as in a gateway), when one let through is sent, or by a periodic
tick (KV usage changes with the scrape); one that waits too long or is shed is refused with
the gateway's 429 code."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gateway.flow.control import TICK_S
from gateway.flow.gate import Gate
from gateway.flow.waiter import Waiter
from simulator.events import EventLoop


class SimFlow:
    def __init__(self, gate: Gate, loop: EventLoop, proceed: Callable[[Any], None],
                 refuse: Callable[[Any, str], None]) -> None:
        self.gate = gate
        self.loop = loop
        self.proceed = proceed  # called with a request's payload when it may go
        self.refuse = refuse  # called with the payload and the error code
        self.waiters: dict[int, Waiter] = {}  # request index -> its waiter, let through
        # request index -> the engine ``priority`` it was let through with (``engine_priority``)
        self.priorities: dict[int, int] = {}
        self._queued: dict[int, int] = {}  # id(waiter) -> request index, while it waits
        self._pumping = False
        self._ticking = False
        # called after every pump with (now, backlogged flows, counters): measurements
        self.on_pump: Callable[[float, set[str], dict[str, float]], None] | None = None
        for e in gate.endpoints():
            e.live.watchers.append(self._soon)

    def arrive(self, index: int, payload: Any, flow: str, band: str, deadline: float,
               cost_in: float, cost_out: float, weight: float) -> None:
        w = Waiter(flow, band, deadline, cost_in, cost_out, weight, payload)
        offer = self.gate.offer(w, self.loop.now)
        if offer.shed is not None:
            self.refuse(offer.shed.payload, "flow_control_queue_full")
        if offer.go:
            self.waiters[index] = w  # let through: charged, settled when it ends
            self._let(index, w)
            self.proceed(payload)
            return
        self._queued[id(w)] = index
        if w.queued:
            self.loop.after(self.gate.cfg.max_wait_s(band), self._expire, w)
        self._soon()

    def _let(self, index: int, w: Waiter) -> None:
        if self.gate.cfg.engine_priority:
            self.priorities[index] = self.gate.engine_priority(w)

    def sent(self) -> None:
        """A request let through was sent (or answered without being sent)."""
        if self.gate.queues:
            self.gate.sent()
            self._soon()

    def settled(self, index: int, prompt: float, output: float) -> None:
        """A request let through ended (one refused while waiting was never charged)."""
        w = self.waiters.pop(index, None)
        self.priorities.pop(index, None)
        if w is not None:
            self.gate.settled(w, prompt, output)

    def _expire(self, w: Waiter) -> None:
        if w.queued:
            self.gate.withdraw(w)
            self._queued.pop(id(w), None)
            self.refuse(w.payload, "flow_control_timeout")

    def _soon(self) -> None:
        if not self._pumping and self.gate.queue.size:
            self._pumping = True
            self.loop.after(0.0, self._pump)

    def _pump(self) -> None:
        self._pumping = False
        for w in self.gate.pump(self.loop.now):
            index = self._queued.pop(id(w))
            self.waiters[index] = w
            self._let(index, w)
            self.proceed(w.payload)
        if self.on_pump is not None:
            q = self.gate.queue
            self.on_pump(self.loop.now, q.backlogged(), q.counters)
        if self.gate.queue.size and not self._ticking:
            self._ticking = True
            self.loop.after(TICK_S, self._tick)

    def _tick(self) -> None:
        self._ticking = False
        self._pump()

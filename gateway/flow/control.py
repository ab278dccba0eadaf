"""Flow control on asyncio, for ``serve`` and the EPP: each model's ``Gate`` with futures for
the requests that wait, woken when an endpoint of the model starts or finishes a request, when
a request let through is sent, and every ``TICK_S`` while anything waits (KV usage and health
change with the scrape). A request waits at most ``max_wait_ms`` (flex: ``flex_max_wait_ms``);
a refused one (shed for a better one, or waited too long) is a 429 in OpenAI's shape with
``retry-after``, after which the pipeline returns its reservation whole."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from gateway import clock
from gateway.config.flow import FlowControl
from gateway.flow.gate import Gate
from gateway.flow.waiter import Waiter
from gateway.metrics import GatewayMetrics
from gateway.routing.endpoints import EndpointState
from protocol.errors import APIError

TICK_S = 0.05


@dataclass(slots=True)
class _Wait:
    future: asyncio.Future[None]
    since: float
    error: APIError | None = None


@dataclass(slots=True)
class Pass:
    """A request's turn: ``sent()`` once it is on its way to an endpoint (or will not go),
    ``settled`` with what it was served."""

    gate: ModelGate
    waiter: Waiter
    open: bool = True
    engine_priority: int = 0  # for the engine's queue (``Gate.engine_priority``)

    def sent(self) -> None:
        if self.open:
            self.open = False
            self.gate.gate.sent()
            self.gate.pump()

    def settled(self, prompt: float, output: float) -> None:
        self.sent()
        self.gate.gate.settled(self.waiter, prompt, output)


@dataclass(eq=False)
class ModelGate:
    model: str
    gate: Gate
    metrics: GatewayMetrics
    watched: set[int] = field(default_factory=set)
    _ticker: asyncio.Task[None] | None = None

    def _watch(self) -> None:
        for e in self.gate.endpoints():
            if id(e.live) not in self.watched:
                self.watched.add(id(e.live))
                e.live.watchers.append(self.pump)

    async def enter(self, flow: str, band: str, deadline: float, cost_in: float,
                    cost_out: float, weight: float) -> Pass:
        """Wait for this request's turn (at once unless the pool is saturated)."""
        w = Waiter(flow, band, deadline, cost_in, cost_out, weight)
        offer = self.gate.offer(w, clock.now())
        if offer.shed is not None and offer.shed is not w:
            self._refuse(offer.shed, "queue_full")
        if offer.go:
            self._served(w, 0.0)
            return self._pass(w)
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        w.payload = _Wait(fut, time.perf_counter())
        if offer.shed is w:
            self._refuse(w, "queue_full")
        self._watch()  # its endpoints wake it when one of their requests starts or ends
        self.pump()
        self._gauge()
        limit = self.gate.cfg.max_wait_s(band)
        try:
            await asyncio.wait_for(asyncio.shield(fut), limit)
        except TimeoutError:
            if w.queued:
                self.gate.withdraw(w)
                self._refuse(w, "timeout")
            elif fut.done() and w.payload.error is None:  # let through as time ran out
                return self._pass(w)
        except asyncio.CancelledError:  # the client left while it waited
            if w.queued:
                self.gate.withdraw(w)
            elif fut.done() and w.payload.error is None:
                Pass(self, w).settled(0, 0)
            self._gauge()
            raise
        self._gauge()
        if w.payload.error is not None:
            raise w.payload.error
        return self._pass(w)

    def _pass(self, w: Waiter) -> Pass:
        return Pass(self, w, engine_priority=self.gate.engine_priority(w))

    def pump(self) -> None:
        if not self.gate.queue.size:  # (every request's start and end calls it)
            return
        self._let_through()
        if self.gate.queue.size and (self._ticker is None or self._ticker.done()):
            self._ticker = asyncio.get_running_loop().create_task(self._tick())

    async def _tick(self) -> None:
        while self.gate.queue.size:
            await asyncio.sleep(TICK_S)
            self._watch()  # endpoints come and go (scaling, reloads)
            self._let_through()

    def _let_through(self) -> None:
        for w in self.gate.pump(clock.now()):
            wait: _Wait = w.payload
            self._served(w, time.perf_counter() - wait.since)
            if not wait.future.done():
                wait.future.set_result(None)
        self._gauge()

    def _served(self, w: Waiter, waited: float) -> None:
        self.metrics.series("flow_wait", self.model, w.band).observe(waited)

    def _refuse(self, w: Waiter, reason: str) -> None:
        wait: _Wait = w.payload
        self.metrics.series("flow_shed", self.model, w.band, reason).inc()
        waited = time.perf_counter() - wait.since
        why = ("more urgent requests filled its queue" if reason == "queue_full"
               else f"it waited {waited:.1f}s without a free endpoint")
        wait.error = APIError(
            429, f"{self.model} is saturated and this request was not served: {why}. Please "
            "retry later.", type="requests", code="flow_control_" + reason,
            headers={"retry-after": "1" if reason == "queue_full" else "2"})
        if not wait.future.done():
            wait.future.set_result(None)

    def _gauge(self) -> None:
        for band, n in self.gate.queue.waiting().items():
            self.metrics.series("flow_waiting", self.model, band).set(n)


class FlowGates:
    """Every model's gate in one gateway replica; ``mode`` (``serve --flow-control``)
    overrides the policy's."""

    def __init__(self, metrics: GatewayMetrics, mode: str | None = None) -> None:
        self.metrics = metrics
        self.mode = mode
        self.gates: dict[str, ModelGate] = {}

    def get(self, model: str, cfg: FlowControl,
            endpoints: Callable[[], Sequence[EndpointState]]) -> ModelGate:
        g = self.gates.get(model)
        if g is None or g.gate.cfg != cfg:
            old = g
            g = self.gates[model] = ModelGate(model, Gate(cfg, endpoints, self.mode),
                                              self.metrics)
            if old is not None:  # a reload: the fair-share counters carry over
                g.gate.queue.inherit(old.gate.queue)
        return g

    def queues(self, cfg: FlowControl) -> bool:
        return (self.mode or cfg.mode) != "fcfs"

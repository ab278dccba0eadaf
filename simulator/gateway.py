"""The gateway's request path on the simulator's clock, around its real routing objects.

What runs is the gateway's own code: ``Fleet``'s endpoint states and prefix indexes,
``EndpointPool``'s tickets (the live counters every decision reads), ``Router.decide`` with
the policy's strategy, plugins, predictor and prefill/decode decider, ``Router.commit``,
``slo.misses`` and the ``OnlinePredictor`` with its training schedule. What is modelled around
it is what the real gateway sees of the world:

* *delays*: ``hop_s`` one way between client, gateway and engine (loopback), and the work
  before the engine sees a request (parsing, counting and hashing the prompt at the gateway,
  tokenizing it again at the engine): ``overhead_s`` plus ``ingest_s_per_token`` per prompt
  token, the gateway's half of it only for tokens its cache has not seen (a conversation's
  new messages). The defaults were fitted on this machine kind, request by request against the real
  stack on the same schedule (``benchmarks.sim_validate``: 3.3 ms + 2.5 ms per 1K prompt tokens
  between client and engine, the hops included);
* *the scrape*: every ``scrape_s`` the engines' queue, batch and KV usage are read into the
  endpoint states, so decisions see them as stale as a real gateway does;
* *KV events*: stored/removed blocks reach the precise index ``kv_event_s`` after a step;
* *training*: every ``retrain_s`` (the predictor's own setting) a fit is made of the samples
  so far, and swapped in ``train_lag_s`` later, as the background fit of a real gateway is.

For each request it records what the load harness's client would have measured (first and
every token as they reach the client) as ``loadtests.client.RequestResult``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from backend.block_pool import KVEvent
from backend.request import RemotePrefill, Request
from gateway.config.flow import FlowControl
from gateway.config.policy import Model, Route
from gateway.flow.gate import Gate
from gateway.request import slo
from gateway.routing import feedback
from gateway.routing.endpoints import EndpointPool, EndpointState, Ticket
from gateway.routing.fleet import Fleet
from gateway.routing.kv_events import EngineEvent
from gateway.routing.plugins import Candidate, RequestInfo
from gateway.routing.prefix import PreciseIndex
from gateway.routing.router import Decision, Router
from predictor.models import Models
from predictor.online import OnlinePredictor
from protocol.kv_hash import BlockHash
from simulator.engine import Hooks, SimEngine
from simulator.events import EventLoop
from simulator.flow import SimFlow
from simulator.oracle import Hindsight
from simulator.requests import Delays, SimRequest
from simulator.tiers import tier_view


@dataclass(slots=True)
class _Flight:
    """A request between the gateway and its engine(s)."""

    sr: SimRequest
    info: RequestInfo
    decision: Decision
    ticket: Ticket | None = None
    origin: float = 0.0  # when the gateway sent it (its prefill, when prefilled elsewhere)
    first_at: float | None = None  # first token at the gateway
    last_at: float | None = None
    chunks: int = 0
    prefill_used: bool = False


class SimGateway:
    def __init__(self, model: Model, route: Route, loop: EventLoop,
                 engines: dict[str, SimEngine], predictor: OnlinePredictor,
                 delays: Delays | None = None, priority: str = "standard") -> None:
        self.model = model
        self.route = route
        self.loop = loop
        self.engines = engines
        self.delays = delays or Delays()
        self.priority = priority
        self.fleet = Fleet(interval_s=self.delays.scrape_s)
        self.fleet.precise = PreciseIndex(same_hashes=True)
        eps = [self.fleet.endpoint(e.url, None, e.role, e.hardware or model.backend.hardware)
               for e in model.endpoints]
        self.pool = EndpointPool(model, eps)
        self.predictor = predictor
        self.router = Router(self.pool, self.fleet, predictor)
        self.hindsight: Hindsight | None = None  # set: routed by the oracle instead
        self.flow: SimFlow | None = None  # set (``use_flow``): the gateway's flow control
        self.states: dict[str, EndpointState] = {e.url: e for e in eps}
        self.completed = 0
        self.scrapes = 0
        self.outstanding = 0  # requests the workload will still send or is waiting for
        self.slo_actions: dict[str, int] = {}
        # (predicted, actual) of every request, from the first: the error over a whole run
        self.predictions: dict[str, list[tuple[float, float]]] = {"ttft": [], "tpot": []}
        self._n = 0
        self.fit_wait_s = 0.0
        pool_url = model.kv_pool.url if model.kv_pool is not None else None
        for url, eng in engines.items():
            eng.on_streamed = self._streamed(url)
            if self.router.precise:
                eng.on_kv_events = self._kv_sink(url)
                eng.pool.record_events = True
                if pool_url is not None and eng.kv_pool is not None:
                    eng.on_pool_events = self._kv_sink(pool_url)
            tier_view(eng, self.states[url].engine, self.fleet.tiers, pool_url)
        self._trainer = ThreadPoolExecutor(1, thread_name_prefix="sim-train")

    def use_flow(self, cfg: FlowControl, mode: str | None = None) -> None:
        """Hold requests in the gateway when the pool is saturated, as ``serve`` does."""
        self.flow = SimFlow(Gate(cfg, lambda: self.pool.endpoints, mode), self.loop,
                            self._decide, self._refused)

    def start(self, outstanding: int) -> None:
        """The workload will send (or wait for) ``outstanding`` requests: the scrape and
        training loops run until the last of them is done."""
        self.outstanding = outstanding
        self._scrape()
        self.loop.after(self.predictor.config.retrain_s, self._train)

    # -- the gateway's view of the engines ------------------------------------------------
    def _sync(self) -> None:
        """Bring every engine's decode run up to now (before anything reads what they did)."""
        for eng in self.engines.values():
            eng.sync()

    def _scrape(self) -> None:
        self.scrapes += 1
        self._sync()
        for url, eng in self.engines.items():
            v = self.states[url].engine
            v.running, v.waiting, v.kv_usage = eng.running, eng.waiting, eng.kv_usage()
            if v.num_gpu_blocks != eng.pool.num_blocks:
                v.block_size, v.num_gpu_blocks = eng.config.block_size, eng.pool.num_blocks
                self.fleet.approx.set_capacity(url, eng.pool.num_blocks)
            v.scraped_at = self.loop.now
        if self.outstanding > 0:
            self.loop.after(self.delays.scrape_s, self._scrape)

    def _streamed(self, url: str) -> Any:
        live = self.states[url].live

        def count(n: int) -> None:  # a decode run's tokens, as they leave the engine
            live.streamed += n
        return count

    def _kv_sink(self, url: str) -> Any:
        index = self.fleet.precise

        def sink(events: list[KVEvent], at: float) -> None:
            decoded = [EngineEvent(e.kind, list(e.block_hashes), medium=e.medium)
                       for e in events]
            due = at + self.delays.kv_event_s
            if due <= self.loop.now:  # published by a decode run applied late: it is in
                index.apply(url, decoded)
            else:
                self.loop.at(due, index.apply, url, decoded)
        return sink

    def _train(self) -> None:
        """The predictor's schedule: every ``retrain_s``, if samples arrived, a fit of what
        was observed so far, swapped in ``train_lag_s`` later. The fit runs in a thread
        (XGBoost releases the GIL) on a snapshot while the simulation goes on, and the swap
        waits for it, so the result does not depend on how fast this machine fits."""
        p = self.predictor
        lag = 0.0
        if p.ready_to_train():
            job = self._trainer.submit(p.fit_snapshot, p.snapshot())
            lag = self.delays.train_lag_s
            self.loop.after(lag, self._install, job)
        if self.outstanding > 0:
            self.loop.after(p.config.retrain_s + lag, self._train)

    def _install(self, job: Future[tuple[Models, int] | None]) -> None:
        t = time.perf_counter()
        fitted = job.result()
        self.fit_wait_s += time.perf_counter() - t  # wall time the simulation stood still
        if fitted is not None:
            self.predictor.install(*fitted)

    def close(self) -> None:
        self._trainer.shutdown(wait=True)

    # -- one request ------------------------------------------------------------------------
    def arrive(self, sr: SimRequest) -> None:
        """The client sends ``sr`` now."""
        d = self.delays
        n = len(sr.prompt_ids)
        fresh = n if sr.fresh_tokens < 0 else sr.fresh_tokens
        # half the per-token work is the gateway's (counting, hashing: cached per message),
        # half the engine's (tokenizing the whole prompt again)
        ingest = d.ingest_s_per_token * (n + fresh) / 2.0
        self.loop.after(d.hop_s + d.overhead_s + ingest, self._route, sr)

    def _route(self, sr: SimRequest) -> None:
        limit = self.model.max_context or min(e.model.max_model_len
                                              for e in self.engines.values())
        if len(sr.prompt_ids) + sr.output_tokens > limit:
            # as the gateway refuses it before admission (OpenAI's context_length_exceeded)
            sr.result.error = "http_400:context_length_exceeded"
            self._done(sr)
            return
        info = RequestInfo(len(sr.prompt_ids), sr.output_tokens, sr.hashes,
                           self.router.block_size(), self.route.slo_ttft_ms,
                           self.route.slo_tpot_ms, sr.band or self.priority)
        if self.flow is not None:
            self.flow.arrive(sr.index, (sr, info), sr.flow, info.priority,
                             self.flow.gate.cfg.deadline(sr.t, self.route.slo_ttft_ms),
                             len(sr.prompt_ids), sr.output_tokens, sr.weight)
            return
        self._decide((sr, info))

    def _decide(self, payload: tuple[SimRequest, RequestInfo]) -> None:
        sr, info = payload
        sr.routed_at = self.loop.now
        self._sync()
        d = self.router.decide(info)
        if d is not None and self.hindsight is not None and not self.pool.disaggregated:
            urls = [c.ep.url for c in d.considered]
            best = self.hindsight.pick(urls, sr.hashes, info.prompt_tokens, sr.output_tokens,
                                       self.loop.now)
            d.endpoint = next(c for c in d.considered if c.ep.url == best)
        self._judge(sr, info, d, slo.judge(self.route, self.model, info, d, self.loop.now))

    def _judge(self, sr: SimRequest, info: RequestInfo, d: Decision | None,
               step: slo.Step) -> None:
        """Carry out the gateway's SLO decision (``gateway.request.slo.judge``) in virtual time."""
        if step.deadline is not None:
            self.loop.after(self.delays.slo_poll_s, self._hold, sr, info, d, step.deadline)
            return
        if self.flow is not None:
            self.flow.sent()
        if step.action is not None:
            self._count(step.action)
        if step.error is not None and step.error.code == "slo_unattainable" and d is not None:
            # The gateway walks the fallback chain; the simulator models one pool, whose
            # decision serves it (as a fallback pool would, without its own queue).
            self._send(sr, info, d)
            return
        if step.error is not None:
            sr.result.error = f"http_{step.error.status}:{step.error.code}"
            self._done(sr)
            return
        assert step.decision is not None
        self._send(sr, info, step.decision)

    def _hold(self, sr: SimRequest, info: RequestInfo, d: Decision | None,
              deadline: float) -> None:
        self._sync()
        d = self.router.decide(info) or d
        self._judge(sr, info, d, slo.judge(self.route, self.model, info, d, self.loop.now,
                                           deadline))

    def _count(self, action: str) -> None:
        self.slo_actions[action] = self.slo_actions.get(action, 0) + 1

    def _send(self, sr: SimRequest, info: RequestInfo, d: Decision) -> None:
        f = _Flight(sr, info, d, origin=self.loop.now)
        if d.prefill is not None:
            self._prefill(f, d.prefill)
            return
        self._decode(f, None)

    def _prefill(self, f: _Flight, c: Candidate) -> None:
        """vLLM's disaggregated prefill: one token, the KV kept for the decode engine."""
        ticket = self.pool.acquire(c.ep, c.uncached_tokens, c.uncached_tokens)
        req = self._request(f, f"p{f.sr.index}", 1)
        req.remote_decode = True
        hop = self.delays.hop_s

        def finished(r: Request, now: float) -> None:
            self.loop.after(hop, self._prefilled, f, ticket, r.request_id, c.ep.url)

        self.engines[c.ep.url].incoming[req.request_id] = req
        self.loop.after(hop, self.engines[c.ep.url].submit, req,
                        Hooks(lambda *_: None, finished))

    def _prefilled(self, f: _Flight, ticket: Ticket, rid: str, url: str) -> None:
        self.pool.first_token(ticket)
        self.pool.release(ticket)
        self.pool.succeeded(ticket.ep)
        f.prefill_used = True
        self._decode(f, {"remote_url": url, "remote_request_id": rid})

    def _decode(self, f: _Flight, kv: dict[str, Any] | None) -> None:
        d, sr = f.decision, f.sr
        ep = d.endpoint.ep
        prefill_tokens = 0 if kv is not None else d.endpoint.uncached_tokens
        f.ticket = self.pool.acquire(ep, f.info.prompt_tokens + sr.output_tokens, prefill_tokens)
        if kv is None:
            f.origin = self.loop.now
        req = self._request(f, f"d{sr.index}", sr.output_tokens)
        if kv is not None:
            engine_rid = str(kv["remote_request_id"])
            req.request_id = engine_rid  # the prefill's held blocks are keyed by it
            req.remote_prefill = RemotePrefill(kv)
        sr.result.endpoint = ep.url
        if f.prefill_used and d.prefill is not None:
            sr.result.prefill_endpoint = d.prefill.ep.url
        hop = self.delays.hop_s
        self.engines[ep.url].incoming[req.request_id] = req
        self.loop.after(hop, self.engines[ep.url].submit, req, Hooks(
            lambda r, now, first: self._token(f, first, now + hop),
            lambda r, now: self.loop.after(hop, self._finished, f), sr.answer,
            lambda r, times: self._tokens(f, times)))

    def _request(self, f: _Flight, rid: str, max_tokens: int) -> Request:
        req = Request(rid, list(f.sr.prompt_ids), max_tokens, max_tokens, self.loop.now)
        if self.flow is not None:
            req.priority = self.flow.priorities.get(f.sr.index, 0)
        f.sr.engine_request = req
        req.block_hashes = [BlockHash(h) for h in f.sr.hashes]
        return req

    def _token(self, f: _Flight, first: bool, at: float) -> None:
        """A token leaves the engine; it reaches the gateway at ``at`` (one hop later) and
        the client a hop after that. Only the first one changes what decisions see (the
        request now decodes): it is applied at ``at``; the others are only counted."""
        ep = f.decision.endpoint.ep
        ep.live.streamed += 1
        f.chunks += 1
        if first:
            self.loop.at(at, self._first, f)
        f.last_at = at
        f.sr.result.chunk_times.append(at + self.delays.hop_s)

    def _tokens(self, f: _Flight, times: Sequence[float]) -> None:
        """``_token`` for the later tokens of a decode run, leaving the engine at ``times``
        (the engine counted them to the endpoint's ``streamed`` as they left: ``_streamed``)."""
        hop = self.delays.hop_s
        f.chunks += len(times)
        f.last_at = times[-1] + hop
        f.sr.result.chunk_times.extend([(t + hop) + hop for t in times])

    def _first(self, f: _Flight) -> None:
        f.first_at = self.loop.now
        if f.ticket is not None:
            self.pool.first_token(f.ticket)
            self.router.commit(f.decision, f.info)

    def _finished(self, f: _Flight) -> None:
        sr, r = f.sr, f.sr.result
        if f.ticket is not None:
            self.pool.release(f.ticket)
            self.pool.succeeded(f.ticket.ep)
        r.output_tokens = f.chunks
        r.usage_reported = True
        if r.chunk_times:
            r.ttft = r.chunk_times[0] - sr.t
            r.latency = r.chunk_times[-1] - sr.t
        self._observe(f)
        if self.flow is not None:
            self.flow.settled(sr.index, len(sr.prompt_ids), f.chunks)
        self._done(sr)

    def _refused(self, payload: tuple[SimRequest, RequestInfo], code: str) -> None:
        """Flow control answered it 429 (shed, or it waited too long)."""
        sr = payload[0]
        sr.result.error = f"http_429:{code}"
        if self.flow is not None:
            self.flow.settled(sr.index, 0, 0)
        self._done(sr)

    def _observe(self, f: _Flight) -> None:
        """What the request saw, against its routing rows (``gateway.routing.feedback``)."""
        if f.first_at is None:
            return
        s = feedback.seen(f.decision, f.prefill_used, f.origin, f.first_at, f.last_at, f.chunks)
        if math.isfinite(s.lead.ttft_ms):
            self.predictions["ttft"].append((s.lead.ttft_ms, s.ttft_ms))
        if s.tpot_ms is not None and math.isfinite(s.decode.tpot_ms):
            self.predictions["tpot"].append((s.decode.tpot_ms, s.tpot_ms))
        feedback.learn(s, self.predictor)

    def _done(self, sr: SimRequest) -> None:
        self.completed += 1
        self.outstanding -= 1
        if sr.on_done is not None:
            sr.on_done(sr)

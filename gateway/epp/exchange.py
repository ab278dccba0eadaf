"""One HTTP request through Envoy, as its ext_proc stream shows it to the EPP, in
``FULL_DUPLEX_STREAMED`` mode both ways.

Request: the headers are checked at once (401 and a draining gateway's 503 go back before
any body is read); the body is collected; at its end the request is parsed, admitted (quota
reserved, or failed over to a cheaper model), routed (and prefilled elsewhere when routing
picked a prefill endpoint), and only then are the headers answered -- with the destination
(header and ``envoy.lb`` metadata), the upstream path, the endpoint's key in place of the
client's -- followed by the body Envoy sends (the model renamed, ``max_tokens`` and usage
asked for, ``kv_transfer_params``).

Response: a 200 stream is relayed chunk by chunk through ``gateway.request.relay`` (renamed model,
usage picked up, tokens counted and charged progressively) with ``tokengate serve``'s
``x-tokengate-*`` and ``x-ratelimit-*`` headers; a whole answer is checked and renamed before
its headers go; any other status becomes our OpenAI-shaped error. Every reservation is
settled exactly once: by what was streamed when the stream ends -- also when Envoy resets it
because the client left -- or refunded whole when nothing was served."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Mapping
from typing import Any

import orjson

from gateway.epp import messages, order
from gateway.epp.feed import Collected, LineFeed
from gateway.epp.pick import Picked, embeddings_picker, picker
from gateway.epp.proto import ext_proc_pb2 as pb
from gateway.quota import ledger as quota
from gateway.request import embeddings, pipeline, responses
from gateway.request.context import RequestContext
from gateway.request.dispatch import open_request
from gateway.request.failure import ERROR_BODY_LIMIT, judge_error_event, judge_failure, unreachable
from gateway.request.relay import RelayResult, Sink, relay_stream
from gateway.request.respond import aggregate
from gateway.request.respond import headers as client_headers
from gateway.request.responses import EventSink
from gateway.request.settle import hand_back
from gateway.state import GatewayState
from protocol.errors import APIError
from protocol.response_events import EventStream
from protocol.validate import Kind

KINDS: dict[str, Kind] = {"/v1/chat/completions": "chat", "/v1/completions": "completion",
                          "/v1/responses": "chat", "/v1/embeddings": "completion"}
EMBEDDINGS = "/v1/embeddings"  # answered whole by the engine (no stream)
RESPONSES = "/v1/responses"  # served as the chat request it translates to (Envoy sends chat)
PROBES = ("/health", "/ready")  # liveness and readiness, as serve answers them

# Envoy's router stamps this on every response an upstream sent; a 5xx without it is
# Envoy's own local reply (the endpoint could not be reached, or reset before answering).
UPSTREAM_TIME = "x-envoy-upstream-service-time"

log = logging.getLogger("tokengate.epp")


class Exchange:
    def __init__(self, state: GatewayState) -> None:
        self.state = state
        self.received = time.perf_counter()
        self.headers: Mapping[str, str] = {}
        self.kind: Kind = "chat"
        self.responses = False  # a Responses API request (``protocol.responses``)
        self.embeddings = False  # an embeddings request
        self.tenant = ""
        self.allowed: set[str] | None = None
        self.request = bytearray()
        self.ctx: RequestContext | None = None
        self.adm: quota.Admission | None = None
        self.picked: Picked | None = None
        self.answer_headers: dict[str, str] = {}
        self.result = RelayResult()
        self.upstream_headers: Mapping[str, str] = {}
        self.response = bytearray()
        self.feed: LineFeed | None = None
        self.sink = Collected()
        self.relay: asyncio.Task[Any] | None = None
        self.done = False  # an immediate response went out: Envoy ends the exchange
        self.finished = False  # settlement started
        self.traced = False  # the root span was ended
        self.phase = order.NEW

    def _advance(self, which: str | None, end: bool) -> None:
        """Check ``which`` comes in order (else ``OutOfOrder``) and move the phase on."""
        try:
            self.phase = order.advance(self.phase, which, end)
        except order.OutOfOrder:
            self.phase = order.ENDED
            raise

    async def on(self, req: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        which = req.WhichOneof("request")
        # Headers and bodies say whether they end their side; trailers always do.
        end = getattr(getattr(req, which), "end_of_stream", True) if which else True
        self._advance(which, bool(end))
        try:
            if which == "request_headers":
                return await self._request_headers(req)
            if which == "request_body":
                return await self._request_body(req.request_body.body,
                                                req.request_body.end_of_stream)
            if which == "request_trailers":
                out = [] if self.ctx is not None else await self._request_body(b"", True)
                return [*out, messages.trailers(response=False)]
            if which == "response_headers":
                return self._response_headers(req)
            if which == "response_body":
                return await self._response_body(req.response_body.body,
                                                 req.response_body.end_of_stream)
            if which == "response_trailers":
                out = [] if self.finished else await self._response_body(b"", True)
                return [*out, messages.trailers(response=True)]
        except APIError as exc:
            return [self._refuse(exc)]
        return []

    # -- the request ---------------------------------------------------------------------

    async def _request_headers(self, req: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        h = self.headers = messages.with_objective(messages.header_map(req.request_headers))
        path = h.get(":path", "").split("?", 1)[0]
        method = h.get(":method", "")
        if path == "/v1/models" and method == "GET":
            return [self._models(pipeline.gate(self.state, h))]
        if path in PROBES and method == "GET":  # the probes serve answers, through the proxy
            self.done = True
            status, text = self.state.readiness() if path == "/ready" else (200, "ok")
            return [messages.immediate(status, text.encode(), {
                "content-type": "text/plain; charset=utf-8"}, f"tokengate_probe_{status}")]
        kind = KINDS.get(path)
        if kind is None:
            raise APIError(404, "unknown request URL: check the path (e.g. "
                           "/v1/chat/completions)", type="invalid_request_error",
                           code="unknown_url")
        if method != "POST":
            raise APIError(405, "this URL takes POST",
                           type="invalid_request_error", code="method_not_allowed")
        self.kind, self.allowed = kind, messages.subset(
            req, h, self.state.view.policy.settings.epp_trust_subset_header)
        self.responses, self.embeddings = path == RESPONSES, path == EMBEDDINGS
        self.tenant = pipeline.gate(self.state, h)
        if req.request_headers.end_of_stream:
            return await self._request_body(b"", True)
        return []

    def _models(self, tenant: str) -> pb.ProcessingResponse:
        data = [{"id": m, "object": "model", "created": 0, "owned_by": "tokengate"}
                for m in self.state.view.policy.models_for(tenant)]
        self.done = True
        return messages.immediate(200, orjson.dumps({"object": "list", "data": data}), {},
                                  "tokengate_models")

    async def _request_body(self, data: bytes, end: bool) -> list[pb.ProcessingResponse]:
        self.request += data
        limit = self.state.view.policy.settings.max_body_bytes
        if len(self.request) > limit:
            raise APIError(413, f"the request body is larger than {limit} bytes",
                           type="invalid_request_error", code="request_too_large")
        if not end:
            return []
        if self.embeddings:
            ctx = self.ctx = embeddings.begin(self.state, self.tenant, self.headers,
                                              bytes(self.request), self.received)
        else:
            ctx = self.ctx = pipeline.begin(self.state, self.tenant, self.headers,
                                            bytes(self.request), self.kind, self.received,
                                            responses=self.responses)
        adm = await pipeline.admit(self.state, ctx)
        opened = await open_request(self.state, ctx, adm, (
            embeddings_picker if self.embeddings else picker)(self.allowed))
        if isinstance(opened, APIError):
            if opened.code == "upstream_unavailable":  # GIE: no endpoint available is a 503
                opened.status = 503
            raise opened
        self.adm, picked, failover = opened
        self.picked = picked
        self.answer_headers = client_headers(ctx, self.adm, picked, failover)
        a = picked.attempt
        auth = {k.lower(): v for k, v in a.pool.auth_headers(a.ep).items()}
        set_ = {":path": picked.path, "content-length": str(len(picked.body)),
                "x-request-id": ctx.request_id, messages.MAX_RETRIES: str(len(picked.fallbacks)),
                **auth, **a.trace_headers()}  # the engine's spans join the trace
        self.state.metrics.overhead.observe(time.perf_counter() - self.received)
        # a client's own destination headers never reach the engine or the proxy's routing
        drop = (messages.SUBSET_HEADER, messages.SERVED, "x-tokengate-admin-key")
        return [messages.request_headers(set_, drop if auth else ("authorization", *drop),
                                         picked.destinations),
                *messages.body(picked.body, True, response=False)]

    # -- the response --------------------------------------------------------------------

    def _response_headers(self, req: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        h = req.response_headers
        hm = self.upstream_headers = messages.header_map(h)
        try:
            self.result.status = int(hm.get(":status", "0"))
        except ValueError:
            self.result.status = 0
        if self.picked is None or self.ctx is None:
            return [messages.response_headers({})]
        served = messages.served(req, hm)
        if served is not None and not self.picked.served_by(self.state, self.ctx, served):
            log.warning("the proxy says %s served request %s, which the EPP did not name "
                        "(it named %s)", served, self.ctx.request_id, self.picked.destinations)
        if self.result.status != 200:
            return [self._upstream_failed()] if h.end_of_stream else []  # judged on its body
        p, ctx = self.picked, self.ctx
        p.router.commit(p.decision, p.info)  # only now are its blocks on that engine
        p.attempt.relay()
        if self.embeddings:
            return []  # its whole answer is read, then answered with its headers
        self.feed = LineFeed()
        if not ctx.parsed.stream:
            # The engine streams (the EPP asked it to); the client gets the answer built
            # from it once it is complete, its headers then.
            self.relay = asyncio.ensure_future(self._aggregate(self.feed))
            return []
        self.relay = asyncio.ensure_future(self._relay(self.feed))
        return [messages.response_headers(
            {**self.answer_headers, "content-type": "text/event-stream",
             "cache-control": "no-cache"}, ("content-length",))]

    async def _aggregate(self, feed: LineFeed) -> bytes | None:
        assert self.ctx is not None and self.adm is not None and self.picked is not None
        return await aggregate(self.ctx, self.adm, self.picked, self.result, feed)

    async def _relay(self, feed: LineFeed) -> RelayResult:
        assert self.ctx is not None and self.adm is not None and self.picked is not None
        ctx, adm, p = self.ctx, self.adm, self.picked
        settings, t = ctx.view.policy.settings, ctx.route.timeouts
        state = self.state

        async def progress(n: int) -> None:
            await quota.charge_progress(state.store, adm, n)

        sink: Sink = self.sink
        if ctx.responses is not None:  # chat events out as the Responses API's
            sink = EventSink(self.sink, EventStream(ctx.responses, adm.model.name), lambda: {
                "prompt_tokens": adm.prompt_tokens, "completion_tokens": self.result.chunks})
        return await relay_stream(
            feed, sink, upstream_model=adm.model.upstream_name,
            served_model=adm.model.name, pass_usage=ctx.parsed.include_usage,
            on_tokens=progress, every=settings.progressive_charge_tokens,
            every_s=settings.progressive_charge_ms / 1000.0, into=self.result,
            on_first=p.attempt.first_token, gap_s=t.between_tokens_s, deadline_s=t.total_s,
            tally=p.decision.endpoint.ep.live)

    async def _response_body(self, data: bytes, end: bool) -> list[pb.ProcessingResponse]:
        if self.picked is None or self.adm is None:
            return messages.body(data, end, response=True)
        if self.result.status != 200:
            if len(self.response) < ERROR_BODY_LIMIT:
                self.response += data
            return [self._upstream_failed()] if end else []
        if self.embeddings:
            self.response += data
            return self._embedded() if end else []
        if self.feed is None or self.relay is None:
            return messages.body(data, end, response=True)
        self.feed.push(data, end)
        assert self.ctx is not None
        if not self.ctx.parsed.stream and not end:
            # Nothing goes back before the end: the relay takes the chunk in the background
            # (its first token, progressive charges and deadlines as it goes) and this
            # message is answered at once, not after one or more turns of a busy loop. A
            # relay that broke off is answered now.
            return self._whole() if self.relay.done() and self.result.broken else []
        drained = asyncio.ensure_future(self.feed.drained.wait())
        await asyncio.wait((drained, self.relay), return_when=asyncio.FIRST_COMPLETED)
        drained.cancel()
        if end:
            with contextlib.suppress(Exception):
                await self.relay
        if not self.ctx.parsed.stream:
            # Answered once the engine's stream ended, or at once when it broke off.
            return self._whole() if end or (self.relay.done() and self.result.broken) else []
        out = self.sink.take()
        if end or self.relay.done():
            self._finish()
        return messages.body(out, end, response=True)

    def _whole(self) -> list[pb.ProcessingResponse]:
        """The answer built from the engine's stream, or our error if it broke off."""
        assert self.relay is not None
        body = self.relay.result() if self.relay.done() and not self.relay.cancelled() \
            and self.relay.exception() is None else None
        if body is None:
            self.result.broken = True
            error = APIError(502, "the upstream's answer broke off before it was complete",
                             type="server_error", code="upstream_error")
            ev = self.result.error_event
            if ev is not None and self.result.chunks == 0 and self.picked is not None:
                # The engine refused the request in its stream's first event (vLLM checks
                # some parameters only then): judged as serve judges it.
                p = self.picked
                f = judge_error_event(ev, p.attempt.ep, p.attempt.pool)
                error = f.error
                if not f.endpoint_fault:
                    self.result.broken = False  # the request's fault, not the endpoint's
                    self.result.status = error.status
            self._finish()
            return [self._refuse(error)]
        if self.ctx is not None and self.ctx.responses is not None:
            body = responses.whole(self.ctx.responses, body)
        self._finish()
        return [messages.response_headers({**self.answer_headers,
                                           "content-type": "application/json",
                                           "content-length": str(len(body))}),
                *messages.body(body, True, response=True)]

    def _embedded(self) -> list[pb.ProcessingResponse]:
        """The engine's whole embeddings answer, renamed and settled with its usage."""
        assert self.adm is not None and self.picked is not None
        self.picked.attempt.first_token()
        try:
            embeddings.read_answer(bytes(self.response), self.adm.model.name, self.result)
        except APIError as exc:
            self._finish()
            return [self._refuse(exc)]
        body = self.result.body
        assert body is not None
        self._finish()
        return [messages.response_headers({**self.answer_headers,
                                           "content-type": "application/json",
                                           "content-length": str(len(body))}),
                *messages.body(body, True, response=True)]

    def _upstream_failed(self) -> pb.ProcessingResponse:
        """A non-200 answer (or Envoy's own reply, when the endpoint could not be reached),
        judged as ``tokengate serve`` judges one (and counted, as serve counts a failed
        attempt's answer); the reservation goes back whole."""
        assert self.picked is not None and self.ctx is not None and self.adm is not None
        a, status = self.picked.attempt, self.result.status
        if status >= 500 and UPSTREAM_TIME not in self.upstream_headers:
            f = unreachable()
        else:
            f = judge_failure(status, self.upstream_headers.get("retry-after"),
                              bytes(self.response), a.ep, a.pool)
        a.failed(f)
        return self._refuse(f.error)

    # -- the end -------------------------------------------------------------------------

    def _refuse(self, exc: APIError) -> pb.ProcessingResponse:
        """Answer ``exc`` in place of anything else; what is reserved goes back."""
        self.done = True
        extra = {}
        if self.ctx is not None:
            self.ctx.finish(self.ctx.parsed.model, str(exc.status))
            extra["x-request-id"] = self.ctx.request_id
            self._end_trace(exc)
        self._release()
        return messages.error(exc, extra)

    def _release(self) -> None:
        if self.picked is not None and not self.finished:
            self.finished = True
            self.picked.attempt.close()
        if self.ctx is not None:
            pipeline.settle_leftovers(self.ctx)

    def _finish(self) -> None:
        """Settle what was served (once), give the endpoint's counters back."""
        if self.finished or self.picked is None or self.adm is None or self.ctx is None:
            return
        self.finished = True
        hand_back(self.ctx, self.adm, self.result, self.picked)
        self._end_trace(None)

    def close(self) -> None:
        """The ext_proc stream ended (Envoy is done, or reset it: the client left)."""
        if self.relay is not None and not self.relay.done():
            self.relay.cancel()
        if self.result.status == 200 and not self.finished:
            # The answer had begun: settle what was streamed. A stream whose [DONE] was
            # relayed was whole (the client closed on it before Envoy's end of stream came).
            self.result.client_gone = not self.result.done
            self._finish()
        self._release()
        self._end_trace(None)

    def _end_trace(self, exc: APIError | None) -> None:
        if self.ctx is not None and not self.traced:
            self.traced = True
            pipeline.end_trace(self.ctx, exc)

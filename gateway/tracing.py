"""One OpenTelemetry trace per request, gateway to engine.

Off unless the policy names an OTLP receiver (``settings.tracing``); when off, every hook is a
``None`` check and nothing else. When on, each request gets a SERVER span named as the GenAI
semantic conventions name inference (``{gen_ai.operation.name} {gen_ai.request.model}``,
operation ``chat`` or ``text_completion``) continuing the client's W3C ``traceparent`` if it
sent one, with children for admission (tenant, route, prompt tokens counted, output
reserved, the failover taken), routing (strategy, every candidate with its cached tokens and
predicted TTFT/TPOT, the endpoint chosen), the remote prefill, the decode (a CLIENT span per
upstream attempt: ``server.address``/``server.port``, status, time to first token; its
``traceparent`` goes upstream, so an engine exporting its own spans, vLLM with
``--otlp-traces-endpoint``, joins the same trace) and settlement (``gen_ai.usage.*``, what was
charged and refunded). Spans are batched and exported over OTLP/HTTP off the event loop.

The tracer provider is the gateway's own, not OpenTelemetry's global one, so several gateways
in one process (tests, replicas) export independently; a policy reload that changes the
receiver builds a new provider and shuts the old one down.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from gateway.config.tracing import Tracing as TracingConfig

log = logging.getLogger("tokengate.tracing")
_PROPAGATOR = TraceContextTextMapPropagator()
Attrs = Mapping[str, Any]


def _clean(attrs: Attrs) -> dict[str, Any]:
    """OpenTelemetry attribute values: primitives or homogeneous sequences of them."""
    out: dict[str, Any] = {}
    for k, v in attrs.items():
        if v is None:
            continue
        if isinstance(v, list | tuple):
            v = [x for x in v if x is not None]
            if not v:
                continue
        out[k] = v
    return out


class RequestTrace:
    """The spans of one request (the root and a way to hang children off it)."""

    __slots__ = ("_tracer", "root", "upstream")

    def __init__(self, tracer: trace.Tracer, root: Span) -> None:
        self._tracer = tracer
        self.root = root
        self.upstream: Span | None = None  # the attempt being answered (ends at settlement)

    def child(self, name: str, attrs: Attrs | None = None, *,
              kind: SpanKind = SpanKind.INTERNAL, parent: Span | None = None) -> Span:
        ctx = trace.set_span_in_context(parent or self.root)
        return self._tracer.start_span(name, context=ctx, kind=kind,
                                       attributes=_clean(attrs or {}))

    @staticmethod
    def headers(span: Span) -> dict[str, str]:
        """``traceparent`` (and ``tracestate``) naming ``span``, for an upstream request."""
        carrier: dict[str, str] = {}
        _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
        return carrier

    @staticmethod
    def end(span: Span | None, attrs: Attrs | None = None, error: str | None = None) -> None:
        if span is None:
            return
        if attrs:
            span.set_attributes(_clean(attrs))
        if error is not None:
            span.set_status(Status(StatusCode.ERROR, error))
        span.end()


class Tracer:
    """The gateway's tracer for one tracing configuration (None: tracing off)."""

    def __init__(self, config: TracingConfig | None) -> None:
        self.config = config
        self._provider: TracerProvider | None = None
        self._tracer: trace.Tracer | None = None
        if config is None:
            return
        self._provider = TracerProvider(
            resource=Resource.create({"service.name": config.service_name}),
            sampler=ParentBased(TraceIdRatioBased(config.sample_ratio)))
        self._provider.add_span_processor(BatchSpanProcessor(
            OTLPSpanExporter(endpoint=config.otlp_endpoint, timeout=5),
            schedule_delay_millis=500))
        self._tracer = self._provider.get_tracer("tokengate")

    @property
    def enabled(self) -> bool:
        return self._tracer is not None

    def request(self, kind: str, model: str, headers: Mapping[str, str],
                attrs: Attrs) -> RequestTrace | None:
        if self._tracer is None:
            return None
        parent: Context = _PROPAGATOR.extract(dict(headers))
        op = kind if kind in ("chat", "embeddings") else "text_completion"
        root = self._tracer.start_span(
            f"{op} {model}", context=parent, kind=SpanKind.SERVER,
            attributes=_clean({"gen_ai.operation.name": op, "gen_ai.request.model": model,
                               **attrs}))
        return RequestTrace(self._tracer, root)

    def flush(self, timeout_ms: int = 5000) -> None:
        if self._provider is not None:
            self._provider.force_flush(timeout_ms)

    def shutdown(self) -> None:
        if self._provider is not None:
            self._provider.shutdown()
            self._provider = None
            self._tracer = None


def candidates_attrs(urls: Sequence[str], cached: Sequence[int],
                     ttft_ms: Sequence[float | None], tpot_ms: Sequence[float | None]
                     ) -> dict[str, Any]:
    return {"tokengate.routing.candidates": list(urls),
            "tokengate.routing.cached_tokens": list(cached),
            "tokengate.routing.predicted_ttft_ms": [round(x, 3) if x is not None else -1.0
                                                    for x in ttft_ms],
            "tokengate.routing.predicted_tpot_ms": [round(x, 3) if x is not None else -1.0
                                                    for x in tpot_ms]}

"""A real OTLP/HTTP trace receiver on loopback (tests and bench_vllm): it decodes the protobuf
``ExportTraceServiceRequest`` that every OpenTelemetry exporter posts to ``/v1/traces`` (the
gateway's and vLLM's alike) and keeps the spans, for tests to look at."""

from __future__ import annotations

import gzip
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)


@dataclass(frozen=True)
class ReceivedSpan:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    attributes: dict[str, object]


class OTLPReceiver:
    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.path != "/v1/traces":
                    self.send_response(404)
                    self.end_headers()
                    return
                req = ExportTraceServiceRequest()
                req.ParseFromString(body)
                receiver._keep(req)
                out = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args: object) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}/v1/traces"

    def _keep(self, req: ExportTraceServiceRequest) -> None:
        out = []
        for rs in req.resource_spans:
            service = next((a.value.string_value for a in rs.resource.attributes
                            if a.key == "service.name"), "")
            for ss in rs.scope_spans:
                for s in ss.spans:
                    attrs: dict[str, object] = {}
                    for a in s.attributes:
                        v = a.value
                        kind = v.WhichOneof("value")
                        attrs[a.key] = ([getattr(x, x.WhichOneof("value") or "string_value")
                                         for x in v.array_value.values]
                                        if kind == "array_value"
                                        else getattr(v, kind) if kind else None)
                    out.append(ReceivedSpan(service, s.name, s.trace_id.hex(), s.span_id.hex(),
                                            s.parent_span_id.hex(), attrs))
        with self._lock:
            self.spans.extend(out)

    def wait_for(self, pred: Callable[[list[ReceivedSpan]], bool],
                 timeout_s: float = 20.0) -> list[ReceivedSpan]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                spans = list(self.spans)
            if pred(spans):
                return spans
            time.sleep(0.1)
        with self._lock:
            raise AssertionError(f"spans received: {[(s.service, s.name) for s in self.spans]}")

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

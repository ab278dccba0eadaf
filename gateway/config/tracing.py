"""``settings.tracing``: where OpenTelemetry traces go (``gateway.tracing`` exports them)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gateway.config import schema
from gateway.config.decode import Decoder


@dataclass(frozen=True, slots=True)
class Tracing:
    """OpenTelemetry traces exported over OTLP/HTTP (protobuf); off unless configured."""

    otlp_endpoint: str  # e.g. http://127.0.0.1:4318/v1/traces
    service_name: str = "tokengate"
    sample_ratio: float = 1.0  # of requests that arrive without a sampled traceparent


def parse_tracing(d: Decoder, raw: Any) -> Tracing:
    tm = d.mapping(raw, "settings.tracing", schema.keys("tracing"), schema.required("tracing"))
    url = d.string(tm["otlp_endpoint"], "settings.tracing.otlp_endpoint")
    if not url.startswith(("http://", "https://")):
        raise d.fail("settings.tracing.otlp_endpoint", f"expected an http(s) URL of an "
                     f"OTLP/HTTP receiver, got {url!r}")
    ratio = d.number(tm.get("sample_ratio", 1.0), "settings.tracing.sample_ratio",
                     positive=False)
    if not 0.0 <= ratio <= 1.0:
        raise d.fail("settings.tracing.sample_ratio", "expected a number in [0, 1]")
    name = d.string(tm.get("service_name", "tokengate"), "settings.tracing.service_name")
    return Tracing(url, name, ratio)

"""The policy's ``settings`` section: the gateway's own behaviour (the limiter's failure mode
and leases, body bounds, timeouts and retries, the admin key, metrics, tracing, flow control,
calendar time zone, spend records)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Literal
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from gateway.config import schema
from gateway.config.decode import Decoder
from gateway.config.flow import FlowControl, parse_flow_control
from gateway.config.resilience import (
    ClientLimits,
    Retries,
    Timeouts,
    parse_client,
    parse_retries,
    parse_timeouts,
)
from gateway.config.sentry import SentryConfig, parse_sentry
from gateway.config.spend import Spend, parse_spend
from gateway.config.tracing import Tracing, parse_tracing

_HEX64 = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True, slots=True)
class Settings:
    redis_failure: Literal["fail_open", "fail_closed"] = "fail_open"
    # the count of replicas sharing the limits assumed until the census (Redis) has counted
    # them; None: a replica that has not counted them admits nothing locally under fail_open
    replicas: int | None = None
    # Quota leases (``gateway.quota.limiter.lease``): each replica takes this fraction of a big
    # bucket from Redis at a time and admits from it locally; 0 reserves per request. On by
    # default: most requests then cost no Redis round trip (bench-path's admit and settle).
    quota_lease: float = 0.05
    progressive_charge_tokens: int = 256
    progressive_charge_ms: int = 1000
    max_body_bytes: int = 8 * 1024 * 1024
    max_messages: int = 4096
    # a request field no API forwards: refused with a 400 naming it, or dropped
    unknown_fields: Literal["reject", "drop"] = "reject"
    # How many endpoints the EPP names per request (GIE's fallback list): the pick, then the
    # next best the proxy walks on retry; 1 names the pick alone.
    epp_endpoints: int = 3
    # the EPP narrows to a client's x-gateway-destination-endpoint-subset header (else only
    # to the proxy's subset metadata)
    epp_trust_subset_header: bool = False
    timeouts: Timeouts = field(default_factory=Timeouts)  # defaults for every route
    retries: Retries = field(default_factory=Retries)
    client: ClientLimits = field(default_factory=ClientLimits)
    admin_key_sha256: str | None = None
    admin_key_env: str | None = None
    # ``/metrics``: behind the admin key when one is configured (Prometheus sends it as a
    # bearer token), unless ``public_metrics``; ``metrics_tenant_label: false`` writes "*"
    # for every tenant, so the series name no customer.
    public_metrics: bool = False
    metrics_tenant_label: bool = True
    # answers name the engine that served them (x-tokengate-endpoint) to every client; else
    # only to a request that also carries the admin key (x-tokengate-admin-key)
    expose_endpoints: bool = False
    tracing: Tracing | None = None
    flow_control: FlowControl = field(default_factory=FlowControl)
    time_zone: str = "UTC"  # where calendar budgets' days and months begin
    spend: Spend = field(default_factory=Spend)
    sentry: SentryConfig = field(default_factory=SentryConfig)



def parse_settings(d: Decoder, raw: Any) -> Settings:
    if raw is None:
        return Settings()
    m = d.mapping(raw, "settings", schema.keys("settings"))
    kw: dict[str, Any] = {}
    if "redis_failure" in m:
        if m["redis_failure"] not in ("fail_open", "fail_closed"):
            raise d.fail("settings.redis_failure", "expected fail_open or fail_closed")
        kw["redis_failure"] = m["redis_failure"]
    if "unknown_fields" in m:
        if m["unknown_fields"] not in ("reject", "drop"):
            raise d.fail("settings.unknown_fields", "expected reject or drop")
        kw["unknown_fields"] = m["unknown_fields"]
    if "replicas" in m:
        kw["replicas"] = d.integer(m["replicas"], "settings.replicas")
    kw.update(d.fields(m, "settings", ("progressive_charge_tokens",
                                       "progressive_charge_ms", "max_body_bytes", "max_messages",
                                       "epp_endpoints"), d.integer))
    if "quota_lease" in m:
        lease = d.number(m["quota_lease"], "settings.quota_lease", positive=False)
        if not 0.0 <= lease <= 0.5:
            raise d.fail("settings.quota_lease", "expected a fraction of a bucket, 0 to 0.5")
        kw["quota_lease"] = lease
    kw["timeouts"] = parse_timeouts(d, m.get("timeouts"), "settings.timeouts", Timeouts())
    kw["retries"] = parse_retries(d, m.get("retries"), "settings.retries")
    kw["client"] = parse_client(d, m.get("client"), "settings.client")
    if "admin_key_sha256" in m:
        digest = d.string(m["admin_key_sha256"], "settings.admin_key_sha256").lower()
        if not _HEX64.match(digest):
            raise d.fail("settings.admin_key_sha256", "expected 64 hex digits")
        kw["admin_key_sha256"] = digest
    if "admin_key_env" in m:
        kw["admin_key_env"] = d.string(m["admin_key_env"], "settings.admin_key_env")
    for k in ("public_metrics", "metrics_tenant_label", "epp_trust_subset_header",
              "expose_endpoints"):
        if k in m:
            if not isinstance(m[k], bool):
                raise d.fail(f"settings.{k}", "expected true or false")
            kw[k] = m[k]
    if "tracing" in m:
        kw["tracing"] = parse_tracing(d, m["tracing"])
    if "flow_control" in m:
        kw["flow_control"] = parse_flow_control(d, m["flow_control"], "settings.flow_control")
    if "time_zone" in m:
        tz = d.string(m["time_zone"], "settings.time_zone")
        try:
            ZoneInfo(tz)
        except (ZoneInfoNotFoundError, ValueError):
            raise d.fail("settings.time_zone", f"unknown time zone {tz!r} (an IANA name, "
                         "e.g. Europe/Paris)") from None
        kw["time_zone"] = tz
    if "spend" in m:
        kw["spend"] = parse_spend(d, m["spend"], "settings.spend")
    if "sentry" in m:
        kw["sentry"] = parse_sentry(d, m["sentry"], "settings.sentry")
    return Settings(**kw)

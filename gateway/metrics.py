"""The gateway's Prometheus metrics (names start with ``tokengate_``), one registry per app."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LAT = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TPOT = (0.001, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2, 0.5, 1.0)
_OVERHEAD = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.05, 0.25)


class GatewayMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=False)
        self.requests = Counter("tokengate_requests", "Requests by outcome.",
                                ["route", "model", "tenant", "status"], registry=r)
        self.prompt_tokens = Counter("tokengate_prompt_tokens", "Prompt tokens served.",
                                     ["model", "tenant"], registry=r)
        self.completion_tokens = Counter("tokengate_completion_tokens",
                                         "Completion tokens served.", ["model", "tenant"],
                                         registry=r)
        self.limiter = Counter("tokengate_limiter_decisions", "Limiter decisions.",
                               ["scope", "outcome"], registry=r)
        self.limiter_fallbacks = Counter("tokengate_limiter_local_fallbacks",
                                         "Decisions served by the local limiter while the "
                                         "rate store was unreachable.", registry=r)
        self.failovers = Counter("tokengate_failovers", "Requests served by a fallback model.",
                                 ["reason", "from_model", "to_model"], registry=r)
        self.ttft = Histogram("tokengate_ttft_seconds", "Time to first token at the gateway.",
                              ["model"], buckets=_LAT, registry=r)
        self.tpot = Histogram("tokengate_tpot_seconds", "Time per output token at the gateway.",
                              ["model"], buckets=_TPOT, registry=r)
        self.overhead = Histogram("tokengate_overhead_seconds",
                                  "Time the gateway adds before forwarding a request.",
                                  buckets=_OVERHEAD, registry=r)
        self.in_flight = Gauge("tokengate_endpoint_in_flight", "Requests in flight.",
                               ["endpoint"], registry=r)
        self.upstream_errors = Counter("tokengate_upstream_errors", "Upstream failures.",
                                       ["endpoint", "kind"], registry=r)
        self.usage_rejected = Counter(
            "tokengate_usage_rejected", "Usage an endpoint reported that settlement refused "
            "(out of bounds of the gateway's own count), by field.", ["endpoint", "field"],
            registry=r)
        self.prefill_rejected = Counter(
            "tokengate_prefill_rejected", "Prefills whose kv_transfer_params named a host "
            "outside the model's pool (the request was decoded without them).", ["model"],
            registry=r)
        self.abandoned = Counter(
            "tokengate_abandoned", "Requests whose client left before the answer ended, by "
            "how far the engine had got (queued: no token yet; generating).",
            ["model", "phase"], registry=r)
        self.epp_refused_streams = Counter(
            "tokengate_epp_refused_streams", "ext_proc streams closed for a message out of "
            "order (nothing they had admitted is kept).", registry=r)
        self.retries = Counter("tokengate_retries", "Retries on another endpoint: made, or "
                               "denied by the attempts limit or the retry budget.",
                               ["model", "outcome"], registry=r)
        self.discovered_endpoints = Gauge(
            "tokengate_discovered_endpoints", "Endpoints discovery finds for a model now "
            "(an InferencePool's ready pods, or a headless Service's addresses).", ["model"],
            registry=r)
        self.policy_reloads = Counter("tokengate_policy_reloads", "Policy reload attempts.",
                                      ["outcome"], registry=r)
        self.predictor_mape = Gauge("tokengate_predictor_mape",
                                    "Rolling mean absolute percentage error of the latency "
                                    "predictions requests were routed on, as a fraction.",
                                    ["target"], registry=r)
        self.trainings_seen = 0
        self.predictor_trainings = Counter("tokengate_predictor_trainings",
                                           "Predictor models trained by this replica.",
                                           registry=r)
        self.routing_decisions = Counter("tokengate_routing_decisions",
                                         "Routing decisions by strategy and endpoint.",
                                         ["model", "strategy", "endpoint", "stage"], registry=r)
        self.routing_seconds = Histogram("tokengate_routing_decision_seconds",
                                         "Time to decide where a request goes: hashing, "
                                         "prediction, plugins, and any wait its SLO or "
                                         "priority imposed.", buckets=_OVERHEAD, registry=r)
        self.slo_actions = Counter("tokengate_slo_actions",
                                   "Requests predicted to miss their SLO, by what was done.",
                                   ["model", "priority", "action"], registry=r)
        self.prefix_cached_tokens = Counter("tokengate_prefix_expected_cached_tokens",
                                            "Prompt tokens the chosen endpoint was expected "
                                            "to have cached.", ["model"], registry=r)
        # serverless scaling (gateway.scaling)
        self.token_velocity = Gauge("tokengate_token_velocity_tokens_per_second",
                                    "Token velocity per pool and stage: the rate arriving "
                                    "(demand) and the rate the ready endpoints can process "
                                    "(capacity).", ["pool", "stage", "kind"], registry=r)
        self.desired_replicas = Gauge("tokengate_desired_replicas",
                                      "Replicas per role that keep every stage under its "
                                      "target utilization (for HPA/KEDA, or the gateway's own "
                                      "launcher).", ["pool", "role"], registry=r)
        self.replicas = Gauge("tokengate_replicas", "Launched replicas by state.",
                              ["pool", "state"], registry=r)
        self.role_conversions = Counter("tokengate_role_conversions",
                                        "Endpoints converted between roles.",
                                        ["pool", "from_role", "to_role"], registry=r)
        self.cold_starts = Counter("tokengate_cold_starts", "Replicas launched.", ["pool"],
                                   registry=r)
        self.held_requests = Gauge("tokengate_held_requests",
                                   "Requests held while their pool has no ready endpoint.",
                                   ["pool"], registry=r)
        self.migrations = Counter("tokengate_migrations",
                                  "In-flight streams moved to another endpoint.",
                                  ["pool", "outcome"], registry=r)
        # flow control (gateway.flow)
        self.flow_waiting = Gauge("tokengate_flow_waiting_requests",
                                  "Requests waiting in the gateway for a saturated pool.",
                                  ["model", "priority"], registry=r)
        self.flow_wait = Histogram("tokengate_flow_wait_seconds",
                                   "Time requests waited in the gateway's flow control.",
                                   ["model", "priority"], buckets=_LAT, registry=r)
        self.flow_shed = Counter("tokengate_flow_shed",
                                 "Requests flow control refused (queue full or waited too "
                                 "long).", ["model", "priority", "reason"], registry=r)
        # spend (gateway.spend)
        self.spend_dollars = Counter("tokengate_spend_dollars", "Dollars spent, at the "
                                     "models' prices.", ["tenant", "model"], registry=r)
        self.spend_tokens = Counter("tokengate_spend_tokens", "Tokens spent by kind (prompt, "
                                    "completion, cached prompt).", ["tenant", "model", "kind"],
                                    registry=r)
        self.tier_requests = Counter("tokengate_tier_requests", "Requests by capacity tier "
                                     "(reserved, payg, flex).", ["model", "tier"], registry=r)
        self.sentry_actions = Counter("tokengate_sentry_actions", "Agent sessions the cost "
                                      "sentry stopped or throttled, by reason.",
                                      ["tenant", "reason"], registry=r)
        self._children: dict[tuple[object, ...], Any] = {}

    def series(self, name: str, *labels: str) -> Any:
        """``self.<name>.labels(*labels)``, memoised: the hot path uses the same few series."""
        key = (name, *labels)
        c = self._children.get(key)
        if c is None:
            c = self._children[key] = getattr(self, name).labels(*labels)
        return c

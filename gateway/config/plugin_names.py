"""The routing plugins a policy may name (``gateway.routing.plugins`` registers exactly
these; a test keeps the two in step). Names live here so the policy never imports the
router."""

STRATEGIES = frozenset({"round_robin", "least_request", "prefix", "predicted",
                        "sglang_cache_aware", "llm_d", "dynamo_kv"})
FILTERS = frozenset({"bounded_load", "tpot_slo", "ttft_slo"})
SCORERS = frozenset({"least_request", "least_tokens", "queue", "kv_free", "prefix",
                     "predicted_ttft", "predicted_tpot", "dynamo_cost"})
PICKERS = frozenset({"max_score", "round_robin", "weighted_random", "sglang_cache_aware"})

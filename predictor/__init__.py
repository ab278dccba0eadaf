"""Online TTFT/TPOT prediction for routing (see the routing issue)."""

"""Online TTFT/TPOT prediction for routing."""

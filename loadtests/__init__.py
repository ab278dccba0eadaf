"""Load-test harness: real-trace replay, vLLM-standard metrics, reports."""

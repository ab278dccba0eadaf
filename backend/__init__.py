"""The reference GPU backend: a vLLM-faithful simulated inference server."""

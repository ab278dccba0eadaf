"""The demo stack (``tokengate up``): engines for a policy's loopback endpoints -- reference
backends, real vLLM, a shared KV pool -- and the gateway in front (or Envoy with the gateway
as its endpoint picker); the pool-shaping flags the simulator shares. It launches the
gateway; the gateway knows nothing of it."""

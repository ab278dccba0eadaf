"""A model's ``backend:`` section: how ``tokengate up`` (and the simulator) run this model
with reference backends -- the profile, its hardware, its step budget and KV tiers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gateway.config import schema
from gateway.config.decode import Decoder


@dataclass(frozen=True, slots=True)
class BackendSpec:
    """How ``tokengate up`` simulates this model with reference backends."""

    model: str = "llama-3-8b"
    # What a simulated (reference) backend models; for the routing brain, the hardware of an
    # endpoint the policy says nothing about is unknown, not an H100.
    hardware: str | None = None
    max_num_batched_tokens: int | None = None  # the engine's per-step token budget
    tensor_parallel: int | None = None  # GPUs per instance (default: the model profile's)
    kv_offload_gb: float = 0.0  # host memory per instance for KV below the GPU cache
    kv_pool_gb: float = 0.0  # a shared KV pool for the pool's instances (``up`` starts it)
    pooling: str = "token"  # models sharing an endpoint: switch between batches or steps

    @property
    def sim_hardware(self) -> str:
        return self.hardware or "h100-sxm"


def parse_backend(d: Decoder, raw: Any, path: str) -> BackendSpec:
    bm = d.mapping(raw, path, schema.keys("backend"))
    bkw: dict[str, Any] = {
        k: d.integer(v, f"{path}.{k}")
        if k in ("max_num_batched_tokens", "tensor_parallel")
        else d.number(v, f"{path}.{k}", positive=False)
        if k in ("kv_offload_gb", "kv_pool_gb")
        else d.string(v, f"{path}.{k}") for k, v in bm.items()}
    for k in ("kv_offload_gb", "kv_pool_gb"):
        if bkw.get(k, 0) < 0:
            raise d.fail(f"{path}.{k}", "must not be negative")
    if bkw.get("pooling", "token") not in ("request", "token"):
        raise d.fail(f"{path}.pooling", f"expected request or token, got {bkw['pooling']!r}")
    return BackendSpec(**bkw)

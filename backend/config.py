"""Settings of one reference-backend instance (what the CLI flags say)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from backend.engine import EngineConfig
from backend.faults import FaultConfig

Role = Literal["both", "prefill", "decode"]
ROLES: tuple[Role, ...] = ("both", "prefill", "decode")

# Link bandwidths of the KV transfer between prefill and decode instances, in bits/s.
KV_LINKS = {"rdma": 400e9, "tcp": 25e9}


@dataclass(slots=True)
class BackendConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    model: str = "llama-3-8b"
    hardware: str = "h100-sxm"
    served_model_name: str | None = None
    role: Role = "both"
    profiles_file: str | None = None
    max_model_len: int | None = None
    output_len: str = "lognormal:256:0.8"
    kv_link_bps: float = KV_LINKS["rdma"]
    kv_link_latency_s: float = 100e-6
    load_bandwidth_bps: float = 3.6e9  # bytes/s from storage to GPU (local NVMe safetensors)
    api_key: str | None = None
    max_body_bytes: int = 64 * 1024 * 1024
    engine: EngineConfig = field(default_factory=EngineConfig)
    faults: FaultConfig = field(default_factory=FaultConfig)

    @property
    def name(self) -> str:
        return self.served_model_name or self.model

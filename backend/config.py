"""Settings of one reference-backend instance (what the CLI flags say)."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from typing import Literal

from backend.engine_config import EngineConfig
from backend.events import KVEventsConfig
from backend.faults import FaultConfig
from backend.lora import LoraConfig
from backend.pooling import PoolingConfig

# The environment variable holding the shared secret of a KV pool (``tokengate kvpool``) and
# the backends that use it.
KVPOOL_TOKEN_ENV = "TOKENGATE_KVPOOL_TOKEN"

Role = Literal["both", "prefill", "decode"]
ROLES: tuple[Role, ...] = ("both", "prefill", "decode")

# Link bandwidths of the KV transfer between prefill and decode instances, in bits/s.
KV_LINKS = {"rdma": 400e9, "tcp": 25e9}
LOOPBACK_PEERS = ("127.0.0.0/8", "::1/128")


def peer_allowed(host: object, port: object, peers: tuple[str, ...]) -> bool:
    """Whether ``host:port`` (from a request's kv_transfer_params) is a trusted KV peer: an
    IP address inside one of ``peers`` and a valid port; host names are never trusted (a
    name's address is not ours to vouch for)."""
    if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
        return False
    try:
        addr = ipaddress.ip_address(host) if isinstance(host, str) else None
    except ValueError:
        return False
    return addr is not None and any(addr in ipaddress.ip_network(p, strict=False)
                                    for p in peers)


@dataclass(slots=True)
class BackendConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    model: str = "llama-3-8b"
    tensor_parallel: int | None = None  # overrides the model profile's degree
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
    # The prefill peers this instance may pull KV from (networks, CIDR): a request's
    # ``kv_transfer_params`` naming any other host is refused, never contacted.
    kv_peers: tuple[str, ...] = LOOPBACK_PEERS
    max_body_bytes: int = 64 * 1024 * 1024
    kv_events: KVEventsConfig | None = None  # publish KV events over ZMQ (vLLM's format)
    kv_offload_bytes: float = 0.0  # host memory for evicted KV blocks (0: none)
    kv_pool_url: str | None = None  # the shared KV pool (``tokengate kvpool``)
    kv_pool_token: str | None = None  # its shared secret (sent as a bearer token)
    tokenizer: str | None = None  # a tokenizer (model directory, tokenizer.json, tiktoken)
    image_tokens: int = 0  # prompt tokens an image part becomes (0: images are refused)
    engine: EngineConfig = field(default_factory=EngineConfig)
    faults: FaultConfig = field(default_factory=FaultConfig)
    pooling: PoolingConfig | None = None  # several models on this instance
    lora: LoraConfig | None = None  # LoRA adapters of the (first) model

    @property
    def served_names(self) -> list[str]:
        return [n for n, _ in self.pooling.models] if self.pooling else [self.name]

    @property
    def name(self) -> str:
        """The first (or only) served model."""
        if self.pooling is not None:
            return self.pooling.models[0][0]
        return self.served_model_name or self.model

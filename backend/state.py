"""Everything one backend instance owns, built once and handed to its HTTP handlers."""

from __future__ import annotations

import logging
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web

from backend.config import BackendConfig, Role
from backend.engine import Engine
from backend.faults import Faults
from backend.kv_offload import KVTiers
from backend.kv_tiers import HostTier, LoadCost
from backend.lora import LoraRegistry
from backend.metrics import BackendMetrics
from backend.textgen import LengthDistribution
from protocol.errors import APIError
from protocol.tokenizer import Tokenizer
from roofline.profiles import HardwareProfile, ModelProfile, ProfileCatalog, load_profiles

log = logging.getLogger("tokengate.backend")


@dataclass(slots=True, eq=False)
class BackendState:
    config: BackendConfig
    model: ModelProfile
    hardware: HardwareProfile
    tokenizer: Tokenizer
    engine: Engine
    metrics: BackendMetrics
    faults: Faults
    lengths: LengthDistribution
    max_model_len: int
    load_seconds: float
    role: Role
    hosted: dict[str, ModelProfile] = field(default_factory=dict)  # served name -> profile
    max_len: dict[str, int] = field(default_factory=dict)  # served name -> context limit
    lora: LoraRegistry | None = None
    engine_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    ready: bool = False
    counter: int = 0
    executor: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(2, thread_name_prefix="tokenize"))
    http: aiohttp.ClientSession | None = None

    @classmethod
    def create(cls, config: BackendConfig, tokenizer: Tokenizer | None = None) -> BackendState:
        catalog = ProfileCatalog()
        if config.profiles_file:
            load_profiles(config.profiles_file, catalog)
        hosted = cls._hosted(config, catalog)
        model = next(iter(hosted.values()))
        hardware = catalog.get_hardware(config.hardware)
        tok = tokenizer or Tokenizer(model.tokenizer)
        ref: list[BackendState] = []
        pooling = config.pooling
        engine = Engine(model, hardware, tok, config.engine, pooling=pooling, hosted=hosted)
        metrics = BackendMetrics(engine, config.name, lambda: ref[0].role)
        engine.observer = metrics.observer()
        engine.extra_step_s = config.faults.slow_step_s
        max_len = {}
        for slot in engine.mux.slots:
            want = config.max_model_len or slot.profile.max_model_len
            max_len[slot.name] = min(want, slot.pool.num_blocks * config.engine.block_size)
            if max_len[slot.name] < want:
                log.warning("max_model_len of %s capped at %d: the KV cache holds only that "
                            "many tokens", slot.name, max_len[slot.name])
        if config.pooling is None:  # one model: its slot is named by its profile, clients
            # (and /v1/models) name it by --served-model-name
            max_len.setdefault(config.name, max_len[engine.mux.slots[0].name])
        # startup loads the first model; the others are switched in (``backend.pooling``)
        load_s = model.weight_bytes / model.tensor_parallel / config.load_bandwidth_bps
        state = cls(config=config, model=model, hardware=hardware, tokenizer=tok, engine=engine,
                    metrics=metrics, faults=Faults(config.faults, config.engine.seed),
                    lengths=LengthDistribution.parse(config.output_len),
                    max_model_len=max_len[engine.mux.slots[0].name],
                    load_seconds=load_s * config.engine.time_scale, role=config.role,
                    hosted=hosted, max_len=max_len)
        ref.append(state)
        if config.lora is not None:
            state.lora = LoraRegistry(config.lora, model, frozenset(hosted))
            for name, path in config.lora.modules:
                try:
                    state.lora.register(name, path)
                except APIError as exc:
                    raise ValueError(f"--lora-modules {name}={path}: {exc.message}") from None
        if config.kv_offload_bytes > 0 or config.kv_pool_url:
            if pooling is not None:
                raise ValueError("KV tiers (--kv-offload-gb, --kv-pool) serve one model per "
                                 "instance; drop them or --models")
            engine.use_tiers(cls._tiers(config, model, hardware, ref[0]))
        return state

    @staticmethod
    def _hosted(config: BackendConfig, catalog: ProfileCatalog) -> dict[str, ModelProfile]:
        if config.pooling is None:
            return {config.name: catalog.get_model(config.model, config.tensor_parallel)}
        if config.role != "both":
            raise ValueError("a prefill or decode role serves one model per instance; "
                             "drop --role or --models")
        hosted = {name: catalog.get_model(profile, config.tensor_parallel)
                  for name, profile in config.pooling.models}
        if len(hosted) != len(config.pooling.models):
            raise ValueError("--models names a model twice")
        tokenizers = {m.tokenizer for m in hosted.values()}
        if len(tokenizers) > 1 and not config.tokenizer:
            raise ValueError("models sharing an instance must share a tokenizer "
                             f"({', '.join(sorted(tokenizers))}); pick one with --tokenizer")
        return hosted

    @staticmethod
    def _tiers(config: BackendConfig, model: ModelProfile, hardware: HardwareProfile,
               state: BackendState) -> KVTiers:
        cost = LoadCost.of(model, hardware, config.kv_link_bps, config.kv_link_latency_s)
        bs = config.engine.block_size
        host = None
        if config.kv_offload_bytes > 0:
            blocks = int(config.kv_offload_bytes // (model.kv_bytes_per_token * bs))
            if blocks <= 0:
                raise ValueError("--kv-offload-gb holds less than one KV block")
            host = HostTier(blocks)
        return KVTiers(cost, bs, host=host, pool_url=config.kv_pool_url,
                       pool_token=config.kv_pool_token, time_scale=config.engine.time_scale,
                       session=lambda: state.http)


STATE: web.AppKey[BackendState] = web.AppKey("tokengate_backend_state", BackendState)


def base_of(state: BackendState, model: str) -> str | None:
    """The hosted model a request naming ``model`` runs on: itself, or an adapter's base."""
    if model in state.hosted:
        return model
    if state.lora is not None and model in state.lora.adapters:
        return next(iter(state.hosted))
    return None

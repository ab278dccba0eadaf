"""LoRA adapters on the reference backend, as vLLM serves them.

A request names an adapter as its ``model``; it runs on the base model, and a batch holds the
requests of at most ``max_loras`` distinct adapters (vLLM's ``--max-loras``: the adapters' GPU
slots), so a request whose adapter would be one too many waits for a step whose batch has room.
Adapters are registered at start (``--lora-modules NAME=PATH``) or at run time through vLLM's
endpoints (``POST /v1/load_lora_adapter`` ``{"lora_name", "lora_path"}``, ``POST
/v1/unload_lora_adapter`` ``{"lora_name"}``), which vLLM, and so the backend, serves only when
``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` is true. Their answers and errors are vLLM 0.32's: 200
with a "Success: ..." text, 400 for a missing field, a name taken by a base model or an adapter
already loaded, 404 for an adapter path without ``adapter_config.json`` or an unknown name to
unload.

An adapter is a PEFT directory: its ``adapter_config.json`` gives the rank ``r`` and the
``target_modules``, from which its size is computed (``A: r × in``, ``B: out × r`` per module
and layer, in the model's dtype); a rank above ``--max-lora-rank`` is refused as vLLM refuses
it. Loading one takes its bytes over the disk's bandwidth (``SwitchCost.disk_bandwidth``), on
the engine's time scale. Unloading removes the name; requests already running finish.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from protocol.errors import APIError
from roofline.profiles import ModelProfile

RUNTIME_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


def runtime_updates_allowed() -> bool:
    return os.environ.get(RUNTIME_ENV, "").strip().lower() in ("1", "true", "yes")


@dataclass(frozen=True, slots=True)
class LoraConfig:
    max_loras: int = 1  # distinct adapters in one batch
    max_lora_rank: int = 16
    modules: tuple[tuple[str, str], ...] = ()  # registered at start: (name, path)


@dataclass(frozen=True, slots=True)
class Adapter:
    name: str
    path: str
    rank: int
    bytes: float
    int_id: int


def _module_shape(model: ModelProfile, module: str) -> tuple[int, int]:
    """(in, out) features of a projection of a Llama-style layer."""
    h = model.hidden_size
    kv = model.num_kv_heads * model.head_dim
    inter = int(model.matmul_params / model.num_layers - 2 * h * h - 2 * h * kv) // (3 * h) \
        if model.num_layers else h
    return {"q_proj": (h, h), "o_proj": (h, h), "k_proj": (h, kv), "v_proj": (h, kv),
            "gate_proj": (h, inter), "up_proj": (h, inter),
            "down_proj": (inter, h)}.get(module, (h, h))


def read_adapter(name: str, path: str, model: ModelProfile, max_rank: int, int_id: int
                 ) -> Adapter:
    """The adapter at ``path`` (a PEFT directory), sized for ``model``; APIError as vLLM."""
    cfg_file = Path(path) / "adapter_config.json"
    try:
        cfg = json.loads(cfg_file.read_text())
        rank = int(cfg["r"])
        targets = cfg.get("target_modules") or ["q_proj", "v_proj"]
        if isinstance(targets, str):
            targets = [targets]
    except (OSError, ValueError, KeyError, TypeError):
        raise APIError(404, f"Loading lora {name} failed: No adapter found for <path>",
                       type="NotFoundError", param="lora_path", code="lora_not_found") from None
    if rank <= 0 or rank > max_rank:
        raise APIError(400, f"LoRA rank {rank} is greater than max_lora_rank {max_rank}.",
                       type="InvalidUserInput", param="lora_path", code="lora_rank_too_large")
    per_layer = sum(rank * (i + o) for i, o in (_module_shape(model, str(t)) for t in targets))
    return Adapter(name, path, rank, float(per_layer * model.num_layers * model.dtype_bytes),
                   int_id)


@dataclass(slots=True)
class LoraRegistry:
    """The adapters a backend serves, by name."""

    config: LoraConfig
    base: ModelProfile
    base_names: frozenset[str]
    adapters: dict[str, Adapter] = field(default_factory=dict)
    loads: int = 0
    _next_id: int = 1

    def register(self, name: str, path: str) -> Adapter:
        if not name or not path:
            raise APIError(400, "Both 'lora_name' and 'lora_path' must be provided.",
                           type="InvalidUserInput", code="invalid_lora_request")
        if name in self.base_names:
            raise APIError(400, f"The lora adapter '{name}' conflicts with a served base "
                           "model.", type="InvalidUserInput", param="lora_name",
                           code="lora_name_conflict")
        if name in self.adapters:
            raise APIError(400, f"The lora adapter '{name}' has already been loaded. If you "
                           "want to load the adapter in place, set 'load_inplace' to True.",
                           type="InvalidUserInput", param="lora_name",
                           code="lora_already_loaded")
        a = read_adapter(name, path, self.base, self.config.max_lora_rank, self._next_id)
        self._next_id += 1
        self.adapters[name] = a
        self.loads += 1
        return a

    def unregister(self, name: str) -> None:
        if not name:
            raise APIError(400, "'lora_name' needs to be provided to unload a LoRA adapter.",
                           type="InvalidUserInput", code="invalid_lora_request")
        if self.adapters.pop(name, None) is None:
            raise APIError(404, f"The lora adapter '{name}' cannot be found.",
                           type="NotFoundError", param="lora_name", code="lora_not_found")

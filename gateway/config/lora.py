"""A model's ``lora:`` section: the model is a LoRA adapter its endpoints load on demand
(``gateway.routing.adapters``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gateway.config import schema
from gateway.config.decode import Decoder


@dataclass(frozen=True, slots=True)
class Lora:
    path: str  # the adapter's directory as the engine sees it
    max_loaded: int | None = None  # adapters kept loaded on one endpoint (LRU beyond)
    load_ms: float = 200.0  # what a load is expected to cost until measured


def parse_lora(d: Decoder, raw: Any, path: str) -> Lora:
    m = d.mapping(raw, path, schema.keys("lora"), schema.required("lora"))
    return Lora(d.string(m["path"], f"{path}.path"),
                d.integer(m["max_loaded"], f"{path}.max_loaded") if "max_loaded" in m else None,
                d.number(m["load_ms"], f"{path}.load_ms") if "load_ms" in m else 200.0)

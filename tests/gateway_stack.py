"""A gateway (and its reference backends) on loopback, each in its own thread and loop."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

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

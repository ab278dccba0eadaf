"""Real Redis servers for tests: a standalone one and a 3-master cluster, started per session."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

from protocol import loopback


def free_port() -> int:
    """A free port whose +10000 cluster-bus port is free too (``protocol.loopback``)."""
    return loopback.free_port(bus=True)


def _wait(port: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r = subprocess.run(["redis-cli", "-p", str(port), "ping"], capture_output=True,
                           text=True)
        if r.stdout.strip() == "PONG":
            return
        time.sleep(0.05)
    raise RuntimeError(f"redis-server on {port} did not start")


class RedisServer:
    """One redis-server process (no persistence), stoppable and restartable on its port."""

    def __init__(self, workdir: Path, port: int | None = None, *extra: str) -> None:
        if shutil.which("redis-server") is None:
            raise RuntimeError("redis-server is not installed: `make test` installs it "
                               "(apt-get install redis-server)")
        self.port = port or free_port()
        self.workdir = workdir
        self.extra = extra
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.workdir), *self.extra],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _wait(self.port)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(10)
            self.proc = None


class RedisCluster:
    """Three masters, no replicas, slots spread by redis-cli --cluster create."""

    def __init__(self, workdir: Path) -> None:
        self.nodes = []
        for i in range(3):
            port = free_port()
            self.nodes.append(RedisServer(
                workdir / f"n{i}", port, "--cluster-enabled", "yes", "--cluster-config-file",
                f"nodes-{port}.conf", "--cluster-node-timeout", "2000"))
        addrs = [f"127.0.0.1:{n.port}" for n in self.nodes]
        subprocess.run(["redis-cli", "--cluster", "create", *addrs, "--cluster-replicas", "0",
                        "--cluster-yes"], check=True, capture_output=True, timeout=60)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            info = subprocess.run(["redis-cli", "-p", str(self.nodes[0].port), "cluster",
                                   "info"], capture_output=True, text=True).stdout
            if "cluster_state:ok" in info:
                return
            time.sleep(0.1)
        raise RuntimeError("the Redis cluster did not become ready")

    @property
    def url(self) -> str:
        return f"redis+cluster://127.0.0.1:{self.nodes[0].port}"

    def stop(self) -> None:
        for n in self.nodes:
            n.stop()

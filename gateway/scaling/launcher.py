"""Launchers: start and stop the processes that serve a pool (local processes; on Kubernetes
the gateway exports ``tokengate_desired_replicas`` and KEDA scales the Deployment, see
deploy/k8s/keda-scaledobject.yaml).

``reference`` runs this model's reference backend (``tokengate backend`` with the policy's
``backend:`` profile), ``command`` any server whose command line takes the port (``{port}``).
An instance is ready when its ``/health`` answers 200: the reference backend answers 503 while
its weights "load", so a cold start takes as long as the model's weights take to load.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from gateway.config.policy import Model
from gateway.config.scaling import Launcher
from protocol.loopback import free_port


@dataclass(slots=True, eq=False)
class Instance:
    url: str  # the OpenAI base URL, http://127.0.0.1:PORT/v1
    proc: subprocess.Popen[bytes]
    role: str = "both"
    started_at: float = field(default_factory=time.monotonic)
    ready_at: float | None = None
    draining_since: float | None = None

    @property
    def base(self) -> str:
        return self.url.removesuffix("/v1")


class LocalLauncher:
    def __init__(self, model: Model, spec: Launcher, log_dir: Path | None = None) -> None:
        self.model = model
        self.spec = spec
        self.log_dir = log_dir

    def command(self, port: int, role: str) -> list[str]:
        if self.spec.kind == "command":
            return [c.replace("{port}", str(port)) for c in self.spec.command]
        b = self.model.backend
        cmd = [sys.executable, "-m", "tokengate", "backend", "--port", str(port),
               "--model", b.model, "--hardware", b.sim_hardware, "--served-model-name",
               self.model.upstream_name, "--time-scale", str(self.spec.time_scale),
               "--role", role, "--log-level", "warning"]
        if b.max_num_batched_tokens:
            cmd += ["--max-num-batched-tokens", str(b.max_num_batched_tokens)]
        return cmd

    def start(self, role: str = "both") -> Instance:
        port = free_port()
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            with open(self.log_dir / f"{self.model.name}-{port}.log", "wb") as log:
                proc = subprocess.Popen(self.command(port, role), stdout=log, stderr=log)
        else:
            proc = subprocess.Popen(self.command(port, role), stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL)
        return Instance(f"http://127.0.0.1:{port}/v1", proc, role)

    async def ready(self, inst: Instance, session: aiohttp.ClientSession) -> bool:
        """Has ``inst`` become ready (``/health`` 200)? False while it starts."""
        if inst.proc.poll() is not None:
            raise RuntimeError(f"{inst.url}: the process exited with {inst.proc.returncode}")
        try:
            async with session.get(inst.base + "/health",
                                   timeout=aiohttp.ClientTimeout(total=1)) as r:
                return r.status == 200
        except (aiohttp.ClientError, OSError, TimeoutError):
            return False

    async def stop(self, inst: Instance, grace_s: float = 10.0) -> None:
        if inst.proc.poll() is None:
            inst.proc.terminate()
        loop = asyncio.get_running_loop()
        try:
            await asyncio.wait_for(loop.run_in_executor(None, inst.proc.wait), grace_s)
        except TimeoutError:
            inst.proc.kill()
            await loop.run_in_executor(None, inst.proc.wait)

"""Two real vLLM instances for the compatibility tests (one session, shared; ~45 s to start).

Each runs the tiny random-weight Llama (``make vllm``) pinned to its own core, with prefix
caching, KV events over ZMQ (vLLM connects to 127.0.0.1:P, where the gateway binds; its replay
socket binds P+1), the real NixlConnector (``kv_both``, so either can prefill for the other)
and OTLP traces to the session's receiver. Instance 1 also serves LoRA adapters
(``--enable-lora --max-loras 2`` with the runtime load/unload endpoints): a third vLLM beside
these two did not start within four minutes on a 2-core CI machine. If vLLM is not installed
the fixture fails, with the command that installs it: these tests never skip.
"""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
import tempfile
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from engines import vllm
from loadtests.otlp_receiver import OTLPReceiver
from protocol.loopback import free_port

LORA_INSTANCE = 1
LORA_SLOTS = 2
# instance 0 parses tool calls, as an agent's engine does (chat with tools defaults to "auto")
TOOLS = ["--enable-auto-tool-choice", "--tool-call-parser", "pythonic"]


@dataclass
class VllmFleet:
    specs: list[vllm.VllmSpec]
    model: Path
    otlp: OTLPReceiver
    logs: list[Path] = field(default_factory=list)
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def url(self, i: int) -> str:
        return self.specs[i].url

    def metric(self, i: int, name: str) -> float:
        with urllib.request.urlopen(self.url(i) + "/metrics", timeout=5) as r:
            text = r.read().decode()
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(name) and (line[len(name)] in " {"))

    def usage(self, i: int, path: str, body: dict[str, Any]) -> dict[str, Any]:
        req = urllib.request.Request(self.url(i) + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=240) as r:
            return json.loads(r.read())["usage"]  # type: ignore[no-any-return]

    @contextlib.contextmanager
    def logs_on_failure(self, lines: int = 40) -> Iterator[None]:
        """On any exception inside, print each instance's last log lines to stderr (pytest
        shows them with the failure: the engines' view of a request that failed)."""
        try:
            yield
        except BaseException:
            for i, log in enumerate(self.logs):
                tail = log.read_text(errors="replace").splitlines()[-lines:] if log.exists() else []
                print(f"--- vLLM instance {i} ({log}):", *tail, sep="\n", file=sys.stderr)
            raise

    def endpoint(self, i: int, **extra: Any) -> dict[str, Any]:
        ev = self.specs[i].kv_events
        assert ev is not None
        return {"url": self.url(i) + "/v1", "kv_events": {
            "endpoint": ev["endpoint"], "replay": ev["replay"], "topic": ev["topic"]}, **extra}


@pytest.fixture(scope="session")
def vllm_fleet() -> Iterator[VllmFleet]:
    try:
        model = vllm.ensure_model()
    except vllm.VllmUnavailable as exc:
        pytest.fail(str(exc), pytrace=False)
    otlp = OTLPReceiver()
    logs_dir = Path(tempfile.mkdtemp(prefix="tokengate-vllm-"))
    specs = [vllm.VllmSpec(port=free_port(), core=i, kv_events_port=_port_pair(),
                           nixl_port=free_port(), otlp_endpoint=otlp.endpoint,
                           max_loras=LORA_SLOTS if i == LORA_INSTANCE else None,
                           extra_args=TOOLS if i == 0 else [])
             for i in range(2)]
    fleet = VllmFleet(specs, model, otlp)
    try:
        for i, spec in enumerate(specs):
            log = logs_dir / f"vllm-{i}.log"
            fleet.logs.append(log)
            fleet.procs.append(vllm.start(spec, log, model))
        for spec, proc, log in zip(specs, fleet.procs, fleet.logs, strict=True):
            vllm.wait_ready(spec, proc, log)
        yield fleet
    finally:
        for proc in fleet.procs:
            vllm.stop(proc)
        otlp.close()


def _port_pair() -> int:
    """A free port P whose neighbour P+1 (the replay socket) is free too."""
    for _ in range(50):
        p = free_port()
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", p + 1))
            return p
        except OSError:
            continue
    raise RuntimeError("no free port pair")

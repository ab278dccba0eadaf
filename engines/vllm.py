"""Real vLLM instances as child processes: where the install lives, the command, readiness, stop.

The install (``make vllm``: ``engines/install_vllm.sh``) is a virtual environment of its own,
``.venv-vllm`` beside the project's ``.venv`` (``TOKENGATE_VLLM_VENV`` overrides it), and the
tiny random-weight model is built into ``.models/tiny-llama`` (``TOKENGATE_VLLM_MODEL``) by
``engines/in_venv/model.py`` running in that environment. ``VllmSpec`` describes one instance;
``command`` and ``environment`` are the exact ``vllm serve`` invocation:

* CPU: ``--dtype float32 --enforce-eager``, a fixed KV size (``--kv-cache-memory-bytes``,
  without which vLLM claims 92 % of RAM), prefix caching on, OpenMP threads bound to the
  instance's own core (``VLLM_CPU_OMP_THREADS_BIND``);
* KV events over ZMQ (``--kv-events-config``): the publisher address ``tcp://127.0.0.1:P``
  makes vLLM *connect* (the gateway binds there, on loopback only); its replay ROUTER binds
  ``tcp://127.0.0.1:P+1``;
* prefill/decode over the real NixlConnector (``kv_both``, CPU buffers, UCX over TCP on lo and
  a side-channel port of its own);
* OTLP traces (``--otlp-traces-endpoint``) when asked;
* LoRA (``--enable-lora --max-loras N``, rank 8) with vLLM's runtime adapter endpoints
  (``VLLM_ALLOW_RUNTIME_LORA_UPDATING``) when asked; ``build_adapters`` makes random-weight
  adapters for the tiny model.

Nothing here talks to anything but loopback, and nothing is downloaded at run time
(``HF_HUB_OFFLINE``, ``VLLM_NO_USAGE_STATS``).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import zmq

ROOT = Path(__file__).resolve().parent.parent
INSTALL_HINT = ("run 'make vllm' in a checkout (installs real vLLM into .venv-vllm and builds "
                "the tiny model), or point TOKENGATE_VLLM_VENV at a virtual environment made "
                "by engines/install_vllm.sh")


class VllmUnavailable(RuntimeError):
    pass


def venv() -> Path:
    return Path(os.environ.get("TOKENGATE_VLLM_VENV") or ROOT / ".venv-vllm")


def python() -> Path:
    py = venv() / "bin" / "python"
    if not (venv() / ".tokengate-vllm-ok").is_file() or not py.exists():
        raise VllmUnavailable(f"real vLLM is not installed in {venv()}: {INSTALL_HINT}")
    return py


def model_dir() -> Path:
    return Path(os.environ.get("TOKENGATE_VLLM_MODEL") or ROOT / ".models" / "tiny-llama")


def ensure_model() -> Path:
    """Build the tiny model if it is not there yet (a few seconds); its directory."""
    out = model_dir()
    builder = ROOT / "engines" / "in_venv" / "model.py"
    subprocess.run([str(python()), str(builder), str(out)], check=True,
                   stdout=subprocess.DEVNULL)
    return out


def build_adapters(out: Path, names: list[str], model: Path | None = None) -> dict[str, Path]:
    """Random-weight LoRA adapters for the tiny model (``engines/in_venv/lora.py``), by name."""
    model = model or ensure_model()
    builder = ROOT / "engines" / "in_venv" / "lora.py"
    subprocess.run([str(python()), str(builder), str(model), str(out), *names], check=True,
                   stdout=subprocess.DEVNULL)
    return {n: out / n for n in names}


@dataclass(slots=True)
class VllmSpec:
    port: int
    served_name: str = "tiny"
    core: int | None = None  # the CPU this instance's OpenMP threads are bound to
    kv_events_port: int | None = None  # publisher P (gateway binds), replay on P+1
    nixl_port: int | None = None  # NixlConnector side channel: enables prefill/decode
    otlp_endpoint: str | None = None  # e.g. http://127.0.0.1:4318/v1/traces
    max_model_len: int = 2048
    kv_cache_bytes: int = 64 * 1024 * 1024
    extra_args: list[str] = field(default_factory=list)
    # LoRA (--enable-lora): adapters per batch, with the runtime load/unload endpoints on
    max_loras: int | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def kv_events(self) -> dict[str, str] | None:
        if self.kv_events_port is None:
            return None
        return {"endpoint": f"tcp://127.0.0.1:{self.kv_events_port}",
                "replay": f"tcp://127.0.0.1:{self.kv_events_port + 1}", "topic": "kv"}

    def command(self, model: Path) -> list[str]:
        cmd = [str(python()), str(ROOT / "engines" / "in_venv" / "launch.py"), "serve", str(model),
               "--served-model-name", self.served_name, "--host", "127.0.0.1",
               "--port", str(self.port), "--dtype", "float32", "--enforce-eager",
               "--enable-prefix-caching", "--max-model-len", str(self.max_model_len),
               "--kv-cache-memory-bytes", str(self.kv_cache_bytes),
               "--disable-uvicorn-access-log"]
        ev = self.kv_events
        if ev is not None:
            cmd += ["--kv-events-config", json.dumps({
                "enable_kv_cache_events": True, "publisher": "zmq",
                "endpoint": ev["endpoint"], "replay_endpoint": ev["replay"],
                "topic": ev["topic"]})]
        if self.nixl_port is not None:
            cmd += ["--kv-transfer-config", json.dumps({
                "kv_connector": "NixlConnector", "kv_role": "kv_both",
                "kv_buffer_device": "cpu"})]
        if self.otlp_endpoint:
            cmd += ["--otlp-traces-endpoint", self.otlp_endpoint]
        if self.max_loras is not None:
            cmd += ["--enable-lora", "--max-loras", str(self.max_loras), "--max-lora-rank", "8"]
        return cmd + self.extra_args

    def environment(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("VIRTUAL_ENV", "PYTHONPATH", "OTEL_"))}
        env.update({
            "VLLM_TARGET_DEVICE": "cpu", "VLLM_HOST_IP": "127.0.0.1",
            "VLLM_CPU_OMP_THREADS_BIND": str(self.core) if self.core is not None else "auto",
            "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1", "VLLM_LOGGING_LEVEL": "WARNING",
            "TOKENIZERS_PARALLELISM": "false",
        })
        if self.nixl_port is not None:
            env.update({"UCX_TLS": "tcp,self,sm", "UCX_NET_DEVICES": "lo",
                        "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
                        "VLLM_NIXL_SIDE_CHANNEL_PORT": str(self.nixl_port)})
        if self.max_loras is not None:
            env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
        if self.otlp_endpoint:
            env["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] = "http/protobuf"
            env["OTEL_SERVICE_NAME"] = f"vllm-{self.port}"
        return env


def start(spec: VllmSpec, log: Path, model: Path | None = None) -> subprocess.Popen[bytes]:
    """Start one instance (its own process group, so a stop reaches vLLM's engine core too)."""
    model = model or ensure_model()
    with open(log, "ab") as out:
        return subprocess.Popen(spec.command(model), stdout=out, stderr=subprocess.STDOUT,
                                env=spec.environment(), start_new_session=True,
                                stdin=subprocess.DEVNULL)


def wait_ready(spec: VllmSpec, proc: subprocess.Popen[bytes], log: Path,
               timeout_s: float = 240.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace")[-3000:] if log.exists() else ""
            raise VllmUnavailable(f"vLLM on port {spec.port} exited with {proc.returncode}:\n"
                                  f"{tail}")
        try:
            with urllib.request.urlopen(spec.url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise VllmUnavailable(f"vLLM on port {spec.port} was not ready in {timeout_s:.0f}s "
                          f"(log: {log})")


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (from /proc): vLLM's worker processes leave its process
    group, and an orphaned worker spins its OpenMP threads on its core forever."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    out: list[int] = []
    todo = [pid]
    while todo:
        for c in children.get(todo.pop(), ()):
            out.append(c)
            todo.append(c)
    return out


def stop(proc: subprocess.Popen[bytes], timeout_s: float = 15.0) -> None:
    """SIGTERM to the instance (API server, engine core, workers), then KILL whatever of its
    process tree is still there."""
    if proc.poll() is not None:
        return
    tree = _descendants(proc.pid)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    deadline = time.monotonic() + 5
    for pid in tree:
        while time.monotonic() < deadline and Path(f"/proc/{pid}").exists():
            time.sleep(0.05)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)  # a straggler that outlived its parent


def reported_blocks(spec: VllmSpec, medium: str = "GPU") -> set[Any]:
    """The blocks an instance holds by its own account: every batch its replay socket still
    keeps, applied in order (what a subscriber that missed nothing would know)."""
    ev = spec.kv_events
    if ev is None:
        raise ValueError("this instance publishes no KV events")
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(ev["replay"])
    dealer.send_multipart([b"", (0).to_bytes(8, "big")])
    held: set[Any] = set()
    try:
        while True:
            if not dealer.poll(5000):
                raise VllmUnavailable(f"the replay socket {ev['replay']} did not answer")
            _, _, seq, payload = dealer.recv_multipart()
            if seq == (-1).to_bytes(8, "big", signed=True):
                return held
            for e in msgpack.unpackb(payload, strict_map_key=False)[1]:
                if e["type"] == "AllBlocksCleared":
                    held.clear()
                elif (e.get("medium") or "GPU") != medium:
                    continue
                elif e["type"] == "BlockStored":
                    held.update(e["block_hashes"])
                elif e["type"] == "BlockRemoved":
                    held.difference_update(e["block_hashes"])
    finally:
        dealer.close(0)
        ctx.term()

"""The peers tokengate is measured against, installed from PyPI into a cache venv of their own
(``.venv-peers``, the first time one is asked for) and started on loopback.

* vllm-router 0.1.17 (Rust; vLLM's production-stack router): ``vllm-router``;
* sglang-router 0.3.2 (Rust; SGLang's router): ``python -m sglang_router.launch_router``;
* LiteLLM's proxy (Python): ``litellm --config``.

Each is started with the policy it is compared under, its metrics listener bound to loopback,
and waited for on ``/health`` (the routers probe their workers' ``/health`` before they
route: the upstream must answer it).
"""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path

import yaml

from protocol.loopback import free_port

ROOT = Path(__file__).resolve().parent.parent
PEERS = ROOT / ".venv-peers"
PACKAGES = {"vllm-router": "vllm-router==0.1.17", "sglang-router": "sglang-router==0.3.2",
            "litellm": "litellm[proxy]>=1.108,<1.109"}


def peer_python(*names: str) -> Path:
    """The peers' venv, with the packages of ``names`` installed (each once)."""
    py = PEERS / "bin" / "python"
    if not py.exists():
        subprocess.run([sys.executable, "-m", "venv", str(PEERS)], check=True)
    for name in names:
        stamp = PEERS / f".{name}"
        if stamp.exists() and stamp.read_text() == PACKAGES[name]:
            continue
        subprocess.run([str(py), "-m", "pip", "install", "-q", PACKAGES[name]], check=True)
        stamp.write_text(PACKAGES[name])
    return py


def _launch(cmd: list[str], port: int, log: Path, what: str, health: str = "/health",
            timeout_s: float = 60.0) -> tuple[subprocess.Popen[bytes], str]:
    """Start ``cmd`` (output to ``log``), wait for its ``health`` page on ``port``; the
    process and its /v1 base URL."""
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
    _wait(proc, f"http://127.0.0.1:{port}{health}", log, what, timeout_s)
    return proc, f"http://127.0.0.1:{port}/v1"


def _wait(proc: subprocess.Popen[bytes], url: str, log: Path, what: str,
          timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            break
        try:
            with urllib.request.urlopen(url, timeout=1):
                return
        except OSError:
            time.sleep(0.3)
    proc.kill()
    raise RuntimeError(f"{what} did not start: {log.read_text()[-2000:]}")


def start_sglang(workers: Sequence[str], log: Path, policy: str = "cache_aware"
                 ) -> tuple[subprocess.Popen[bytes], str]:
    """sglang-router over ``workers`` (base URLs without /v1); returns it and its /v1 URL."""
    py = peer_python("sglang-router")
    port = free_port()
    return _launch([str(py), "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
                    "--port", str(port), "--policy", policy, "--prometheus-host", "127.0.0.1",
                    "--prometheus-port", str(free_port()), "--log-level", "warn",
                    "--worker-urls", *workers], port, log, "sglang-router")


def start_vllm_router(workers: Sequence[str], log: Path, policy: str = "round_robin"
                      ) -> tuple[subprocess.Popen[bytes], str]:
    py = peer_python("vllm-router")
    port = free_port()
    return _launch([str(py.parent / "vllm-router"), "--host", "127.0.0.1", "--port", str(port),
                    "--policy", policy, "--prometheus-host", "127.0.0.1",
                    "--prometheus-port", str(free_port()), "--log-level", "warning",
                    "--worker-urls", *workers], port, log, "vllm-router")


def start_litellm(workers: Sequence[str], log: Path, master_key: str, model: str = "m"
                  ) -> tuple[subprocess.Popen[bytes], str]:
    """LiteLLM's proxy with one deployment per worker (its simple-shuffle routing), clients
    authenticating with ``master_key``."""
    py = peer_python("litellm")
    port = free_port()
    config = log.with_suffix(".yaml")
    config.write_text(yaml.safe_dump({
        "model_list": [{"model_name": model, "litellm_params": {
            "model": f"openai/{model}", "api_base": f"{w}/v1", "api_key": "none"}}
            for w in workers],
        "litellm_settings": {"telemetry": False, "drop_params": True},
        "general_settings": {"master_key": master_key}}))
    return _launch([str(py.parent / "litellm"), "--config", str(config), "--host", "127.0.0.1",
                    "--port", str(port), "--num_workers", "1"], port, log, "litellm",
                   "/health/liveliness", 180.0)

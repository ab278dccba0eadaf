"""Policy files: the shipped examples validate; every error names file, path and reason."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway.config.policy import PolicyError, load_policy, parse_policy
from gateway.examples import POLICIES
from gateway.quota.ledger import _duration, charges, rate_limit_error, ratelimit_headers
from gateway.quota.limiter.bucket import Limit
from gateway.quota.limiter.store import BucketState, Decision


@pytest.mark.parametrize("name", ["demo.yaml", "multi-tenant.yaml", "prefill-decode.yaml",
                                  "serverless.yaml"])
def test_shipped_policies_validate(name: str) -> None:
    p = load_policy(POLICIES / name)
    assert p.models and p.tenants and p.routes


def test_demo_policy_is_what_up_promises() -> None:
    p = load_policy(POLICIES / "demo.yaml")
    assert len(p.models["demo-large"].endpoints) >= 2
    assert p.models["demo-large"].fallback == ("demo-small",)
    assert p.tenants["demo"].model_limits["demo-large"].tpm == 20000
    assert hashlib.sha256(b"tg-demo-key").hexdigest() in p.key_index
    mt = load_policy(POLICIES / "multi-tenant.yaml")
    for key in ("acme-key-1", "acme-key-2", "globex-key"):
        assert hashlib.sha256(key.encode()).hexdigest() in mt.key_index


def base() -> dict[str, Any]:
    return yaml.safe_load((POLICIES / "demo.yaml").read_text())


@pytest.mark.parametrize(("mutate", "message"), [
    (lambda d: d.update(extra=1), r"<root>\.extra|extra: unknown key"),
    (lambda d: d["models"]["demo-large"].update(fallbak=["x"]),
     r"models\.demo-large\.fallbak: unknown key"),
    (lambda d: d["models"]["demo-large"].update(fallback=["nope"]),
     r"models\.demo-large\.fallback\[0\]: unknown model 'nope'"),
    (lambda d: d["models"]["demo-small"].update(fallback=["demo-large"]), r"fallback cycle"),
    (lambda d: d["tenants"]["demo"]["model_limits"]["demo-large"].update(tpm=-5),
     r"tenants\.demo\.model_limits\.demo-large\.tpm: must be positive"),
    (lambda d: d["tenants"]["demo"]["keys"][0].update(sha256="abc"),
     r"tenants\.demo\.keys\[0\]\.sha256: expected the key's SHA-256"),
    (lambda d: d["routes"]["demo"].update(tenants=["ghost"]),
     r"routes\.demo\.tenants\[0\]: unknown tenant 'ghost'"),
    (lambda d: d["models"]["demo-large"]["endpoints"][0].update(url="ftp://x"),
     r"endpoints\[0\]\.url: expected an http\(s\) URL"),
    (lambda d: d["settings"].update(redis_failure="maybe"),
     r"settings\.redis_failure: expected fail_open or fail_closed"),
    (lambda d: d["tenants"].update(other={"keys": d["tenants"]["demo"]["keys"]}),
     r"already given to tenant 'demo'"),
    (lambda d: d["tenants"].update(lonely={"keys": [{"sha256": "b" * 64}]}),
     r"tenants\.lonely: no route includes this tenant"),
    (lambda d: d["tenants"]["demo"].update(limits={"burst": 10}), r"burst applies to tpm"),
    (lambda d: d["models"]["demo-large"].update(kv_pool={"url": "http://u:p@h:1"}),
     r"kv_pool\.url: expected an http\(s\) URL without credentials"),
    (lambda d: d["models"]["demo-large"].update(backend={"kv_pool_gb": 10}),
     r"backend\.kv_pool_gb: needs the model's kv_pool"),
    (lambda d: d["models"]["demo-large"].update(backend={"kv_offload_gb": -1}),
     r"backend\.kv_offload_gb: must not be negative"),
    (lambda d: d["models"]["demo-large"].update(routing={"kv_tiers": "yes"}),
     r"routing\.kv_tiers: expected true or false"),
])
def test_errors_name_the_path(mutate: Any, message: str) -> None:
    doc = base()
    mutate(doc)
    with pytest.raises(PolicyError, match=message) as e:
        parse_policy(doc, "p.yaml")
    assert str(e.value).startswith("p.yaml: ")


def test_unreadable_and_invalid_yaml(tmp_path: Path) -> None:
    with pytest.raises(PolicyError, match="cannot read"):
        load_policy(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("models: [unclosed\n")
    with pytest.raises(PolicyError, match=r"bad\.yaml: not valid YAML"):
        load_policy(bad)


def test_charges_cover_every_scope_with_limits() -> None:
    p = load_policy(POLICIES / "multi-tenant.yaml")
    route = p.routes["acme-all"]
    cs = charges(p, "acme", route, p.models["large"], 1000, 500)
    by = {(c.scope, c.limit.kind): c.cost for c in cs}
    assert by[("tenant:acme", "requests")] == 1
    assert by[("tenant:acme", "tokens_day")] == 1500
    assert by[("tenant:acme", "budget")] == pytest.approx(1000 * 0.0027 / 1000
                                                          + 500 * 0.0035 / 1000)
    assert by[("tenant:acme|model:large", "tokens")] == 1500
    assert by[("model:large", "tokens")] == 1500
    assert not any(s.startswith("route:") for s, _ in by)  # acme-all has no limits
    burst = next(c.limit for c in cs if c.scope == "tenant:acme|model:large")
    assert burst.burst == 300000 and burst.amount == 200000


def test_header_and_error_formatting() -> None:
    assert [_duration(x) for x in (0.02, 1.0, 59.2, 360, 3725)] == \
        ["20ms", "1s", "1m0s", "6m0s", "1h2m5s"]
    tok = Limit("tokens", 1000, 60, 1000)
    req = Limit("requests", 10, 60, 10)
    states = (BucketState("tenant:a", tok, 100, 54), BucketState("model:m", tok, 900, 6),
              BucketState("tenant:a", req, 3, 42))
    h = ratelimit_headers(states)
    assert h == {"x-ratelimit-limit-requests": "10", "x-ratelimit-remaining-requests": "3",
                 "x-ratelimit-reset-requests": "42s", "x-ratelimit-limit-tokens": "1000",
                 "x-ratelimit-remaining-tokens": "100", "x-ratelimit-reset-tokens": "54s"}
    denied = BucketState("tenant:a", tok, 100, 54, requested=300, retry_after_s=12.3)
    err = rate_limit_error(Decision(False, None, states, denied))
    assert err.status == 429 and err.code == "rate_limit_exceeded" and err.type == "tokens"
    assert err.headers["retry-after"] == "13" and err.headers["retry-after-ms"] == "12300"
    assert "limit 1000, used 900, requested 300" in err.message
    money = BucketState("tenant:a", Limit("budget", 5, 86400, 5), 0.01, 3600,
                        requested=0.02, retry_after_s=60)
    err = rate_limit_error(Decision(False, None, (money,), money))
    assert err.status == 429 and err.type == "dollars" and err.code == "budget_exceeded"
    assert "dollars per day" in err.message


def test_a_reload_that_fails_unexpectedly_is_logged_counted_and_survived(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
        ) -> None:
    import time

    from gateway_stack import start_gateway, write_policy

    from gateway.front import reload

    doc = {"version": 1, "models": {"m": {"endpoints": [{"url": "http://127.0.0.1:9/v1"}]}},
           "tenants": {"t": {"keys": [{"sha256": "0" * 64}]}},
           "routes": {"r": {"tenants": ["t"], "models": ["m"]}}}
    path = write_policy(tmp_path / "p.yaml", doc)
    gw = start_gateway(path)
    try:
        def boom(_: object) -> None:
            raise RuntimeError("tokenizer exploded")

        monkeypatch.setattr(reload, "load_policy", boom)
        time.sleep(0.05)
        path.write_text(path.read_text() + "\n")
        counter = gw.state.metrics.policy_reloads.labels("error")
        deadline = time.monotonic() + 5
        while counter._value.get() < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert counter._value.get() == 1
        assert gw.watcher.last_error == "RuntimeError: tokenizer exploded"
        assert any("policy reload failed" in r.getMessage() for r in caplog.records)
        monkeypatch.undo()  # the watcher still runs: the next change is applied
        doc["models"]["m"]["default_max_tokens"] = 7  # type: ignore[index]
        time.sleep(0.05)
        write_policy(path, doc)
        while gw.state.view.policy.models["m"].default_max_tokens != 7 and \
                time.monotonic() < deadline + 5:
            time.sleep(0.05)
        assert gw.state.view.policy.models["m"].default_max_tokens == 7
    finally:
        gw.close()

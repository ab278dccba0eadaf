"""The gateway in front of engines that host several models each (``tokengate backend
--models``): it reads which models each engine has resident and what switching costs, and
routes a request where its model waits least."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai
from conftest import RunningBackend
from gateway_stack import start_gateway, write_policy
from test_gateway_e2e import sha

from backend.pooling import PoolingConfig

Factory = Callable[..., RunningBackend]
PROFILES = "models:\n  big-20b:\n    base: llama-3-8b\n    params: 2.0e10\n"


def policy(urls: list[str]) -> dict[str, Any]:
    model = {"endpoints": [{"url": u} for u in urls], "backend": {"model": "llama-3-8b"},
             "routing": {"strategy": "predicted"}}
    return {"version": 1, "settings": {"admin_key_sha256": sha("admin-key"),
                                       "expose_endpoints": True},
            "models": {"alpha": dict(model), "beta": dict(model)},
            "tenants": {"a": {"keys": [{"sha256": sha("key-a")}], "limits": {"tpm": 1e7}}},
            "routes": {"r": {"tenants": ["a"], "models": ["alpha", "beta"]}}}


def test_requests_go_where_their_model_is_resident(backend_factory: Factory,
                                                    tmp_path: Path) -> None:
    f = tmp_path / "profiles.yaml"
    f.write_text(PROFILES)
    pooling = PoolingConfig((("alpha", "big-20b"), ("beta", "big-20b")), "token")
    b1, b2 = (backend_factory(profiles_file=str(f), time_scale=0.2, pooling=pooling)
              for _ in range(2))
    # b2 switches to beta (its weights replace alpha's: one 40 GB model fits at a time)
    r = httpx.post(f"{b2.url}/v1/completions", json={"model": "beta", "prompt": "x",
                                                     "max_tokens": 1}, timeout=30)
    assert r.status_code == 200
    gw = start_gateway(write_policy(tmp_path / "policy.yaml", policy(
        [f"{b1.url}/v1", f"{b2.url}/v1"])))
    try:
        admin = {"Authorization": "Bearer admin-key"}
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            eps = httpx.get(f"{gw.url}/admin/endpoints", headers=admin).json()["beta"][
                "endpoints"]
            if [e["resident_models"] for e in eps] == [["alpha"], ["beta"]]:
                break
            time.sleep(0.05)
        assert [e["resident_models"] for e in eps] == [["alpha"], ["beta"]]
        assert eps[0]["model_wait_s"]["beta"] > 0.8 and eps[1]["model_wait_s"]["beta"] == 0
        c = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="key-a", max_retries=0)
        for model, home in (("beta", b2), ("alpha", b1), ("beta", b2), ("alpha", b1)):
            raw = c.chat.completions.with_raw_response.create(
                model=model, max_tokens=2, messages=[{"role": "user", "content": "hi"}])
            assert raw.headers["x-tokengate-endpoint"] == f"{home.url}/v1", model
            assert raw.parse().model == model
        assert b1.state.engine.mux.stats.switches == 0  # nobody paid a switch
        assert b2.state.engine.mux.stats.switches == 1  # beta's, before the gateway
    finally:
        gw.close()

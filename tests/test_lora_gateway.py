"""LoRA adapters through the gateway: loaded on demand where a request goes, kept where they
are used (affinity), the least recently used unloaded beyond ``lora.max_loaded``, and a load
the engine refuses answered in OpenAI's shape without taking the endpoint out."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from conftest import RunningBackend
from gateway_stack import start_gateway, write_policy
from test_gateway_e2e import sha
from test_lora_backend import adapter

from backend.lora import RUNTIME_ENV, LoraConfig

Factory = Callable[..., RunningBackend]
ADMIN = {"Authorization": "Bearer admin-key"}


def policy(urls: list[str], paths: dict[str, str]) -> dict[str, Any]:
    eps = [{"url": u} for u in urls]
    models: dict[str, Any] = {"llama-3-8b": {"endpoints": eps}}
    for name, path in paths.items():
        models[name] = {"endpoints": eps, "lora": {"path": path, "max_loaded": 1}}
    return {"version": 1, "settings": {"admin_key_sha256": sha("admin-key"),
                                       "expose_endpoints": True},
            "models": models,
            "tenants": {"a": {"keys": [{"sha256": sha("key-a")}], "limits": {"tpm": 1e7}}},
            "routes": {"r": {"tenants": ["a"], "models": list(models)}}}


def held(b: RunningBackend) -> set[str]:
    return set(httpx.get(f"{b.url}/admin/state").json()["lora"]["adapters"])


def test_adapters_load_on_demand_with_affinity_and_lru(backend_factory: Factory,
                                                       tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch
                                                       ) -> None:
    monkeypatch.setenv(RUNTIME_ENV, "True")
    bs = [backend_factory(lora=LoraConfig(2, 16), max_loras=2) for _ in range(2)]
    paths = {"sql": adapter(tmp_path, "sql"), "poetry": adapter(tmp_path, "poetry"),
             "broken": str(tmp_path / "missing")}
    gw = start_gateway(write_policy(tmp_path / "policy.yaml", policy(
        [f"{b.url}/v1" for b in bs], paths)))
    try:
        c = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="key-a", max_retries=0)

        def ask(model: str) -> str:
            raw = c.chat.completions.with_raw_response.create(
                model=model, max_tokens=2, messages=[{"role": "user", "content": "hi"}])
            r = raw.parse()
            assert r.model == model and r.usage is not None
            return raw.headers["x-tokengate-endpoint"]

        home = ask("sql")
        b_sql = next(b for b in bs if f"{b.url}/v1" == home)
        assert held(b_sql) == {"sql"}
        assert [ask("sql") for _ in range(3)] == [home] * 3  # affinity: no second load
        assert sum("sql" in held(b) for b in bs) == 1
        ask("poetry")
        for _ in range(3):
            ask("sql")
            ask("poetry")
        for b in bs:
            assert len(held(b)) <= 1  # max_loaded: the least recently used went
        loader = gw.state.fleet.adapters
        assert loader.loads >= 2 and loader.failures == 0

        with pytest.raises(openai.APIStatusError) as exc:
            c.chat.completions.create(model="broken", max_tokens=2,
                                      messages=[{"role": "user", "content": "hi"}])
        assert exc.value.status_code == 502
        err = exc.value.body
        assert isinstance(err, dict) and err["code"] == "adapter_load_failed"
        assert "broken" in err["message"] and str(tmp_path) not in err["message"]
        eps = httpx.get(f"{gw.url}/admin/endpoints", headers=ADMIN).json()["sql"]["endpoints"]
        assert all(e["healthy"] for e in eps)  # the engines are fine; the adapter is not
        ask("sql")
    finally:
        gw.close()


def test_a_failing_adapter_is_loaded_once_and_answered_from_memory(
        backend_factory: Factory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """21 requests for an adapter whose load fails, 5 of them at once: one load call per
    backoff window (the concurrent ones share it; 1 s, doubling), the rest answered the same
    502 from the remembered failure. (Counted against the time the requests took: on a
    loaded machine 21 requests may outlast the first window.)"""
    from concurrent.futures import ThreadPoolExecutor

    monkeypatch.setenv(RUNTIME_ENV, "True")
    b = backend_factory(lora=LoraConfig(2, 16), max_loras=2)
    gw = start_gateway(write_policy(tmp_path / "policy.yaml", policy(
        [f"{b.url}/v1"], {"broken": str(tmp_path / "missing")})))
    try:
        def ask(_: int) -> int:
            r = httpx.post(f"{gw.url}/v1/chat/completions", timeout=30,
                           headers={"Authorization": "Bearer key-a"},
                           json={"model": "broken", "max_tokens": 2,
                                 "messages": [{"role": "user", "content": "hi"}]})
            assert r.json()["error"]["code"] == "adapter_load_failed"
            return r.status_code

        def loads_allowed(since: float) -> int:
            """A new load only when the remembered failure's backoff (1 s, then 2, 4, …)
            has run out: at most this many load calls in the time since ``since``."""
            return 1 + int(math.log2(time.monotonic() - since + 1))

        t0 = time.monotonic()
        with ThreadPoolExecutor(5) as pool:
            assert list(pool.map(ask, range(5))) == [502] * 5
        assert 1 <= gw.state.fleet.adapters.failures <= loads_allowed(t0)
        assert [ask(i) for i in range(16)] == [502] * 16
        assert 1 <= gw.state.fleet.adapters.failures <= loads_allowed(t0)  # not 21
    finally:
        gw.close()


def test_an_adapter_in_use_is_never_unloaded(backend_factory: Factory, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """max_loaded 1 on one endpoint: while a stream of ``sql`` runs, ``poetry`` is loaded
    beside it (sql is held); once the stream has ended, the next load unloads the least
    recently used one nobody holds."""
    monkeypatch.setenv(RUNTIME_ENV, "True")
    b = backend_factory(lora=LoraConfig(3, 16), max_loras=3, time_scale=1.0)
    paths = {"sql": adapter(tmp_path, "sql"), "poetry": adapter(tmp_path, "poetry"),
             "haiku": adapter(tmp_path, "haiku")}
    gw = start_gateway(write_policy(tmp_path / "policy.yaml", policy([f"{b.url}/v1"], paths)))
    try:
        c = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="key-a", max_retries=0)
        stream = c.chat.completions.create(model="sql", max_tokens=60, stream=True,
                                           messages=[{"role": "user", "content": "hi"}])
        next(iter(stream))  # sql is loaded and its stream is running
        loader = gw.state.fleet.adapters
        assert loader.hold_count(f"{b.url}/v1", "sql") == 1
        c.chat.completions.create(model="poetry", max_tokens=1,
                                  messages=[{"role": "user", "content": "hi"}])
        assert held(b) == {"sql", "poetry"}  # one over max_loaded: sql was in use
        for _ in stream:
            pass
        stream.close()
        # the hold goes when the gateway's handler ends, just after the stream's last bytes
        deadline = time.monotonic() + 5
        while loader.hold_count(f"{b.url}/v1", "sql") and time.monotonic() < deadline:
            time.sleep(0.01)
        assert loader.hold_count(f"{b.url}/v1", "sql") == 0
        c.chat.completions.create(model="haiku", max_tokens=1,
                                  messages=[{"role": "user", "content": "hi"}])
        assert held(b) == {"haiku"}  # nobody holds the other two any more
    finally:
        gw.close()

"""``tokengate backend --models``: several models behind one OpenAI endpoint, switched on the
engine loop's timeline, seen by operators in /metrics and /admin/state."""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from conftest import RunningBackend

from backend.pooling import PoolingConfig
from roofline.profiles import HARDWARE

Factory = Callable[..., RunningBackend]
PROFILES = "models:\n  big-20b:\n    base: llama-3-8b\n    params: 2.0e10\n"


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


@pytest.fixture
def two_big(backend_factory: Factory, tmp_path: Path) -> RunningBackend:
    f = tmp_path / "profiles.yaml"
    f.write_text(PROFILES)
    return backend_factory(profiles_file=str(f), time_scale=0.05, pooling=PoolingConfig(
        (("alpha", "big-20b"), ("beta", "big-20b")), "token"))


def test_two_models_on_one_instance_with_the_openai_client(two_big: RunningBackend) -> None:
    c = openai.OpenAI(base_url=f"{two_big.url}/v1", api_key="unused", max_retries=0)
    assert [m.id for m in c.models.list().data] == ["alpha", "beta"]
    for name in ("alpha", "beta", "alpha"):
        r = c.chat.completions.create(model=name, max_tokens=5, messages=[
            {"role": "user", "content": "hello"}])
        assert r.model == name and r.usage is not None and r.usage.completion_tokens >= 1
    with pytest.raises(openai.NotFoundError) as exc:
        c.chat.completions.create(model="gamma", max_tokens=5, messages=[
            {"role": "user", "content": "hello"}])
    assert exc.value.body["code"] == "model_not_found"  # type: ignore[index]
    state = get_json(f"{two_big.url}/admin/state")["pooling"]
    assert state["mode"] == "token" and state["switches"] == 2  # alpha -> beta -> alpha
    assert state["models"]["alpha"]["resident"] and not state["models"]["beta"]["resident"]


def test_a_switch_takes_the_weights_transfer_on_the_engine_timeline(
        two_big: RunningBackend) -> None:
    """beta is not resident: its first token comes after 40 GB / 50 GB/s + 10 ms of modelled
    time (0.81 s, x0.05 time scale) on top of the prefill."""
    switch = 40e9 / HARDWARE["h100-sxm"].pcie_bandwidth + 0.010
    body = {"model": "beta", "max_tokens": 1, "messages": [{"role": "user", "content": "x"}]}
    t0 = time.perf_counter()
    r = httpx.post(f"{two_big.url}/v1/chat/completions", json=body, timeout=30)
    took = time.perf_counter() - t0
    assert r.status_code == 200
    assert took >= switch * 0.05
    state = get_json(f"{two_big.url}/admin/state")["pooling"]
    assert state["switch_s"] == pytest.approx(switch)
    assert state["models"]["beta"]["switches"] == 1
    metrics = httpx.get(f"{two_big.url}/metrics").text
    assert 'tokengate_backend_model_resident{engine="0",model_name="beta"} 1.0' in metrics
    assert 'tokengate_backend_model_resident{engine="0",model_name="alpha"} 0.0' in metrics
    assert 'vllm:num_requests_waiting{engine="0",model_name="alpha"} 0.0' in metrics
    assert 'tokengate_backend_model_switches_total{engine="0",model_name="beta"} 1.0' in metrics

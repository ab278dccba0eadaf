"""LoRA adapters on the reference backend: served as their own ``model``, registered at start
or through vLLM's runtime endpoints (same answers and errors as vLLM 0.32), at most
``max_loras`` adapters per batch."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from conftest import RunningBackend

from backend.block_pool import BlockPool
from backend.kv_manager import KVCacheManager
from backend.lora import RUNTIME_ENV, LoraConfig
from backend.request import Request
from backend.scheduler import Scheduler, SchedulerConfig

Factory = Callable[..., RunningBackend]


def adapter(root: Path, name: str, rank: int = 8) -> str:
    d = root / name
    d.mkdir()
    (d / "adapter_config.json").write_text(json.dumps(
        {"r": rank, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"],
         "peft_type": "LORA"}))
    return str(d)


@pytest.fixture
def lora_backend(backend_factory: Factory, tmp_path: Path,
                 monkeypatch: pytest.MonkeyPatch) -> RunningBackend:
    monkeypatch.setenv(RUNTIME_ENV, "True")
    return backend_factory(lora=LoraConfig(1, 16, (("sql", adapter(tmp_path, "sql")),)),
                           max_loras=1)


def post(b: RunningBackend, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{b.url}{path}", json=body, timeout=10)


def test_adapters_are_models_loaded_and_unloaded_at_run_time(lora_backend: RunningBackend,
                                                              tmp_path: Path) -> None:
    b = lora_backend
    c = openai.OpenAI(base_url=f"{b.url}/v1", api_key="unused", max_retries=0)
    cards = {m.id: m for m in c.models.list().data}
    assert set(cards) == {"llama-3-8b", "sql"}
    assert cards["sql"].parent == "llama-3-8b"  # type: ignore[attr-defined]
    r = c.chat.completions.create(model="sql", max_tokens=3,
                                  messages=[{"role": "user", "content": "select"}])
    assert r.model == "sql"
    with pytest.raises(openai.NotFoundError):
        c.chat.completions.create(model="poetry", max_tokens=3,
                                  messages=[{"role": "user", "content": "x"}])
    ok = post(b, "/v1/load_lora_adapter", {"lora_name": "poetry",
                                            "lora_path": adapter(tmp_path, "poetry")})
    assert ok.status_code == 200 and ok.text == "Success: LoRA adapter 'poetry' added " \
        "successfully."
    r = c.chat.completions.create(model="poetry", max_tokens=3,
                                  messages=[{"role": "user", "content": "a verse"}])
    assert r.model == "poetry"
    state = httpx.get(f"{b.url}/admin/state").json()["lora"]
    # rank 8 on q (4096x4096) and v (4096x1024), 32 layers, 2 bytes
    assert state["adapters"]["poetry"]["bytes"] == 8 * (8192 + 5120) * 32 * 2
    for body, status, code in (
            ({"lora_name": "poetry", "lora_path": "/x"}, 400, "lora_already_loaded"),
            ({"lora_name": "ghost", "lora_path": str(tmp_path / "none")}, 404,
             "lora_not_found"),
            ({"lora_name": "wide", "lora_path": adapter(tmp_path, "wide", 64)}, 400,
             "lora_rank_too_large"),
            ({"lora_name": "llama-3-8b", "lora_path": "/x"}, 400, "lora_name_conflict"),
            ({"lora_name": "x"}, 400, "invalid_lora_request")):
        bad = post(b, "/v1/load_lora_adapter", body)
        assert bad.status_code == status, body
        err = bad.json()["error"]
        assert err["code"] == code and set(err) == {"message", "type", "param", "code"}
    assert post(b, "/v1/unload_lora_adapter", {"lora_name": "ghost"}).status_code == 404
    gone = post(b, "/v1/unload_lora_adapter", {"lora_name": "poetry"})
    assert gone.status_code == 200 and "removed" in gone.text
    with pytest.raises(openai.NotFoundError):
        c.chat.completions.create(model="poetry", max_tokens=3,
                                  messages=[{"role": "user", "content": "x"}])
    assert 'vllm:lora_requests_info{max_lora="1"' in httpx.get(f"{b.url}/metrics").text


def test_runtime_endpoints_need_vllms_switch(backend_factory: Factory, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(RUNTIME_ENV, raising=False)
    b = backend_factory(lora=LoraConfig(), max_loras=1)
    r = post(b, "/v1/load_lora_adapter", {"lora_name": "p", "lora_path": adapter(tmp_path,
                                                                                   "p")})
    assert r.status_code == 404


def test_a_batch_holds_at_most_max_loras_adapters() -> None:
    pool = BlockPool(1000)
    s = Scheduler(SchedulerConfig(8192, 256, 16, max_loras=1), KVCacheManager(pool, 16, 1))
    reqs = [Request(f"r{i}", [i + 1] * 32, 4, 4, 0.0, lora=lo)
            for i, lo in enumerate(("a", "b", "a", None))]
    for r in reqs:
        s.add(r)
    plan = s.schedule(0.0)
    assert [r.request_id for r, _, _ in plan.scheduled] == ["r0", "r2", "r3"]  # b waits
    assert [r.request_id for r in s.waiting] == ["r1"]

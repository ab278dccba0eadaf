"""The reference backend started exactly as ``tokengate up`` starts it (``stack.up``: the
profile, ``--served-model-name``, the role and time scale), every route called, and the
gateway's scrape reading what it needs from it: ``/v1/models`` answered a 500 whenever
``--served-model-name`` was set, so the gateway never learnt the engine's context length."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import httpx
import pytest
from conftest import scrape_once, wait_healthy

from protocol.loopback import free_port


@pytest.fixture
def served() -> Iterator[str]:
    port = free_port()
    p = subprocess.Popen([sys.executable, "-m", "tokengate", "backend", "--host", "127.0.0.1",
                          "--port", str(port), "--hardware", "h100-sxm", "--time-scale",
                          "0.05", "--role", "both", "--model", "llama-3-8b",
                          "--served-model-name", "demo-large", "--load-bandwidth", "1e6",
                          "--max-model-len", "4096"])
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, timeout=60)
        yield url
    finally:
        p.terminate()
        p.wait(10)


def test_every_route_answers_under_the_served_name(served: str) -> None:
    models = httpx.get(f"{served}/v1/models", timeout=10)
    assert models.status_code == 200, models.text
    cards = models.json()["data"]
    assert [c["id"] for c in cards] == ["demo-large"] and cards[0]["max_model_len"] == 4096
    assert httpx.get(f"{served}/metrics", timeout=10).status_code == 200
    chat = httpx.post(f"{served}/v1/chat/completions", timeout=30, json={
        "model": "demo-large", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 200 and chat.json()["model"] == "demo-large"
    text = httpx.post(f"{served}/v1/completions", timeout=30,
                      json={"model": "demo-large", "max_tokens": 3, "prompt": "hi"})
    assert text.status_code == 200
    emb = httpx.post(f"{served}/v1/embeddings", timeout=30,
                     json={"model": "demo-large", "input": "hi"})
    assert emb.status_code == 200 and emb.json()["data"]
    too_long = httpx.post(f"{served}/v1/completions", timeout=30, json={
        "model": "demo-large", "max_tokens": 3, "prompt": "hi " * 5000})
    assert too_long.status_code == 400


def test_the_gateways_scrape_reads_the_context_length(served: str) -> None:
    read, ep = scrape_once(f"{served}/v1")
    assert read and ep.engine.max_model_len == 4096

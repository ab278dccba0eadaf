"""Embeddings on real vLLM: an instance of the tiny random-weight Llama run as an embedding
model (``--runner pooling --convert embed``, last-token pooling), behind the gateway, with the
official ``openai`` client: the gateway's count of every input equals vLLM's usage, vectors
have the model's hidden size, token arrays pass as they are.

A pooling instance cannot also generate, so it is an instance of its own. It cannot run beside
the session's two generating instances on a 2-core machine (their NIXL workers poll, using
about 70 % of a core each, idle: a third instance was not ready within 240 s, measured), so
``conftest`` runs this module before any test that uses ``vllm_fleet``, and its instance
stops when the module ends."""

from __future__ import annotations

import json
import tempfile
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from gateway_stack import RunningGateway, start_gateway, write_policy
from test_gateway_e2e import sha

from engines import vllm
from protocol.loopback import free_port


@pytest.fixture(scope="module")
def embedder() -> Iterator[tuple[vllm.VllmSpec, Path]]:
    try:
        model = vllm.ensure_model()
    except vllm.VllmUnavailable as exc:
        pytest.fail(str(exc), pytrace=False)
    spec = vllm.VllmSpec(port=free_port(), core=0,
                         extra_args=["--runner", "pooling", "--convert", "embed"])
    log = Path(tempfile.mkdtemp(prefix="tokengate-vllm-embed-")) / "vllm.log"
    proc = vllm.start(spec, log, model)
    try:
        vllm.wait_ready(spec, proc, log)
        yield spec, model
    finally:
        vllm.stop(proc)


@pytest.fixture
def gw(embedder: tuple[vllm.VllmSpec, Path], tmp_path: Path) -> Iterator[RunningGateway]:
    spec, model = embedder
    doc = {"version": 1, "models": {"embed": {
               "endpoints": [{"url": spec.url + "/v1"}], "tokenizer": str(model),
               "upstream_model": "tiny"}},
           "tenants": {"a": {"keys": [{"sha256": sha("key-a")}], "limits": {"tpm": 1e6}}},
           "routes": {"r": {"tenants": ["a"], "models": ["embed"]}}}
    g = start_gateway(write_policy(tmp_path / "p.yaml", doc))
    yield g
    g.close()


def direct_usage(spec: vllm.VllmSpec, inputs: Any) -> int:
    req = urllib.request.Request(spec.url + "/v1/embeddings", data=json.dumps(
        {"model": "tiny", "input": inputs}).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=240) as r:
        return int(json.loads(r.read())["usage"]["prompt_tokens"])


INPUTS: list[Any] = ["hello", ["The quick brown fox", "jumps over", "日本語 🙂"],
                     [[1, 2, 3, 4]], ["<|endoftext|> special " * 20]]


def test_embeddings_on_real_vllm_are_counted_as_vllm_counts(
        gw: RunningGateway, embedder: tuple[vllm.VllmSpec, Path]) -> None:
    spec, model = embedder
    hidden = json.loads((model / "config.json").read_text())["hidden_size"]
    with openai.OpenAI(base_url=f"{gw.url}/v1", api_key="key-a", max_retries=0,
                       timeout=120) as c:
        for inputs in INPUTS:
            raw = c.embeddings.with_raw_response.create(model="embed", input=inputs)
            r = raw.parse()
            n = 1 if isinstance(inputs, str) else len(inputs)
            assert r.model == "embed" and len(r.data) == n
            assert all(len(d.embedding) == hidden for d in r.data)
            assert int(raw.headers["x-tokengate-prompt-tokens"]) == r.usage.prompt_tokens
            assert r.usage.prompt_tokens == direct_usage(spec, inputs), inputs

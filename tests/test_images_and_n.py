"""Images and ``n`` through the gateway with the official ``openai`` client, on reference
backends: a model whose policy takes images passes base64 image parts through, reserves
``tokens_per_image`` each and settles with the engine's usage; a model without is a 400 naming
the part, and an http(s) image URL is refused unless the policy allows the engine to fetch;
``n`` choices reserve ``n ×`` the output and settle what the engine generated."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from conftest import RunningBackend
from gateway_stack import RunningGateway, client, one_tenant, serving, write_policy

PNG = ("data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8"
       "/5+hHgAHggJ/PchI7wAAAABJRU5ErkJggg==")
IMAGE_TOKENS = 64


def ask(text: str, *urls: str) -> list[Any]:
    return [{"role": "user", "content": [{"type": "text", "text": text}, *(
        {"type": "image_url", "image_url": {"url": u}} for u in urls)]}]


@pytest.fixture
def gw(backend_factory: Callable[..., RunningBackend], tmp_path: Path
       ) -> Iterator[RunningGateway]:
    vision = backend_factory(image_tokens=IMAGE_TOKENS)
    text = backend_factory()
    doc = one_tenant({"vision": {"endpoints": [{"url": f"{vision.url}/v1"}],
                                 "upstream_model": "llama-3-8b", "default_max_tokens": 8,
                                 "images": {"tokens_per_image": IMAGE_TOKENS,
                                            "max_per_request": 2}},
                      "text": {"endpoints": [{"url": f"{text.url}/v1"}],
                               "upstream_model": "llama-3-8b", "default_max_tokens": 8}},
                     {"limits": {"tpm": 100_000}})
    with serving(write_policy(tmp_path / "p.yaml", doc)) as g:
        yield g


@pytest.fixture
def c(gw: RunningGateway) -> Iterator[openai.OpenAI]:
    with client(gw) as cl:
        yield cl


def spend(gw: RunningGateway, requests: int) -> dict[str, Any]:
    deadline = time.monotonic() + 10
    while True:
        rows = httpx.get(f"{gw.url}/admin/spend", params={"by": "model"}, timeout=10,
                         headers={"Authorization": "Bearer admin-key"}).json()["rows"]
        total = sum(r["requests"] for r in rows)
        if total >= requests or time.monotonic() > deadline:
            return {r["model"]: r for r in rows}
        time.sleep(0.05)


def test_images_pass_to_a_vision_model_reserved_and_settled(
        gw: RunningGateway, c: openai.OpenAI) -> None:
    plain = c.chat.completions.with_raw_response.create(model="vision",
                                                        messages=ask("what is it?"))
    two = c.chat.completions.with_raw_response.create(model="vision",
                                                      messages=ask("what is it?", PNG, PNG))
    p0, p2 = plain.parse().usage, two.parse().usage
    assert p0 is not None and p2 is not None
    # the engine counts each image as its encoder's tokens; the gateway reserved as many
    assert p2.prompt_tokens == p0.prompt_tokens + 2 * IMAGE_TOKENS
    assert int(two.headers["x-tokengate-prompt-tokens"]) == p2.prompt_tokens
    rows = spend(gw, 2)
    assert rows["vision"]["prompt_tokens"] == p0.prompt_tokens + p2.prompt_tokens


@pytest.mark.parametrize(("model", "urls", "param", "code"), [
    ("text", [PNG], "messages[0].content[1]", "image_not_supported"),
    ("vision", ["https://example.com/cat.png"], "messages[0].content[1]",
     "image_url_not_allowed"),
    ("vision", [PNG, PNG, PNG], "messages[0].content[1]", "too_many_images"),
    ("vision", ["file:///etc/passwd"], "messages[0].content[1].image_url.url", None),
    # junk in the middle of a data URL (it used to be checked on its ends only), bad padding
    ("vision", [PNG[:60] + "!!!not base64!!!" + PNG[60:]],
     "messages[0].content[1].image_url.url", None),
    ("vision", [PNG.rstrip("=")], "messages[0].content[1].image_url.url", None),
    ("vision", [PNG[:-2] + "=A"], "messages[0].content[1].image_url.url", None),
])
def test_images_a_model_cannot_take_are_a_400_naming_the_part(
        c: openai.OpenAI, model: str, urls: list[str], param: str, code: str | None) -> None:
    with pytest.raises(openai.BadRequestError) as exc:
        c.chat.completions.create(model=model, messages=ask("what is it?", *urls))
    err = exc.value.body
    assert isinstance(err, dict) and err["param"] == param, err
    if code is not None:
        assert err["code"] == code


def test_n_choices_reserve_n_times_and_settle_what_was_generated(
        gw: RunningGateway, c: openai.OpenAI) -> None:
    r = c.chat.completions.with_raw_response.create(
        model="text", messages=ask("tell me"), n=3, max_tokens=5)
    body = r.parse()
    assert [ch.index for ch in body.choices] == [0, 1, 2]
    assert body.usage is not None and body.usage.completion_tokens <= 15
    # reserved prompt + 3 x 5 before the answer: the limit header says what was left then
    left = int(r.headers["x-ratelimit-remaining-tokens"])
    counted = int(r.headers["x-tokengate-prompt-tokens"])
    assert 0 <= 100_000 - counted - 15 - left <= 1, (left, counted)  # floored, not n = 1
    stream = list(c.chat.completions.create(
        model="text", messages=ask("tell me"), n=2, max_tokens=4, stream=True,
        stream_options={"include_usage": True}))
    texts = {0: "", 1: ""}
    for chunk in stream:
        for ch in chunk.choices:
            texts[ch.index] += ch.delta.content or ""
    assert all(texts.values()) and stream[-1].usage is not None
    rows = spend(gw, 2)
    assert rows["text"]["completion_tokens"] == (body.usage.completion_tokens +
                                                 stream[-1].usage.completion_tokens)

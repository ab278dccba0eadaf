"""Tokenizer, chat template ids, output words that re-tokenize exactly, length draws."""

from __future__ import annotations

import random

import pytest

from backend.stream import RequestStream
from backend.textgen import LengthDistribution, WordSource
from backend.tokenizer import Tokenizer


def test_output_words_retokenize_to_the_same_ids(tokenizer: Tokenizer) -> None:
    rng = random.Random(0)
    src = WordSource(tokenizer.output_words, rng)
    for _ in range(50):
        ids = [src.next() for _ in range(rng.randint(1, 400))]
        text = "".join(tokenizer.word_text(i) for i in ids)
        assert tokenizer.encode(text) == ids


def test_chat_template_costs_openai_accounting(tokenizer: Tokenizer) -> None:
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    ids = tokenizer.chat_ids(msgs)
    content = sum(len(tokenizer.encode(m["content"])) + len(tokenizer.encode(m["role"]))
                  for m in msgs)
    assert len(ids) == content + 3 * len(msgs) + 3
    named = tokenizer.chat_ids([{"role": "user", "content": "x", "name": "bob"}])
    assert len(named) == 3 + 1 + 1 + 1 + len(tokenizer.encode("bob")) + 3
    # A conversation's ids extend the ids of its prefix (so prefix caching sees turns).
    longer = tokenizer.chat_ids([*msgs, {"role": "assistant", "content": "ok"}])
    assert longer[:len(ids) - 3] == ids[:-3]


def test_length_distributions() -> None:
    rng = random.Random(1)
    assert LengthDistribution.parse("fixed:12").sample(rng) == 12
    u = LengthDistribution.parse("uniform:10:20")
    assert all(10 <= u.sample(rng) <= 20 for _ in range(200))
    ln = LengthDistribution.parse("lognormal:200:0.8")
    mean = sum(ln.sample(rng) for _ in range(20000)) / 20000
    assert mean == pytest.approx(200, rel=0.05)
    ex = LengthDistribution.parse("exponential:50")
    assert sum(ex.sample(rng) for _ in range(20000)) / 20000 == pytest.approx(50, rel=0.05)
    for bad in ("fixed", "uniform:5:1", "fixed:x", "fixed:-1"):
        with pytest.raises(ValueError, match="bad length spec"):
            LengthDistribution.parse(bad)


async def test_stop_string_cuts_text_and_reports_stop() -> None:
    s = RequestStream(stop=("cd",))
    assert not s.push(1, " ab")
    assert s.push(2, " cde")
    d = await s.next()
    assert d.text == " ab " and d.token_ids == [1, 2]

"""Tokenizer, chat template ids, output words that re-tokenize exactly, length draws."""

from __future__ import annotations

import random

import pytest

from backend.stream import RequestStream
from backend.textgen import LengthDistribution, WordSource
from protocol.tokenizer import Tokenizer


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


def test_hugging_face_tokenizer_json(tmp_path: object) -> None:
    """A byte-level BPE tokenizer.json (trained here, offline) works like tiktoken."""
    from pathlib import Path

    from tokenizers import Tokenizer as HF
    from tokenizers import decoders, models, pre_tokenizers, trainers

    rng = random.Random(0)
    vocab = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 7)))
             for _ in range(600)]
    hf = HF(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    hf.train_from_iterator(
        (" ".join(rng.choice(vocab) for _ in range(50)) for _ in range(400)),
        trainers.BpeTrainer(vocab_size=3000,
                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    path = Path(str(tmp_path)) / "tokenizer.json"
    hf.save(str(path))
    tok = Tokenizer(str(path))
    assert len(tok.output_words) >= 256
    ids = [rng.choice(tok.output_words) for _ in range(300)]
    assert tok.encode("".join(tok.word_text(i) for i in ids)) == ids
    text = "".join(tok.word_text(i) for i in ids)
    assert list(tok.encode_ids(text)) == tok.encode(text)
    assert list(tok.encode_ids(text, prompt=True)) == tok.encode_prompt(text)
    msgs = [{"role": "user", "content": "hello there"}]
    assert len(tok.chat_ids(msgs)) == 3 + len(tok.encode("user")) \
        + len(tok.encode("hello there")) + 2 + len(tok.encode("assistant"))

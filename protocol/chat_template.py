"""A model's own chat template (the Jinja template of its ``tokenizer_config.json``), rendered
as Hugging Face's ``apply_chat_template`` renders it, in a sandbox.

The environment matches transformers' (``ImmutableSandboxedEnvironment``, ``trim_blocks``,
``lstrip_blocks``, the ``loopcontrols`` extension, a ``tojson`` that keeps non-ASCII text, and
the ``raise_exception`` and ``strftime_now`` globals), and the template sees what vLLM's chat
endpoint gives it: ``messages``, ``tools``, ``add_generation_prompt``, the special tokens
(``bos_token``, ``eos_token``…) and any ``chat_template_kwargs`` of the request.
``continue_final_message`` renders without a generation prompt and cuts the text right after
the final message's content, as transformers does.

*Skeletons.* Rendering a 100K-token conversation on every turn would cost more than the rest of
the request, so a template whose only use of a message's ``content`` is to print it (possibly
tested for truthiness or string-ness) is rendered with every non-empty content replaced by a
short sentinel; the caller substitutes the contents back piece by piece and caches the tokens of
each piece. ``substitutable`` says whether that is exact for this template: it is decided from
the template's syntax tree (no filter, call, comparison or method on ``content``) and checked
on probe conversations whose contents start and end with whitespace.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

SENTINEL = re.compile("\ue000([0-9]+)\ue001")


class ChatTemplateError(ValueError):
    """The template failed to render these messages (a ``raise_exception`` or a bug of its)."""


def sentinel(i: int) -> str:
    return f"\ue000{i}\ue001"


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _raise(message: str) -> None:
    raise ChatTemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class ChatTemplate:
    def __init__(self, source: str, special: Mapping[str, str] | None = None) -> None:
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = _strftime_now
        try:
            self._template = env.from_string(source)
            tree = env.parse(source)
        except TemplateError as exc:
            raise ChatTemplateError(f"chat template does not compile: {exc}") from exc
        self.source = source
        self.special = dict(special or {})
        self.substitutable = _prints_content_only(tree) and self._probe()

    def render(self, messages: Sequence[Mapping[str, Any]], *,
               add_generation_prompt: bool = True, continue_final: bool = False,
               tools: Sequence[Any] | None = None,
               kwargs: Mapping[str, Any] | None = None) -> str:
        ctx: dict[str, Any] = dict(self.special)
        ctx.update(kwargs or {})
        ctx.update(messages=list(messages), tools=list(tools) if tools else None,
                   add_generation_prompt=add_generation_prompt and not continue_final)
        try:
            text = self._template.render(ctx)
        except ChatTemplateError:
            raise
        except Exception as exc:  # a template's own bug, a sandbox refusal, a bad message
            raise ChatTemplateError(f"chat template failed: {type(exc).__name__}: {exc}"
                                    ) from None
        if continue_final and messages:
            final = str(messages[-1].get("content") or "").strip()
            at = text.rfind(final) if final else -1
            if at < 0:
                raise ChatTemplateError("continue_final_message: the final message's content "
                                        "is not in the rendered prompt")
            text = text[:at + len(final)]
        return text

    def _probe(self) -> bool:
        """Does substituting contents into the skeleton give exactly the real rendering?"""
        contents = ["  You are terse.\n", "\nhello  there ", "x", "", " done\n\n"]
        roles = ["system", "user", "assistant", "user", "assistant"]
        for n in (1, 2, len(contents)):
            msgs = [{"role": r, "content": c} for r, c in zip(roles[:n], contents[:n],
                                                                strict=True)]
            try:
                real = self.render(msgs)
                skel = self.render(skeleton(msgs)[0])
            except ChatTemplateError:
                return False
            if substitute(skel, contents[:n]) != real:
                return False
        return True


def developer_roles(messages: list[dict[str, Any]], source: str) -> list[dict[str, Any]]:
    """The messages as vLLM renders them with a template that never names the ``developer``
    role (vLLM 0.32, ``renderers/hf.py``): every ``developer`` message becomes ``system``,
    and when a system message is then not first, or there are several, they are merged
    into one first message, their non-empty contents joined by a blank line."""
    if not any(m.get("role") == "developer" for m in messages) \
            or "'developer'" in source or '"developer"' in source:
        return messages
    converted = [{**m, "role": "system"} if m.get("role") == "developer" else m
                 for m in messages]
    systems: list[str] = []
    rest: list[dict[str, Any]] = []
    merge = False
    for i, m in enumerate(converted):
        if m.get("role") == "system":
            merge = merge or i > 0 or bool(systems)
            if m.get("content"):
                systems.append(str(m["content"]))
        else:
            rest.append(m)
    if not merge:
        return converted
    return [{"role": "system", "content": "\n\n".join(systems)}, *rest]


def skeleton(messages: Sequence[Mapping[str, Any]]
             ) -> tuple[list[dict[str, Any]], list[str]]:
    """Messages with every non-empty content replaced by its sentinel, and the contents."""
    out: list[dict[str, Any]] = []
    contents: list[str] = []
    for i, m in enumerate(messages):
        c = str(m.get("content") or "")
        contents.append(c)
        out.append({**m, "content": sentinel(i) if c else c})
    return out, contents


def substitute(text: str, contents: Sequence[str]) -> str:
    return SENTINEL.sub(lambda mt: contents[int(mt.group(1))], text)


def _prints_content_only(tree: Any) -> bool:
    """True when every use of ``….content`` / ``…['content']`` in the template only prints it
    (inside ``+``/``~`` concatenations), or tests its truthiness or string-ness."""
    from jinja2 import nodes

    def is_content(n: Any) -> bool:
        if isinstance(n, nodes.Getattr):
            return n.attr == "content"
        if isinstance(n, nodes.Getitem):
            return isinstance(n.arg, nodes.Const) and n.arg.value == "content"
        return False

    def walk(n: Any, parents: tuple[Any, ...]) -> bool:
        if is_content(n):
            return _allowed(n, parents)
        return all(walk(c, (*parents, n)) for c in n.iter_child_nodes())

    def _allowed(n: Any, parents: tuple[Any, ...]) -> bool:
        child = n
        for p in reversed(parents):
            if isinstance(p, nodes.Add | nodes.Concat):
                child = p
                continue
            if isinstance(p, nodes.Output):
                return True
            if isinstance(p, nodes.If | nodes.CondExpr) and p.test is child:
                return True
            if isinstance(p, nodes.Not | nodes.And | nodes.Or):
                child = p
                continue
            if isinstance(p, nodes.Test) and p.node is child:
                return p.name in {"string", "defined", "undefined", "none", "mapping"}
            return False
        return False

    return walk(tree, ())

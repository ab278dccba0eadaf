"""One request's context, as the pipeline (``gateway.request.pipeline``) carries it from step to
step and hands it to the attempt, migration and settlement code."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from gateway.config.policy import Model, Route
from gateway.counting.tokenize import OFFLOAD_CHARS, ChatPrompt, message_text
from gateway.quota.ledger import ContextTooLong, ImagesRefused
from gateway.request.fields import width
from gateway.spend.record import SpendRecord
from gateway.state import GatewayState, PolicyView
from gateway.tracing import RequestTrace
from protocol import logs
from protocol.chat_template import ChatTemplateError
from protocol.errors import bad
from protocol.response_events import Shape
from protocol.validate import GenerationRequest, Kind

if TYPE_CHECKING:
    from gateway.flow.control import Pass
    from gateway.quota.ledger import Admission


@dataclass(slots=True)
class RequestContext:
    state: GatewayState
    view: PolicyView
    kind: Kind
    tenant: str
    route: Route
    body: dict[str, Any]
    parsed: GenerationRequest
    request_id: str
    received_at: float
    raw: bytes
    slo: tuple[float | None, float | None] = (None, None)
    priority: str = "standard"
    text_ids: dict[str, Sequence[int]] = field(default_factory=dict)  # model -> prompt ids
    chat_prompts: dict[str, ChatPrompt] = field(default_factory=dict)  # model -> rendered
    prompt_tokens: dict[str, int] = field(default_factory=dict)  # model -> counted prompt
    output_limit: dict[str, int] = field(default_factory=dict)  # model -> max_tokens reserved
    trace: RequestTrace | None = None  # None unless the policy turns tracing on
    admissions: list[Admission] = field(default_factory=list)  # every reservation made
    outcome: str | None = None  # how the request ended, once counted (``finish``)
    recorded: bool = False  # its spend record was written (``spent``: once)
    flow: str = ""  # its flow under flow control: the tenant, or tenant/x-fairness-id
    key_name: str = ""  # the name of the API key it came with (spend records)
    tier: str = "payg"  # its capacity tier: reserved, payg or flex (``quota.tier_of``)
    flow_passes: dict[str, Pass] = field(default_factory=dict)  # model -> its turn, unsettled
    no_spill: bool = False  # its spillover failed: it waits on its own model instead
    responses: Shape | None = None  # a Responses API request, served as this chat request
    inputs: tuple[int, ...] | None = None  # an embeddings request: each input's tokens
    embed_inputs: tuple[str | tuple[int, ...], ...] | None = None  # its inputs, to count
    chars: dict[str, tuple[int, int]] = field(default_factory=dict)  # model -> _text_chars
    on_end: list[Callable[[], None]] = field(default_factory=list)  # run once it has ended
    sees_endpoints: bool = False  # its answer may name the engines (``pipeline``)

    def finish(self, model: str, outcome: str) -> None:
        """How the request ended (an HTTP status, ``client_gone``, ``broken``), counted in
        ``tokengate_requests_total`` and stamped on its log lines: the only place either
        happens, and only the first time (``serve`` and the EPP alike)."""
        if self.outcome is not None:
            return
        self.outcome = outcome
        self.state.metrics.series("requests", self.route.name, model, self.tenant_label,
                                  outcome).inc()
        logs.outcome(outcome)

    def spent(self, model: Model, prompt: int, completion: int, cached: int, outcome: str,
              endpoint: str | None = None) -> None:
        """The request's spend record (``gateway.spend``): one per request, from settlement
        when something was served, else from the error that ended it; only the first
        call writes it."""
        if self.recorded:
            return
        self.recorded = True
        _, _, session = self.flow.partition("/")
        now, dollars = time.time(), model.price.cost_at(self.tier, prompt, completion)
        self.state.spend.record(SpendRecord(
            now, self.request_id, self.tenant, self.key_name, model.name, self.priority,
            prompt, completion, cached, dollars, outcome, endpoint, session or None,
            self.tier, self.route.name))
        self.state.sentry.spent(self.tenant, self.session, dollars, now)

    @property
    def session(self) -> str | None:
        """The agent session it belongs to (``tenant/x-fairness-id``), if it names one."""
        return self.flow if "/" in self.flow else None

    @property
    def tenant_label(self) -> str:
        """The tenant as metrics name it: "*" when the policy keeps tenants out of them."""
        return self.tenant if self.view.policy.settings.metrics_tenant_label else "*"

    async def count_prompt(self, m: Model) -> int:
        """The prompt's tokens as model ``m`` counts them (tokenized once per model); a prompt
        (with the output asked for) longer than the model's context is refused here, before
        anything is reserved, with OpenAI's ``context_length_exceeded``."""
        n = self.prompt_tokens.get(m.name)
        if n is None:
            images = self._images(m)
            try:
                n = self.prompt_tokens[m.name] = await self._count(m) + images
            except ChatTemplateError as exc:
                raise bad(str(exc), "messages") from None
        limit = self.max_context(m)
        if self.inputs is not None:  # embeddings: each input must fit, not their sum
            longest = max(self.inputs)
            if limit is not None and longest >= limit:
                raise bad(f"This model's maximum context length is {limit} tokens. However, "
                          f"an input has {longest} tokens.", "input", "context_length_exceeded")
            return n
        asked = self.parsed.max_tokens
        if limit is not None and (n >= limit or (asked is not None and n + asked > limit)):
            raise ContextTooLong(limit, n, asked, self.kind)
        return n

    def _images(self, m: Model) -> int:
        """What the request's images are reserved as on ``m``: ``tokens_per_image`` each
        (400 when ``m`` takes no images, too many, or a URL it must not be given)."""
        im = self.parsed.images
        if not im.count:
            return 0
        if m.images is None:
            raise ImagesRefused(f"the model `{m.name}` does not accept images", im.first,
                                "image_not_supported")
        if im.count > m.images.max_per_request:
            raise ImagesRefused(f"at most {m.images.max_per_request} images per request, got "
                                f"{im.count}", im.first, "too_many_images")
        if im.remote is not None and not m.images.remote_urls:
            raise ImagesRefused("images must be base64 data URLs for this model (the engine "
                                "fetches no URL)", im.remote, "image_url_not_allowed")
        return im.count * m.images.tokens_per_image

    def max_context(self, m: Model) -> int | None:
        """The policy's ``max_context``, else the smallest context the model's engines report
        (``max_model_len`` of their /v1/models)."""
        if m.max_context is not None:
            return m.max_context
        pool = self.view.pools.get(m.name)
        lens = [e.engine.max_model_len for e in (pool.endpoints if pool else ())
                if e.engine.max_model_len]
        return min(lens) if lens else None

    def _text_chars(self, m: Model) -> tuple[int, int]:
        """Characters of text the request surely has tokenized on ``m``, in all and in its
        longest embeddings input: under a model's own template the messages other than the
        assistant's (a template may drop an earlier turn's reasoning), else every message's
        content and name; a prompt's text; embeddings inputs. Read once per model (the
        bound, then the count, ask)."""
        known = self.chars.get(m.name)
        if known is not None:
            return known
        g = self.parsed
        if self.embed_inputs is not None:
            sizes = [len(x) for x in self.embed_inputs if isinstance(x, str)] or [0]
            known = (sum(sizes), max(sizes))
        elif g.kind == "chat":
            templated = self.view.counters[m.name].template is not None
            n = sum(len(message_text(x)) + len(str(x.get("name") or ""))
                    for x in g.messages if not (templated and x.get("role") == "assistant"))
            known = (n, n)
        else:
            known = (len(g.prompt_text or ""), len(g.prompt_text or ""))
        self.chars[m.name] = known
        return known

    def floor_prompt(self, m: Model) -> int:
        """A lower bound on the prompt's tokens on ``m``, known without tokenizing it (token
        arrays exactly); a request whose bound already passes the model's context is refused
        here, with OpenAI's ``context_length_exceeded`` (nothing is counted)."""
        counter = self.view.counters[m.name]
        g = self.parsed
        if g.prompt_ids is not None and self.embed_inputs is None:
            return len(g.prompt_ids)
        total, longest = self._text_chars(m)
        lo = counter.floor(total)
        limit = self.max_context(m)
        if limit is None:
            return lo
        if self.embed_inputs is not None:
            one = counter.floor(longest)
            if one >= limit:
                raise bad(f"This model's maximum context length is {limit} tokens. However, "
                          f"an input has at least {one} tokens.", "input",
                          "context_length_exceeded")
            return lo
        asked = g.max_tokens
        if lo >= limit or (asked is not None and lo + asked > limit):
            raise ContextTooLong(limit, lo, asked, self.kind, at_least=True)
        return lo

    async def _count(self, m: Model) -> int:
        total, _ = self._text_chars(m)
        if total < OFFLOAD_CHARS:
            return await self._tokenize(m, False)
        async with self.state.counting.slot(self.tenant):  # one tenant cannot fill the pool
            return await self._tokenize(m, True)

    async def _tokenize(self, m: Model, offload: bool) -> int:
        counter = self.view.counters[m.name]
        g = self.parsed
        if self.embed_inputs is not None:
            if g.prompt_ids is None:  # counted once, with the first model's tokenizer
                # what is reserved and routed on, and each input's tokens
                g.prompt_ids, self.inputs = await counter.inputs(self.embed_inputs, offload)
            return len(g.prompt_ids)
        if g.kind == "chat":
            prompt = self.chat_prompts.get(m.name)
            if prompt is None:
                b = self.body
                tools = b.get("tools") if isinstance(b.get("tools"), list) else None
                kw = b.get("chat_template_kwargs")
                gen = b.get("add_generation_prompt", True) is not False
                messages = b["messages"] if counter.template is not None else g.messages
                prompt = await counter.chat_prompt(
                    messages, add_generation_prompt=gen, continue_final=g.continue_final,
                    tools=tools, kwargs=kw if isinstance(kw, dict) else None, offload=offload)
                self.chat_prompts[m.name] = prompt  # routing hashes the same ids
            return prompt.tokens
        if g.prompt_ids is not None:
            return len(g.prompt_ids)
        ids = await counter.text_ids(g.prompt_text or "")
        self.text_ids[m.name] = ids  # routing hashes the same ids: tokenize once
        return len(ids)

    def expected_output(self, m: Model) -> int:
        """The output reserved, and the limit the engine is held to: the request's
        ``max_tokens``, else the model's ``default_max_tokens`` (cut to what the context leaves),
        which is then sent upstream as ``max_tokens``, so the engine can never generate more
        than was reserved."""
        g = self.parsed
        if g.max_tokens is not None:
            out = g.max_tokens
        else:
            out = m.default_max_tokens
            limit = self.max_context(m)
            n = self.prompt_tokens.get(m.name)
            if limit is not None and n is not None:
                out = max(1, min(out, limit - n))
        self.output_limit[m.name] = out
        # each of its n choices may use all of it (each of best_of, when a model allows it)
        return out * width(self.body, self.parsed.n)

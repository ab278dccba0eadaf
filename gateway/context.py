"""One request's context, as the pipeline (``gateway.pipeline``) carries it from step to
step and hands it to the attempt, migration and settlement code."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from gateway.config.policy import Model, Route
from gateway.state import GatewayState, PolicyView
from gateway.tokenize import ChatPrompt
from protocol.validate import GenerationRequest, Kind

if TYPE_CHECKING:
    from gateway.quota import Admission


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
    text_ids: dict[str, list[int]] = field(default_factory=dict)  # model -> prompt ids
    chat_prompts: dict[str, ChatPrompt] = field(default_factory=dict)  # model -> rendered
    admissions: list[Admission] = field(default_factory=list)  # every reservation made

    @property
    def tenant_label(self) -> str:
        """The tenant as metrics name it: "*" when the policy keeps tenants out of them."""
        return self.tenant if self.view.policy.settings.metrics_tenant_label else "*"

    async def count_prompt(self, m: Model) -> int:
        """The prompt's tokens as model ``m`` counts them (tokenized once per model)."""
        counter = self.view.counters[m.name]
        g = self.parsed
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
                    tools=tools, kwargs=kw if isinstance(kw, dict) else None)
                self.chat_prompts[m.name] = prompt  # routing hashes the same ids
            return prompt.tokens
        if g.prompt_ids is not None:
            return len(g.prompt_ids)
        ids = await counter.text_ids(g.prompt_text or "")
        self.text_ids[m.name] = ids  # routing hashes the same ids: tokenize once
        return len(ids)

    def expected_output(self, m: Model) -> int:
        g = self.parsed
        return g.max_tokens if g.max_tokens is not None else m.default_max_tokens

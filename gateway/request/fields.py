"""What a client's body may carry to an engine: each API's fields, by name.

A field is either *forwarded* (OpenAI's own, and vLLM's sampling extras that change what is
generated, not how much work it takes), *set by the gateway* (a client's is dropped:
``dispatch.GATEWAY_ONLY_FIELDS``), or *work-multiplying*: it makes the engine do more than the
prompt and ``max_tokens`` the gateway counted and reserved (``best_of`` generates each choice
that many times, beam search keeps that many beams, ``prompt_logprobs`` scores the whole
prompt, a per-request ``chat_template`` or ``documents`` change the prompt the gateway
counted). Those are refused with a 400 naming the field, unless the model's ``allow_fields``
lists it (then ``best_of`` and beam search reserve their width in output tokens). Any other
field is refused too (``settings.unknown_fields: reject``, the default) or dropped before the
body goes upstream (``drop``): nothing a client sends reaches an engine unexamined.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gateway.config.policy import Model
from gateway.config.schema import WORK_FIELDS
from protocol.errors import APIError

SAMPLING = frozenset({
    "model", "stream", "stream_options", "max_tokens", "n", "temperature", "top_p",
    "presence_penalty", "frequency_penalty", "stop", "seed", "user", "logit_bias",
    # vLLM's sampling extras
    "top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids",
    "skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output",
    "bad_words", "allowed_token_ids", "guided_json", "guided_regex", "guided_choice",
    "guided_grammar", "guided_decoding_backend", "guided_whitespace_pattern",
    "structured_outputs", "truncate_prompt_tokens", "return_tokens_as_token_ids",
    "cache_salt", "request_id", "response_format", "logprobs", "add_special_tokens"})
FORWARDED: Mapping[str, frozenset[str]] = {
    "chat": SAMPLING | {
        "messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
        "parallel_tool_calls", "functions", "function_call", "reasoning_effort", "modalities",
        "audio", "prediction", "web_search_options", "store", "metadata", "service_tier",
        "safety_identifier", "prompt_cache_key", "verbosity", "chat_template_kwargs",
        "add_generation_prompt", "continue_final_message"},
    "completion": SAMPLING | {"prompt", "suffix", "echo"},
    "embeddings": frozenset({"model", "input", "encoding_format", "dimensions", "user"}),
}
# Set by the gateway for the engine: a client's are dropped, never forwarded (a client's
# ``kv_transfer_params`` would make a decode engine pull KV from an address it names, its
# ``priority`` would jump the engine's queue).
GATEWAY_ONLY_FIELDS = ("kv_transfer_params", "priority")
WORK_MULTIPLYING: Mapping[str, str] = {
    "best_of": "generates each choice best_of times",
    "use_beam_search": "keeps a beam per choice at every step",
    "length_penalty": "applies to beam search",
    "prompt_logprobs": "scores every prompt token",
    "chat_template": "replaces the template the prompt was counted with",
    "documents": "adds text to the prompt that was not counted",
    "mm_processor_kwargs": "changes how much an image costs",
}
assert tuple(WORK_MULTIPLYING) == WORK_FIELDS


def screen(operation: str, body: dict[str, Any], model: Model, unknown: str) -> list[str]:
    """Check ``body``'s fields for ``operation`` (chat, completion, embeddings) on ``model``:
    raises the 400 of a work-multiplying field the model does not allow, or of an unknown one
    under ``unknown == "reject"``; answers the unknown fields to drop (``"drop"``)."""
    known = FORWARDED[operation]
    dropped: list[str] = []
    for k in body:
        if k in known or k in GATEWAY_ONLY_FIELDS:
            continue
        why = WORK_MULTIPLYING.get(k)
        if why is not None and operation != "embeddings":
            if k in model.allow_fields:
                if k == "best_of" and not (isinstance(body[k], int) and not isinstance(
                        body[k], bool) and 1 <= body[k] <= 128):
                    raise APIError(400, "'best_of' must be an integer from 1 to 128",
                                   param=k, code="invalid_value")
                continue
            raise APIError(400, f"'{k}' is not enabled for the model `{model.name}`: it "
                           f"{why}, beyond what was counted and reserved (the policy may "
                           f"allow it: models.{model.name}.allow_fields)", param=k,
                           code="unsupported_parameter")
        if unknown == "drop":
            dropped.append(k)
            continue
        raise APIError(400, f"Unrecognized request argument supplied: {k}", param=k,
                       code="unknown_parameter")
    return dropped


def width(body: Mapping[str, Any], n: int) -> int:
    """Sequences generated per choice set: ``best_of`` when larger than ``n`` (an allowed
    ``best_of`` or beam search reserves all of them)."""
    b = body.get("best_of")
    return max(n, b) if isinstance(b, int) and not isinstance(b, bool) and b > 0 else n

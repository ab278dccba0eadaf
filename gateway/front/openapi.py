"""The gateway's surface as an OpenAPI 3.1 document, served at ``GET /openapi.json``.

It describes what the gateway accepts and answers (the OpenAI-compatible endpoints it serves,
its probes and the admin endpoints), including every error status in OpenAI's error shape, so
that clients can be generated from it and ``schemathesis`` can test the gateway against it
(tests/test_security.py).
"""

from __future__ import annotations

from typing import Any

_ERROR = {"$ref": "#/components/schemas/Error"}


def _errors(*statuses: int) -> dict[str, Any]:
    text = {400: "Invalid request", 401: "Missing or unknown API key",
            404: "Unknown model or path", 408: "The request was sent too slowly",
            413: "Body too large", 429: "Rate limited (retry-after says when)",
            502: "Every upstream failed", 503: "Draining, limiter down or shed (retry-after)",
            504: "The upstream timed out"}
    return {str(s): {"description": text[s],
                     "content": {"application/json": {"schema": _ERROR}}} for s in statuses}


_GEN_ERRORS = (400, 401, 404, 408, 413, 429, 502, 503, 504)
_STOP = {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"},
                                        "maxItems": 4}, {"type": "null"}]}
_COMMON: dict[str, Any] = {
    "model": {"type": "string", "minLength": 1},
    "max_tokens": {"type": ["integer", "null"], "minimum": 1, "maximum": 2**31 - 1},
    "stream": {"type": ["boolean", "null"],
               "description": "stream_options ({include_usage}) is accepted when true"},
    "temperature": {"type": ["number", "null"], "minimum": 0, "maximum": 2},
    "top_p": {"type": ["number", "null"], "minimum": 0, "maximum": 1},
    "n": {"type": ["integer", "null"], "minimum": 1, "maximum": 128},
    "stop": _STOP,
    "seed": {"type": ["integer", "null"], "minimum": -(2**63), "maximum": 2**64 - 1},
    "user": {"type": "string"},
    "presence_penalty": {"type": ["number", "null"], "minimum": -2, "maximum": 2},
    "frequency_penalty": {"type": ["number", "null"], "minimum": -2, "maximum": 2},
    # vLLM's extras, checked as vLLM checks them
    "priority": {"type": ["integer", "null"], "minimum": -(2**31), "maximum": 2**31 - 1,
                 "description": "the engine queue's priority (vLLM's priority scheduling, "
                                "lower first), within the tenant's ceiling"},
    "min_tokens": {"type": ["integer", "null"], "minimum": 0, "maximum": 2**31 - 1},
    "ignore_eos": {"type": ["boolean", "null"]},
    "cache_salt": {"type": ["string", "null"], "minLength": 1},
}
# strict base64: whole quanta, the last one padded or not (``protocol.validate``)
_DATA_URL = ("^data:image/(png|jpeg|jpg|gif|webp);base64,(?:[A-Za-z0-9+/]{4})*"
             "(?:[A-Za-z0-9+/]{4}|[A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)$")
_MESSAGE = {"type": "object", "required": ["role"], "properties": {
    "role": {"type": "string",
             "enum": ["system", "developer", "user", "assistant", "tool", "function"]},
    "content": {"oneOf": [{"type": "string"}, {"type": "null"}, {"type": "array", "items": {
        "oneOf": [{"type": "object", "required": ["type", "text"],
                   "properties": {"type": {"const": "text"}, "text": {"type": "string"}}},
                  {"type": "object", "required": ["type", "image_url"],
                   "description": "models whose policy has an images section",
                   "properties": {"type": {"const": "image_url"}, "image_url": {
                       "type": "object", "required": ["url"],
                       "properties": {"url": {"type": "string", "pattern": _DATA_URL}}}}}]}}]},
    "name": {"type": "string"}}}


def _chat(max_messages: int) -> dict[str, Any]:
    return {"type": "object", "required": ["model", "messages"], "properties": {
        **_COMMON,
        "messages": {"type": "array", "items": _MESSAGE, "minItems": 1,
                     "maxItems": max_messages},
        "max_completion_tokens": {"type": ["integer", "null"], "minimum": 1,
                                  "maximum": 2**31 - 1}}}


_COMPLETION = {"type": "object", "required": ["model", "prompt"], "properties": {
    **_COMMON,
    "prompt": {"oneOf": [{"type": "string", "minLength": 1},
                         {"type": "array", "items": {"type": "string", "minLength": 1},
                          "minItems": 1, "maxItems": 1},
                         {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                     "maximum": 2**31 - 1},
                          "minItems": 1}]}}}
_SSE = {"text/event-stream": {"schema": {"type": "string"}}}
_TEXT_PART = {"type": "object", "required": ["type", "text"], "properties": {
    "type": {"enum": ["input_text", "output_text"]}, "text": {"type": "string"}}}
def _responses(max_messages: int) -> dict[str, Any]:
    """A Responses request; its items become at most one message each, the instructions
    one more."""
    return {**_RESPONSES, "properties": {**_RESPONSES["properties"], "input": {
        "oneOf": [{"type": "string"}, {**_RESPONSES["properties"]["input"]["oneOf"][1],
                                       "maxItems": max_messages - 1}]}}}


_RESPONSES: dict[str, Any] = {
    "type": "object", "required": ["model", "input"], "additionalProperties": False,
    "properties": {
    "model": {"type": "string", "minLength": 1},
    "input": {"oneOf": [{"type": "string"}, {"type": "array", "minItems": 1, "items": {
        "oneOf": [
            {"type": "object", "required": ["role", "content"], "properties": {
                "type": {"const": "message"},
                "role": {"enum": ["user", "assistant", "system", "developer"]},
                "content": {"oneOf": [{"type": "string"},
                                      {"type": "array", "items": _TEXT_PART}]}}},
            {"type": "object", "required": ["type", "call_id", "name", "arguments"],
             "properties": {"type": {"const": "function_call"}, "call_id": {"type": "string"},
                            "name": {"type": "string"}, "arguments": {"type": "string"}}},
            {"type": "object", "required": ["type", "call_id", "output"],
             "properties": {"type": {"const": "function_call_output"},
                            "call_id": {"type": "string"}, "output": {"type": "string"}}}]}}]},
    "instructions": {"type": ["string", "null"]},
    "max_output_tokens": {"type": ["integer", "null"], "minimum": 1, "maximum": 2**31 - 1},
    "stream": {"type": ["boolean", "null"]},
    "store": {"const": False, "description": "responses are not stored (stateless)"},
    "temperature": {"type": ["number", "null"], "minimum": 0, "maximum": 2},
    "top_p": {"type": ["number", "null"], "minimum": 0, "maximum": 1},
    "tools": {"type": "array", "items": {
        "type": "object", "required": ["type", "name"],
        "properties": {"type": {"const": "function"}, "name": {"type": "string"},
                       "description": {"type": "string"}, "parameters": {"type": "object"}}}},
    "tool_choice": {"enum": ["auto", "none", "required"]},
    "user": {"type": "string"}}}
_EMBEDDINGS = {"type": "object", "required": ["model", "input"], "additionalProperties": False,
               "properties": {
    "model": {"type": "string", "minLength": 1},
    "input": {"oneOf": [
        {"type": "string", "minLength": 1},
        {"type": "array", "minItems": 1, "maxItems": 2048,
         "items": {"type": "string", "minLength": 1}},
        {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0,
                                                     "maximum": 2**31 - 1}},
        {"type": "array", "minItems": 1, "maxItems": 2048, "items": {
            "type": "array", "minItems": 1,
            "items": {"type": "integer", "minimum": 0, "maximum": 2**31 - 1}}}]},
    "encoding_format": {"enum": ["float", "base64"]},
    "dimensions": {"type": "integer", "minimum": 1, "maximum": 65536},
    "user": {"type": "string"}}}


def _generation(summary: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"post": {
        "summary": summary, "security": [{"bearer": []}],
        "parameters": [
            {"name": "x-slo-ttft-ms", "in": "header",
             "schema": {"type": "number", "exclusiveMinimum": 0}},
            {"name": "x-slo-tpot-ms", "in": "header",
             "schema": {"type": "number", "exclusiveMinimum": 0}},
            {"name": "x-priority", "in": "header",
             "schema": {"type": "string", "enum": ["critical", "standard", "flex"]}},
            {"name": "X-Request-Id", "in": "header", "schema": {"type": "string"}}],
        "requestBody": {"required": True, "content": {"application/json": {"schema": schema}}},
        "responses": {"200": {"description": "The completion (or its event stream)",
                              "content": {"application/json": {"schema": {"type": "object"}},
                                          **_SSE}},
                      **_errors(*_GEN_ERRORS)}}}


def _admin(summary: str) -> dict[str, Any]:
    return {"get": {"summary": summary, "security": [{"bearer": []}],
                    "responses": {"200": {"description": "State as JSON", "content": {
                        "application/json": {"schema": {"type": "object"}}}},
                        **_errors(400, 401)}}}


def _plain(summary: str, *errors: int) -> dict[str, Any]:
    return {"get": {"summary": summary, "responses": {
        "200": {"description": summary, "content": {"text/plain": {"schema": {
            "type": "string"}}}}, **_errors(*errors)}}}


def document(max_messages: int = 4096) -> dict[str, Any]:
    """The document for a policy whose ``settings.max_messages`` is ``max_messages``."""
    return {
        "openapi": "3.1.0",
        "info": {"title": "tokengate", "version": "1",
                 "description": "A token-aware OpenAI-compatible inference gateway."},
        "paths": {
            "/v1/chat/completions": _generation("Chat completion", _chat(max_messages)),
            "/v1/completions": _generation("Text completion", _COMPLETION),
            "/v1/responses": _generation("Response (stateless)", _responses(max_messages)),
            "/v1/embeddings": _generation("Embeddings", _EMBEDDINGS),
            "/v1/models": {"get": {"summary": "Models the key may use",
                                   "security": [{"bearer": []}],
                                   "responses": {"200": {"description": "Model list",
                                                         "content": {"application/json": {
                                                             "schema": {"type": "object"}}}},
                                                 **_errors(400, 401)}}},
            "/health": _plain("Liveness", 400),
            "/ready": {"get": {"summary": "Readiness (503 while draining)", "responses": {
                "200": {"description": "ready"}, "503": {"description": "draining"},
                **_errors(400)}}},
            "/metrics": {"get": {**_plain("Prometheus metrics", 400, 401)["get"],
                                 "description": "Behind the admin key when one is set, unless "
                                 "settings.public_metrics.", "security": [{"bearer": []}]}},
            "/admin": _admin("Every admin route, its method and what it answers"),
            "/admin/policy": _admin("The policy in force"),
            "/admin/spend": _admin("Spend by day and group, or over a sliding window"),
            "/admin/flow": _admin("Flow control: queues, flows and their shares"),
            "/admin/endpoints": _admin("Endpoints and their live state"),
            "/admin/limiter": _admin("The rate store"),
            "/admin/predictor": _admin("The latency predictor"),
            "/admin/scaling": _admin("Scaling pools: velocity, desired replicas, instances"),
            "/admin/drain": {"post": {
                "summary": "Take an endpoint out of rotation (or back) and move its streams",
                "security": [{"bearer": []}],
                "requestBody": {"required": True, "content": {"application/json": {"schema": {
                    "type": "object", "required": ["url"],
                    "properties": {"url": {"type": "string"}, "undrain": {"type": "boolean"}}}}}},
                "responses": {"200": {"description": "Its new state", "content": {
                    "application/json": {"schema": {"type": "object"}}}},
                    **_errors(400, 401, 404)}}},
        },
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
            "schemas": {"Error": {
                "type": "object", "required": ["error"], "properties": {"error": {
                    "type": "object", "required": ["message", "type", "param", "code"],
                    "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                                   "param": {"type": ["string", "null"]},
                                   "code": {"type": ["string", "null"]}}}}}},
        },
    }

"""One upstream endpoint of a model in the policy: its URL and credentials, its role, its
hardware, its TLS trust, and where its engine publishes KV-cache events."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import urlsplit

from gateway.config import schema
from gateway.config.decode import Decoder


@dataclass(frozen=True, slots=True)
class KVEvents:
    """Where an engine publishes its KV-cache events (vLLM's ``--kv-events-config``, written as
    the engine was given it: the gateway binds where the engine connects and connects where it
    binds, by vLLM's rule)."""

    endpoint: str  # the engine's publisher address, e.g. tcp://127.0.0.1:5557
    replay: str | None = None  # its replay (ROUTER) address
    topic: str = ""


@dataclass(frozen=True, slots=True)
class Endpoint:
    url: str
    api_key_env: str | None = None
    api_key: str | None = None  # inline secrets are allowed but discouraged
    role: Literal["both", "prefill", "decode"] = "both"
    hardware: str | None = None  # accelerator profile name: a predictor feature
    tls_ca_file: str | None = None  # CA bundle for an https endpoint (default: the system's)
    kv_events: KVEvents | None = None  # the engine's KV event stream (the precise index)


@dataclass(frozen=True, slots=True)
class KVPool:
    """The shared KV pool a model's engines put blocks into and fetch from
    (``tokengate kvpool``, Mooncake Store's role): its URL (the gateway reads its capacity
    from ``/metrics``) and, for the precise index, its KV event stream."""

    url: str
    kv_events: KVEvents | None = None


# What the gateway appends to a base URL; a URL that already ends with one was pasted whole.
_OPERATIONS = ("/chat/completions", "/completions", "/embeddings", "/responses", "/models",
               "/tokenize", "/health", "/metrics")


def not_a_base_url(url: str) -> str | None:
    """Why ``url`` is not an OpenAI base URL (the one an OpenAI client is given, to which
    ``/chat/completions`` is appended), or None when it is one."""
    parts = urlsplit(url)
    example = f"{parts.scheme}://{parts.netloc}/v1"
    if parts.query or parts.fragment:
        return f"expected a base URL without a query or fragment, e.g. {example}"
    if not parts.path.strip("/"):
        return (f"expected an OpenAI base URL, with its path: {url!r} has none (engines such "
                f"as vLLM and SGLang serve under /v1: {example})")
    for op in _OPERATIONS:
        if parts.path.rstrip("/").endswith(op):
            base = url.rstrip("/")[: -len(op)]
            return (f"expected an OpenAI base URL, not an operation's: the gateway appends "
                    f"{op} itself (did you mean {base}?)")
    return None


def parse_kv_pool(d: Decoder, raw: Any, p: str) -> KVPool:
    m = d.mapping(raw, p, schema.keys("kv_pool"), schema.required("kv_pool"))
    url = d.string(m["url"], f"{p}.url").rstrip("/")
    if not url.startswith(("http://", "https://")) or "@" in urlsplit(url).netloc:
        raise d.fail(f"{p}.url", f"expected an http(s) URL without credentials, got {url!r}")
    kve = _kv_events(d, m["kv_events"], f"{p}.kv_events") if "kv_events" in m else None
    return KVPool(url, kve)


def parse_endpoint(d: Decoder, e: Any, p: str) -> Endpoint:
    em = d.mapping(e, p, schema.keys("endpoint"), schema.required("endpoint"))
    url = d.string(em["url"], f"{p}.url").rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise d.fail(f"{p}.url", f"expected an http(s) URL, got {url!r}")
    if "@" in urlsplit(url).netloc:
        raise d.fail(f"{p}.url", "credentials in the URL are not sent: use api_key_env")
    if (why := not_a_base_url(url)) is not None:
        raise d.fail(f"{p}.url", why)
    ca = d.string(em["tls_ca_file"], f"{p}.tls_ca_file") if "tls_ca_file" in em else None
    if ca is not None and not url.startswith("https://"):
        raise d.fail(f"{p}.tls_ca_file", "applies to https endpoints only")
    role = em.get("role", "both")
    if role not in ("both", "prefill", "decode"):
        raise d.fail(f"{p}.role", "expected both, prefill or decode")
    hw = d.string(em["hardware"], f"{p}.hardware") if "hardware" in em else None
    kve = _kv_events(d, em["kv_events"], f"{p}.kv_events") if "kv_events" in em else None
    return Endpoint(url, em.get("api_key_env"), em.get("api_key"), role, hw, ca, kve)


def _zmq_address(d: Decoder, raw: Any, path: str) -> str:
    addr = d.string(raw, path)
    if not addr.startswith(("tcp://", "ipc://")):
        raise d.fail(path, f"expected a ZMQ address (tcp://host:port or ipc://path), got "
                     f"{addr!r}")
    if addr.startswith("tcp://") and not addr.rsplit(":", 1)[-1].isdigit():
        raise d.fail(path, f"expected tcp://host:port, got {addr!r}")
    return addr


def _kv_events(d: Decoder, raw: Any, path: str) -> KVEvents:
    m = d.mapping(raw, path, schema.keys("kv_events"), schema.required("kv_events"))
    replay = _zmq_address(d, m["replay"], f"{path}.replay") if "replay" in m else None
    topic = d.string(m["topic"], f"{path}.topic") if "topic" in m else ""
    return KVEvents(_zmq_address(d, m["endpoint"], f"{path}.endpoint"), replay, topic)

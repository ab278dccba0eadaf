"""The EPP's routing step: the same decision ``tokengate serve`` takes (hold while the pool
wakes from zero, route, hold to the SLO; the prefill endpoint too, whose prefill runs here as
llm-d's EPP has its sidecar run it), narrowed to the proxy's subset, but nothing is sent:
Envoy sends. What comes back is where to send, and the exact body and headers to send."""

from __future__ import annotations

import dataclasses
import functools
import ipaddress
import math
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

from gateway.config.policy import Model
from gateway.request.attempt import Attempt
from gateway.request.context import RequestContext
from gateway.request.dispatch import (
    Opener,
    embeddings_body,
    prefill,
    traced_route,
    upstream_body,
    upstream_span,
)
from gateway.request.failure import unreachable
from gateway.routing.endpoints import EndpointPool, EndpointState
from gateway.routing.plugins import Candidate, RequestInfo
from gateway.routing.router import Decision, Router
from gateway.state import GatewayState
from protocol.errors import APIError


@dataclass(slots=True)
class Picked:
    """Where Envoy sends the request, and what routing decided and promised for it."""

    decision: Decision
    router: Router
    attempt: Attempt  # the endpoint's share, from its ticket to its hand-back
    info: RequestInfo
    destination: str  # ip:port
    path: str  # the upstream path (the endpoint's base path, then the API's)
    body: bytes
    prefill_used: bool
    started_at: float  # the prefill's start when prefilled elsewhere, else the pick's end
    # the endpoints the proxy may fall back to, in order, when ``destination`` cannot be
    # reached (GIE's fallback list); the request Envoy sends them is the very same
    fallbacks: tuple[Candidate, ...] = ()

    @property
    def ttft_origin(self) -> float:
        return self.started_at

    @property
    def destinations(self) -> str:
        """The protocol's ``x-gateway-destination-endpoint``: ``ip:port[,ip:port...]``."""
        return ",".join((self.destination, *(hostport(c.ep.url) for c in self.fallbacks)))

    def served_by(self, state: GatewayState, ctx: RequestContext, served: str) -> bool:
        """The proxy says ``served`` (an ``ip:port``) served the request. When that is one
        of the fallbacks, the pick could not be reached and is judged so, and the request is
        now the served endpoint's: its ticket, its in-flight count, its settlement. False
        when ``served`` is neither the pick nor a fallback."""
        if served == self.destination:
            return True
        c = next((c for c in self.fallbacks if hostport(c.ep.url) == served), None)
        if c is None:
            return False
        old = self.attempt
        old.failed(unreachable())
        state.metrics.series("retries", ctx.parsed.model, "proxy_fallback").inc()
        self.attempt = Attempt(state, ctx, old.pool, c.ep, old.ticket.tokens,
                               c.uncached_tokens,
                               upstream_span(ctx, self.router.model, c.ep.url, False, 2))
        self.decision = dataclasses.replace(self.decision, endpoint=c)
        self.destination, self.fallbacks = served, ()
        return True


_RESOLVED: dict[tuple[str, int], tuple[str, float]] = {}
RESOLVE_TTL_S = 5.0  # a pod's DNS name (a StatefulSet's) follows the pod when it moves


def hostport(url: str) -> str:
    """``ip:port`` of an endpoint URL, as ``ORIGINAL_DST`` takes it: the cluster connects to
    addresses, so a host name is resolved (again after ``RESOLVE_TTL_S``)."""
    u = urlsplit(url)
    host = u.hostname or "127.0.0.1"
    port = u.port or (443 if u.scheme == "https" else 80)
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        cached = _RESOLVED.get((host, port))
        now = time.monotonic()
        if cached is None or cached[1] < now:
            addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][4][0]
            cached = _RESOLVED[(host, port)] = (str(addr), now + RESOLVE_TTL_S)
        ip = ipaddress.ip_address(cached[0])
    return f"[{ip}]:{port}" if ip.version == 6 else f"{ip}:{port}"


def fallbacks(state: GatewayState, m: Model, pool: EndpointPool, d: Decision,
              prefilled: bool) -> tuple[Candidate, ...]:
    """The candidates after the pick, best predicted first, that could take the very request
    Envoy sends the pick: the same key and base path, no prefill done for it elsewhere, no
    adapter loaded for it; at most ``settings.epp_endpoints - 1``."""
    n = state.view.policy.settings.epp_endpoints - 1
    if n <= 0 or prefilled or m.lora is not None:
        return ()
    ep = d.endpoint.ep
    path, auth = urlsplit(ep.url).path.rstrip("/"), pool.auth_headers(ep)
    same = [c for c in d.considered if c.ep is not ep and c.ep.role != "prefill"
            and urlsplit(c.ep.url).path.rstrip("/") == path and pool.auth_headers(c.ep) == auth]
    same.sort(key=lambda c: math.inf if math.isnan(c.ttft_ms) else c.ttft_ms)
    return tuple(same[:n])


def outside(allowed: set[str] | None
            ) -> Callable[[EndpointPool], Sequence[EndpointState]] | None:
    """The ``exclude`` of ``dispatch.route`` for the proxy's subset (None: no subset)."""
    if allowed is None:
        return None
    return functools.partial(_outside, allowed)


def _outside(allowed: set[str], pool: EndpointPool) -> Sequence[EndpointState]:
    return [e for e in pool.endpoints if hostport(e.url) not in allowed]


def picker(allowed: set[str] | None) -> Opener[Picked]:
    """An ``Opener`` for ``dispatch.open_request`` that picks within ``allowed``."""
    async def pick(state: GatewayState, ctx: RequestContext, m: Model, prompt_tokens: int,
                   reserved: int) -> Picked | APIError:
        return await pick_model(state, ctx, m, prompt_tokens, reserved, allowed)
    return pick


async def pick_model(state: GatewayState, ctx: RequestContext, m: Model, prompt_tokens: int,
                     reserved: int, allowed: set[str] | None) -> Picked | APIError:
    routed = await traced_route(state, ctx, m, prompt_tokens, reserved, outside(allowed))
    if isinstance(routed, APIError):
        return routed
    router, info, d = routed
    pool = router.pool
    started_at = time.perf_counter()
    kv = await prefill(state, ctx, m, router, d)
    state.metrics.series("routing_decisions", m.name, router.strategy, d.endpoint.ep.url,
                         "decode" if d.prefill else "sole").inc()
    ep = d.endpoint.ep
    a = Attempt(state, ctx, pool, ep, info.prompt_tokens + reserved,
                0 if kv is not None else d.endpoint.uncached_tokens,
                upstream_span(ctx, m, ep.url, kv is not None, 1))
    api = "/chat/completions" if ctx.kind == "chat" else "/completions"
    return Picked(d, router, a, info, hostport(ep.url),
                  urlsplit(ep.url).path.rstrip("/") + api, upstream_body(ctx, m, kv),
                  kv is not None, started_at if kv is not None else time.perf_counter(),
                  fallbacks(state, m, pool, d, kv is not None))


def embeddings_picker(allowed: set[str] | None) -> Opener[Picked]:
    """An ``Opener`` for an embeddings request: routed within ``allowed``, sent whole to the
    endpoint's ``/embeddings``."""
    async def pick(state: GatewayState, ctx: RequestContext, m: Model, prompt_tokens: int,
                   reserved: int) -> Picked | APIError:
        routed = await traced_route(state, ctx, m, prompt_tokens, 0, outside(allowed))
        if isinstance(routed, APIError):
            return routed
        router, info, d = routed
        ep = d.endpoint.ep
        state.metrics.series("routing_decisions", m.name, router.strategy, ep.url,
                             "sole").inc()
        a = Attempt(state, ctx, router.pool, ep, prompt_tokens, d.endpoint.uncached_tokens,
                    upstream_span(ctx, m, ep.url, False, 1))
        body = embeddings_body(ctx, m)
        return Picked(d, router, a, info, hostport(ep.url),
                      urlsplit(ep.url).path.rstrip("/") + "/embeddings", body, False,
                      time.perf_counter(), fallbacks(state, m, router.pool, d, False))
    return pick

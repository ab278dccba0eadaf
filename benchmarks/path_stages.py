"""Which stage of the request path a sampled stack is in (``benchmarks.path``): the rules, from
a py-spy frame's path and function, and each stage's share of a raw profile.

Metrics, tracing, logging and counting are theirs wherever they are called from (the innermost
such frame decides); settlement, the spend record and rebuilding a non-streamed answer own
everything below them (the outermost such frame decides); otherwise the innermost frame of the
gateway's own code that names a step, then aiohttp (accept and parse) and the event loop.
"""

from __future__ import annotations

from collections import Counter

STAGES = ("accept and parse", "validate", "count", "admit", "route", "send", "relay",
          "rebuild", "settle", "spend record", "metrics", "trace", "log", "event loop",
          "other")
# Frames (path fragments) whose work is one stage wherever it is called from: the innermost
# such frame of a sample decides.
CROSSCUT = (("prometheus_client/", "metrics"), ("gateway/metrics.py", "metrics"),
            ("opentelemetry/", "trace"), ("gateway/tracing.py", "trace"),
            ("/logging/", "log"), ("protocol/logs.py", "log"), ("protocol/log_writer.py", "log"),
            ("gateway/counting/", "count"),
            ("tiktoken", "count"), ("tokenizers/", "count"))
# Frames whose whole subtree is one stage (the outermost such frame decides): settlement
# (its Redis calls included), the spend record, rebuilding a non-streamed answer.
CONTEXT = (("gateway/request/settle.py", "settle"), ("gateway/spend/", "spend record"),
           ("gateway/request/aggregate.py", "rebuild"))
# Otherwise the innermost frame of the gateway's own code that names a step.
STEP = (("protocol/validate.py:load_json", "accept and parse"),
        ("gateway/epp/pick.py", "route"), ("gateway/epp/feed.py", "relay"),
        ("gateway/epp/", "accept and parse"), ("grpc/", "accept and parse"),
        ("google/protobuf", "accept and parse"),
        ("gateway/request/upstream.py", "send"), ("aiohttp/client", "send"),
        ("aiohttp/connector", "send"), ("gateway/request/attempt.py", "send"),
        ("gateway/request/dispatch.py", "send"),
        ("gateway/request/relay.py", "relay"), ("gateway/request/respond.py", "relay"),
        ("gateway/routing/", "route"), ("predictor/", "route"),
        ("gateway/quota/", "admit"), ("gateway/flow/", "admit"),
        ("gateway/request/admission.py", "admit"), ("gateway/request/pipeline.py:admit", "admit"),
        ("gateway/request/pipeline.py:_reserve", "admit"), ("redis/", "admit"),
        ("protocol/validate.py", "validate"), ("gateway/request/fields.py", "validate"),
        ("protocol/responses.py", "validate"),
        ("gateway/request/", "accept and parse"), ("gateway/front/", "accept and parse"),
        ("aiohttp/", "accept and parse"), ("asyncio/", "event loop"), ("uvloop", "event loop"))


def _frame(raw: str) -> tuple[str, str]:
    """(path, function) of one py-spy frame, ``func (path:line)``."""
    func, _, rest = raw.partition(" (")
    return rest.rsplit(":", 1)[0].replace("\\", "/"), func


def _match(frame: tuple[str, str], rules: tuple[tuple[str, str], ...]) -> str | None:
    path, func = frame
    for frag, stage in rules:
        p, _, f = frag.partition(":")
        if p in path and (not f or f == func):
            return stage
    return None


def stage_of(stack: list[str]) -> str:
    """The stage of one sampled stack (root first)."""
    frames = [_frame(f) for f in stack]
    for fr in reversed(frames):
        got = _match(fr, CROSSCUT)
        if got:
            return got
    for fr in frames:
        got = _match(fr, CONTEXT)
        if got:
            return got
    for fr in reversed(frames):
        got = _match(fr, STEP)
        if got:
            return got
    return "other"


def idle(stack: list[str]) -> bool:
    """A thread blocked in ``threading.Condition.wait`` (the log writer between batches): py-spy
    can sample it as running, though it waits on a lock and spends no CPU."""
    path, func = _frame(stack[-1])
    return func == "Condition.wait" and path.endswith("threading.py")


def shares(raw: str) -> tuple[dict[str, float], int]:
    """Each stage's share of a py-spy ``--format raw`` profile, and the samples counted
    (threads waiting on a lock left out)."""
    counts: Counter[str] = Counter()
    for line in raw.splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        frames = stack.split(";")
        if idle(frames):
            continue
        counts[stage_of(frames)] += int(n)
    total = sum(counts.values())
    return ({s: counts[s] / total for s in STAGES} if total else {}), total

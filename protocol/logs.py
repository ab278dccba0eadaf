"""Log lines for people and for machines: ``--log-format text`` (the default) or ``json``
(one object per line), and on every line written while a request is being served its
request id, tenant, model and, once known, outcome.

A front binds a request's fields when it has them (``bind``); asyncio copies the binding into
every task started from there, so settlement running after the answer still names it."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass

import orjson

from protocol.log_writer import BatchedHandler

LEVELS = ("debug", "info", "warning", "error")
FORMAT_ENV = "TOKENGATE_LOG_FORMAT"


@dataclass(slots=True)
class RequestFields:
    request_id: str
    tenant: str | None = None
    model: str | None = None
    outcome: str | None = None  # "200", "429", "abandoned": how the request ended


_REQUEST: ContextVar[RequestFields | None] = ContextVar("tokengate_request", default=None)


def bind(request_id: str, tenant: str | None = None, model: str | None = None
         ) -> RequestFields:
    """Name the request being served in this task and the tasks it starts."""
    fields = RequestFields(request_id, tenant, model)
    _REQUEST.set(fields)
    return fields


def outcome(value: str) -> None:
    """How the request bound here ended (the lines after this carry it)."""
    fields = _REQUEST.get()
    if fields is not None:
        fields.outcome = value


def _request_items() -> dict[str, str]:
    fields = _REQUEST.get()
    if fields is None:
        return {}
    out = {"request_id": fields.request_id}
    for k in ("tenant", "model", "outcome"):
        v = getattr(fields, k)
        if v is not None:
            out[k] = v
    return out


class _Stamp:
    """A time stamp's text to the second, made once per second."""

    def __init__(self, fmt: str, convert: Callable[[float | None], time.struct_time]) -> None:
        self.fmt, self.convert = fmt, convert
        self.second, self.text = -1, ""

    def __call__(self, created: float) -> str:
        second = int(created)
        if second != self.second:
            self.second, self.text = second, time.strftime(self.fmt, self.convert(second))
        return self.text


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")
        self._stamp = _Stamp("%Y-%m-%d %H:%M:%S", self.converter)

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        return f"{self._stamp(record.created)},{int(record.msecs):03d}"

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        items = getattr(record, "request", None) or {}
        if not items:
            return line
        return f"{line} [{' '.join(f'{k}={v}' for k, v in items.items())}]"


class JSONFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__()
        self._stamp = _Stamp("%Y-%m-%dT%H:%M:%S", time.gmtime)

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, object] = {
            "time": f"{self._stamp(record.created)}.{int(record.msecs):03d}Z",
            "level": record.levelname.lower(), "logger": record.name,
            "message": record.getMessage(), **(getattr(record, "request", None) or {})}
        if record.exc_info and not record.exc_text:
            record.exc_text = self.formatException(record.exc_info)
        if record.exc_text:
            out["exception"] = record.exc_text
        return orjson.dumps(out).decode()


class _RequestFilter(logging.Filter):
    """Stamps each record with the request bound where it was logged."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.request = _request_items()
        return True


def add_log_args(p: argparse.ArgumentParser, level: str = "info") -> None:
    p.add_argument("--log-level", choices=LEVELS, default=level,
                   help=f"the least severe lines written (default: {level})")
    p.add_argument("--log-format", choices=("text", "json"),
                   default=os.environ.get(FORMAT_ENV, "text"),
                   help=f"text for people, json (one object per line) for log pipelines "
                   f"(env {FORMAT_ENV}; default: text)")


class _Handler(BatchedHandler):
    """The handler ``configure`` installs (told apart from anyone else's)."""


def configure(level: str = "info", fmt: str = "text") -> None:
    """Route every logger to stderr in ``fmt`` at ``level``, as ``logging.basicConfig`` does:
    only when logging is not configured already (by an embedding program, or a test runner
    capturing logs); a handler of an earlier call is replaced. Lines are written in batches by
    a thread (``protocol.log_writer``): within 50 ms, an error or worse at once."""
    root = logging.getLogger()
    for h in [h for h in root.handlers if isinstance(h, _Handler)]:
        root.removeHandler(h)
        h.close()
    if root.handlers:
        return
    # None of our formats names the caller's file and line, thread or process: not looked up
    logging._srcfile = None
    logging.logThreads = logging.logProcesses = logging.logMultiprocessing = False
    handler = _Handler(sys.stderr)
    handler.setFormatter(JSONFormatter() if fmt == "json" else TextFormatter())
    handler.addFilter(_RequestFilter())
    root.addHandler(handler)
    root.setLevel(level.upper())

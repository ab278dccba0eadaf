"""The log handler ``tokengate`` installs (``protocol.log_writer``): lines written by a thread
in batches, in order, none lost at close, an error at once; a caller never blocked by a stalled
output; past the limit lines are dropped and counted, never queued without bound."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from protocol.log_writer import BatchedHandler


@pytest.fixture
def logger() -> Iterator[logging.Logger]:
    log = logging.getLogger(f"test.log_writer.{time.monotonic_ns()}")
    log.propagate = False
    log.setLevel(logging.INFO)
    yield log
    for h in list(log.handlers):
        log.removeHandler(h)
        h.close()


def _attach(log: logging.Logger, stream: Any, **kw: Any) -> BatchedHandler:
    h = BatchedHandler(stream, **kw)
    h.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    log.addHandler(h)
    return h


def test_lines_are_written_in_order_and_none_is_lost_at_close(logger: logging.Logger) -> None:
    r, w = os.pipe()
    out = os.fdopen(w, "w")
    got: list[str] = []

    def read() -> None:
        with os.fdopen(r) as f:
            got.extend(f.read().splitlines())

    reader = threading.Thread(target=read)
    reader.start()
    h = _attach(logger, out, delay_s=0.05)
    for i in range(5000):
        logger.info("line %d of %s", i, "many")
    h.close()
    out.close()
    reader.join(10)
    assert got == [f"INFO line {i} of many" for i in range(5000)]


def test_a_line_arrives_within_the_delay_and_an_error_at_once(logger: logging.Logger) -> None:
    r, w = os.pipe()
    out = os.fdopen(w, "w")
    h = _attach(logger, out, delay_s=0.3)
    reader = os.fdopen(r)
    t0 = time.monotonic()
    logger.info("quiet")
    assert reader.readline() == "INFO quiet\n"
    waited = time.monotonic() - t0
    assert 0.2 < waited < 2.0  # batched: not written at once
    t0 = time.monotonic()
    logger.warning("a warning")  # batched as any other line
    logger.error("loud")
    assert reader.readline() == "WARNING a warning\n"
    assert reader.readline() == "ERROR loud\n"
    assert time.monotonic() - t0 < 0.2  # not held for the batch
    h.close()
    out.close()
    reader.close()


def test_a_stalled_output_never_blocks_the_caller_and_drops_are_counted(
        logger: logging.Logger) -> None:
    r, w = os.pipe()
    out = os.fdopen(w, "w")
    h = _attach(logger, out, delay_s=0.01, limit=1000)
    # Nobody reads the pipe: once its buffer (64 KiB) is full the writer thread blocks.
    t0 = time.monotonic()
    for i in range(20_000):
        logger.info("x" * 100 + " %d", i)
    assert time.monotonic() - t0 < 5.0  # the caller was never held by the full pipe
    # Drain the pipe; everything queued is then written, and a warning counts the rest.
    got: list[str] = []

    def read() -> None:
        with os.fdopen(r) as f:
            got.extend(f)

    t = threading.Thread(target=read)
    t.start()
    h.close()
    out.close()
    t.join(10)
    # one warning per batch written after drops (the writer may have got through a batch
    # while the caller was still logging): together they count every line dropped
    dropped = [line for line in got if "log lines were dropped" in line]
    assert dropped
    n = sum(int(line.split()[1]) for line in dropped)
    written = [line for line in got if line.startswith("INFO x")]
    assert n > 0 and len(written) + n == 20_000
    # What was written is in order, oldest first: the newest were dropped.
    numbers = [int(line.rsplit(" ", 1)[1]) for line in written]
    assert numbers == sorted(numbers) and numbers[0] == 0


def test_an_exception_is_written_with_its_traceback(logger: logging.Logger) -> None:
    r, w = os.pipe()
    out = os.fdopen(w, "w")
    h = _attach(logger, out)
    try:
        raise ValueError("bad thing")
    except ValueError:
        logger.exception("it failed")
    h.close()
    out.close()
    with os.fdopen(r) as f:
        text = f.read()
    assert text.startswith("ERROR it failed\nTraceback")
    assert "ValueError: bad thing" in text


def test_a_forked_child_does_not_write_its_parents_lines(logger: logging.Logger) -> None:
    r, w = os.pipe()
    out = os.fdopen(w, "w")
    h = _attach(logger, out, delay_s=5.0)  # the parent's line waits for its batch
    logger.info("the parent's")
    pid = os.fork()
    if pid == 0:  # the child: its own line only, then out at once
        logger.info("the child's")
        h.flush()
        os._exit(0)
    os.waitpid(pid, 0)
    h.close()
    out.close()
    with os.fdopen(r) as f:
        got = f.read().splitlines()
    assert sorted(got) == ["INFO the child's", "INFO the parent's"]

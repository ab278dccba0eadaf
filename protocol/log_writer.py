"""A log handler whose lines are written by a thread of their own, in batches: logging a line
costs the caller (the event loop) no system call, and a slow or blocked stderr (a full pipe to
a log collector) never stalls it.

A record is frozen when logged (its message rendered, an exception's traceback turned into
text) and queued; the writer formats and writes what has queued at most ``delay_s`` after the
first of it, at once for an error or worse, and everything left when the handler is flushed
or closed (``logging.shutdown`` does both at exit). Beyond ``limit`` unwritten records the
newest are dropped and counted, and a warning says how many once writing resumes.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections import deque
from typing import TextIO


class BatchedHandler(logging.Handler):
    def __init__(self, stream: TextIO, delay_s: float = 0.05, limit: int = 100_000) -> None:
        super().__init__()
        self.stream = stream
        self.delay_s = delay_s
        self.limit = limit
        self._queue: deque[logging.LogRecord] = deque()
        self._dropped = 0  # records dropped since the start (emit adds)
        self._reported = 0  # of which a warning has said (flush adds)
        self._wake = threading.Event()  # something queued into an empty queue
        self._urgent = threading.Event()  # an error or worse: no waiting for more
        self._writing = threading.Lock()  # one batch written at a time, in order
        self._pid = 0  # the process whose writer thread runs
        self._closed = False
        me = weakref.ref(self)

        def forked() -> None:
            h = me()
            if h is not None:
                h._forked()

        os.register_at_fork(after_in_child=forked)

    def _forked(self) -> None:
        """In a forked child: the parent's queued lines are the parent's to write."""
        self._queue.clear()
        self._dropped = self._reported = 0
        self._wake, self._urgent = threading.Event(), threading.Event()
        self._writing = threading.Lock()
        self._pid = 0

    def emit(self, record: logging.LogRecord) -> None:
        try:
            record.msg, record.args = record.getMessage(), None
            if record.exc_info:
                if not record.exc_text:
                    record.exc_text = logging.Formatter().formatException(record.exc_info)
                record.exc_info = None  # its frames are not kept alive until written
        except Exception:
            self.handleError(record)
            return
        if self._closed:
            with self._writing:
                self._write([record], 0)
            return
        if len(self._queue) >= self.limit:
            self._dropped += 1
            return
        was_empty = not self._queue
        self._queue.append(record)
        if self._pid != os.getpid():
            self._start()
        if record.levelno >= logging.ERROR:
            self._urgent.set()
        if was_empty:
            self._wake.set()

    def _start(self) -> None:
        self._pid = os.getpid()
        threading.Thread(target=self._run, name="tokengate-log-writer", daemon=True).start()

    def _run(self) -> None:
        while not self._closed:
            self._wake.wait()
            self._wake.clear()
            self._urgent.wait(self.delay_s)
            self._urgent.clear()
            self.flush()

    def flush(self) -> None:
        """Write everything queued so far, now, in the calling thread."""
        with self._writing:
            batch = [self._queue.popleft() for _ in range(len(self._queue))]
            # emit only adds to _dropped and this only to _reported: no update is lost
            dropped, self._reported = self._dropped - self._reported, self._dropped
            self._write(batch, dropped)

    def _write(self, batch: list[logging.LogRecord], dropped: int) -> None:
        if dropped:
            batch.append(logging.LogRecord(
                "tokengate.logs", logging.WARNING, __file__, 0,
                f"{dropped} log lines were dropped: the log's output did not keep up", None,
                None))
        lines = []
        for record in batch:
            try:
                lines.append(self.format(record))
            except Exception:
                self.handleError(record)
        if not lines:
            return
        try:
            self.stream.write("\n".join(lines) + "\n")
            self.stream.flush()
        except Exception:
            self.handleError(batch[-1])

    def close(self) -> None:
        self._closed = True
        self._urgent.set()
        self._wake.set()
        self.flush()
        super().close()

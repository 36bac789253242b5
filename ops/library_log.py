"""Where a checkpoint library's leftover tracebacks go: after a failed read, Orbax's background
tasks fail on by the hundred ("Event loop is closed", "Task exception was never retrieved");
`LibraryLog` sends what reaches Python's last-resort printers to `run.dir/library.log` instead
of the console, from the first failed read to the end of the run (trainer/checkpoint.py). On a
bucket run.dir it also takes the errors Orbax's background threads log (absl) when the object
store stops answering: the run tells the outage once, in StoreDown's line (ops.faults)."""

from __future__ import annotations

import gc
import logging
import os
import sys
import tempfile
import threading
import time
import traceback
from types import TracebackType
from typing import Any, TextIO

import jax

import storage

LIBRARY_LOG = "library.log"
ABSL = "absl"  # the logger Orbax's background threads report a failed save on


def library_log_path(run_dir: str) -> str:
    """run.dir/library.log (library.pN.log for process N > 0: each process has its own leftovers).
    For a run.dir on an object store, the same name under this host's temporary directory
    (meshlm-library-logs/<scheme>/<bucket>/<prefix>/): the log is appended line by line, and an
    object store has no append."""
    index = jax.process_index()
    name = LIBRARY_LOG if index == 0 else f"library.p{index}.log"
    if storage.is_remote(run_dir):
        return os.path.join(tempfile.gettempdir(), "meshlm-library-logs", run_dir.replace("://", "/"), name)
    return os.path.join(run_dir, name)


class LibraryLog:
    """While started, the tracebacks that reach Python's last-resort printers (sys.excepthook,
    threading.excepthook for a library thread's unhandled error, sys.unraisablehook, the `asyncio`
    logger) are
    appended to a file instead of the console. The file is created at its first line."""

    def __init__(self, path: str):
        self.path = path
        self._file: TextIO | None = None
        self._saved: tuple[Any, Any, bool] | None = None
        self._handler = logging.StreamHandler(self)
        self._outages = _Outages(self._handler)

    def write(self, text: str) -> None:
        if self._file is None:
            os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)  # a remote run.dir's is on a local disk
            self._file = open(self.path, "a")
        self._file.write(text)
        self._file.flush()

    def flush(self) -> None:
        pass  # every write is flushed

    def note(self, header: str, error: BaseException) -> None:
        self.write(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} {header}\n" + "".join(traceback.format_exception(error)))

    def _excepthook(self, kind: type[BaseException], error: BaseException, tb: TracebackType | None) -> None:
        self.write("".join(traceback.format_exception(kind, error, tb)))

    def _thread_hook(self, args: Any) -> None:
        self.write(f"Exception in thread {getattr(args.thread, 'name', '?')}:\n"
                   + "".join(traceback.format_exception(args.exc_type, args.exc_value, args.exc_traceback)))

    def _unraisablehook(self, u: Any) -> None:
        where = f"Exception ignored in: {u.object!r}\n" if u.object is not None else ""
        self.write(where + "".join(traceback.format_exception(u.exc_type, u.exc_value, u.exc_traceback)))

    @property
    def outage(self) -> BaseException | None:
        """The first error diverted by `divert_outages`: a save the store cut short (Orbax logs
        its background save's failure without raising it)."""
        return self._outages.seen

    def divert_outages(self, on: bool) -> None:
        """While on, an absl error record whose exception says the object store stopped answering
        (storage.unreachable) goes to this log, not the console, and is kept (`outage`)."""
        if on:
            logging.getLogger(ABSL).addFilter(self._outages)
        else:
            logging.getLogger(ABSL).removeFilter(self._outages)

    @property
    def started(self) -> bool:
        return self._saved is not None

    def start(self) -> None:
        if self.started:
            return
        asyncio_log = logging.getLogger("asyncio")
        self._saved = (sys.excepthook, sys.unraisablehook, threading.excepthook, asyncio_log.propagate)
        sys.excepthook, sys.unraisablehook, threading.excepthook = self._excepthook, self._unraisablehook, self._thread_hook
        asyncio_log.addHandler(self._handler)
        asyncio_log.propagate = False

    def stop(self, collect: bool = True) -> None:
        """Collects what the failed reads left behind (their coroutines report when collected;
        `collect=False` where none failed: a full collection walks every object JAX holds, which
        is slow in a long-lived process), then gives the console its printers back."""
        if not self.started:
            return
        if collect:
            gc.collect()
        asyncio_log = logging.getLogger("asyncio")
        sys.excepthook, sys.unraisablehook, threading.excepthook, asyncio_log.propagate = self._saved
        asyncio_log.removeHandler(self._handler)
        self._saved = None
        if self._file is not None:
            self._file.close()
            self._file = None


class _Outages(logging.Filter):
    """Passes every record but the ones caused by an unreachable object store, which it hands to
    `handler` (the library log's) instead."""

    def __init__(self, handler: logging.Handler) -> None:
        super().__init__()
        self.handler = handler
        self.seen: BaseException | None = None

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if error is None or storage.unreachable(error) is None:
            return True
        self.seen = self.seen or error
        self.handler.handle(record)
        return False

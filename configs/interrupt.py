"""Ctrl-C and SIGTERM outside the training loop: one line and the signal's exit status.

Inside the loop `ops.faults.StopSignal` owns both signals (the loop stops at the next step with a
checkpoint). Everywhere else (imports, start-up, the first compile, a restore, plan.py's compiles,
an export, corpus preparation) the handler `guarded` installs ends the command at once, even while
the main thread is inside XLA (a compile of minutes): the interpreter's C-level handler writes the
signal to a wake-up pipe, and a thread waiting on it leaves. It runs
the cleanups registered with `on_interrupt` (run.dir's lock is released), prints one line saying
what was kept, and leaves with 128 + the signal's number (130 for SIGINT, 143 for SIGTERM) through
`os._exit`. It raises nothing: an exception raised inside a C extension's initialization (JAX's,
while it imports) or inside XLA's compiler left the process to abort or crash in its teardown
(status 134 or 139). Every file the commands write is written aside and renamed whole (Orbax's
checkpoints, the corpus, the exports), so a command ended at any moment leaves nothing half-written
that a later command would read. Each entry point calls `handle_interrupts` before its own imports,
so a signal while they load (a tenth of a second for the config schema, seconds for JAX) gets the
line too.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from types import FrameType
from typing import Callable, Iterator

HANDLED = (signal.SIGINT, signal.SIGTERM)
_cleanups: list[Callable[[], None]] = []
_kept = ""  # what the command's one line says was kept
_installed = False
_leaving = threading.Lock()  # the wake-up thread and the main thread's handler: one of them leaves


def _leave(signum: int, frame: FrameType | None = None) -> None:
    if not _leaving.acquire(blocking=False):
        return
    for cleanup in reversed(_cleanups):
        try:
            cleanup()
        except Exception:  # noqa: BLE001 (leaving anyway: the next run judges a stale lock by its pid)
            pass
    sys.stdout.flush()
    sys.stderr.flush()
    # One write of the whole line: another thread (or the interpreter's own C-level output, such as
    # -X importtime's) writing to stderr meanwhile cannot land inside it.
    os.write(sys.stderr.fileno(), f"interrupted by {signal.Signals(signum).name}: {_kept}\n".encode())
    os._exit(128 + signum)


def handle_interrupts(kept: str) -> None:
    """From now on a signal ends the command with one line saying `kept` (a signal the parent had
    ignored stays ignored). Each entry point calls it before its imports, which take a while; a
    second call only changes what the line says."""
    global _kept, _installed
    _kept = kept
    if _installed:
        return
    _installed = True
    for signum in HANDLED:
        if signal.getsignal(signum) is not signal.SIG_IGN:
            signal.signal(signum, _leave)
    read, write = os.pipe()
    os.set_blocking(write, False)
    signal.set_wakeup_fd(write)  # ops.faults.StopSignal sets it aside while the loop owns the signals
    threading.Thread(target=_wait, args=(read,), name="interrupt", daemon=True).start()


def guarded(main: Callable[[], int], kept: str) -> int:
    """`main()`'s exit status, a signal from now on ending the command with one line saying `kept`."""
    handle_interrupts(kept)
    return main()


def _wait(read: int) -> None:
    """The wake-up pipe's reader: the first SIGINT or SIGTERM written there ends the command."""
    while True:
        for signum in os.read(read, 64):
            if signum in HANDLED:
                _leave(signum)


def at_leave(cleanup: Callable[[], None]) -> None:
    """Runs `cleanup` whenever a signal ends the command from now on (guarded's handler), for a
    resource the whole process holds."""
    _cleanups.insert(0, cleanup)  # the cleanups run newest first: this one after the blocks' own


@contextlib.contextmanager
def on_interrupt(cleanup: Callable[[], None]) -> Iterator[None]:
    """Runs `cleanup` if a signal ends the command inside the block (guarded's handler)."""
    _cleanups.append(cleanup)
    try:
        yield
    finally:
        _cleanups.remove(cleanup)

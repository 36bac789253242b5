"""gloo's `[Gloo] Rank N is connected to M peer ranks` lines kept off a multi-process run's stdout.

gloo (XLA:CPU's collectives between processes) prints one such line per device from C++
(`std::cout`) as it connects to its peers, from several threads at once, piece by piece into one
buffer (so a line may hold pieces of several messages, or their numbers alone), and has no setting
to stop it. So once a process joins a multi-process job, its stdout (file descriptor 1, which the
C++ code writes too) goes through a pipe to a thread that drops the lines made of those pieces and
numbers and writes everything else on, in order. A line saying a rank is NOT connected is kept. At
exit, or when a signal ends the command (configs.interrupt), what is in the pipe is written out
first.
"""

from __future__ import annotations

import atexit
import os
import re
import select
import sys
import threading
import time

from configs.interrupt import at_leave

# The connection line's fixed pieces. gloo's threads write each piece (and each number) into one
# shared buffer, so a line on the pipe may hold pieces of several messages, or only their numbers.
_PIECES = re.compile(rb"\[Gloo\] Rank | is connected to | peer ranks\. |Expected number of connected peer ranks is : ")
_NUMBERS = re.compile(rb"[\d\s\x00]*")
_AFTER_S = 1.0  # how long after a line of pieces a line of numbers alone (or empty) is taken for gloo's
_HOLD_S = 0.2  # how long a line's start waits for its end before it is judged (and written) alone
_started = False


class _Forward:
    """The thread that reads the pipe and writes what is kept to the real stdout."""

    def __init__(self, read: int, real: int):
        self.read, self.real, self.closing = read, real, threading.Event()
        self.thread = threading.Thread(target=self.run, name="gloo-lines", daemon=True)
        self.pieces_at = -_AFTER_S  # when a line of gloo's pieces was last dropped

    def gloo(self, line: bytes) -> bool:
        """Whether `line` is made of gloo's connection-line pieces and numbers alone (a line saying
        a rank is NOT connected is kept)."""
        marked = _PIECES.sub(b"\x00", line)
        if b"NOT connected" in line or not _NUMBERS.fullmatch(marked):
            return False
        if b"\x00" in marked:
            self.pieces_at = time.monotonic()
            return True
        return time.monotonic() - self.pieces_at < _AFTER_S  # numbers alone (or nothing), amid gloo's lines

    def keep(self, lines: bytes) -> bytes:
        return b"".join(line for line in lines.splitlines(keepends=True) if not self.gloo(line))

    def write(self, data: bytes) -> None:
        try:
            os.write(self.real, data)
        except OSError:  # the reader of our stdout has gone: keep draining, so writers never block
            pass

    def run(self) -> None:
        held, since = b"", 0.0  # a line's start, waiting for its end
        while True:
            # A timeout, not a blocking read: a held line's start is written alone after a while,
            # and after `stop` a process this one started may still hold the pipe open.
            ready, _, _ = select.select([self.read], [], [], 0.05)
            if not ready:
                if held and (self.closing.is_set() or time.monotonic() - since > _HOLD_S):
                    self.write(self.keep(held))
                    held = b""
                if self.closing.is_set():
                    break
                continue
            chunk = os.read(self.read, 1 << 16)
            if not chunk:
                break
            data = held + chunk
            cut = data.rfind(b"\n") + 1
            if data[cut:] and (cut or not held):  # a new line's start
                since = time.monotonic()
            held = data[cut:]
            self.write(self.keep(data[:cut]))
        self.write(self.keep(held))

    def stop(self) -> None:
        """fd 1 back to the real stdout, once what is in the pipe is written."""
        try:
            sys.stdout.flush()
        except (OSError, ValueError):
            pass
        os.dup2(self.real, 1)  # from now on writes go straight out; the pipe only drains
        self.closing.set()
        self.thread.join(timeout=2)


def drop_gloo_lines() -> None:
    """From now on this process's stdout passes without gloo's connection lines (once a process)."""
    global _started
    if _started:
        return
    _started = True
    sys.stdout.flush()
    try:
        real = os.dup(1)
    except OSError:  # no stdout at all: nothing to keep quiet
        return
    read, write = os.pipe()
    forward = _Forward(read, real)
    os.dup2(write, 1)
    os.close(write)
    forward.thread.start()
    atexit.register(forward.stop)
    at_leave(forward.stop)

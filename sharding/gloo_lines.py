"""gloo's `[Gloo] Rank N is connected to M peer ranks` lines kept off a multi-process run's stdout.

gloo (XLA:CPU's collectives between processes) prints one such line per device from C++
(`std::cout`) as it connects to its peers, from several threads at once (their text sometimes
interleaved), and has no setting to stop it. So once a process joins a multi-process job, its
stdout (file descriptor 1, which the C++ code writes too) goes through a pipe to a thread that drops
those lines and writes everything else on, in order. A line saying a rank is NOT connected is kept.
At exit, or when a signal ends the command (configs.interrupt), what is in the pipe is written
out first.
"""

from __future__ import annotations

import atexit
import os
import re
import select
import sys
import threading

from configs.interrupt import at_leave

# The connection line's pieces: interleaved, a line may hold any of them but not the whole.
_GLOO = re.compile(rb"\[Gloo\] Rank |is connected to \d+ peer ranks|Expected number of connected peer ranks is")
_started = False


def _keep(lines: bytes) -> bytes:
    """`lines` (whole lines, or the end of what came) without gloo's connection lines."""
    return b"".join(line for line in lines.splitlines(keepends=True)
                    if not _GLOO.search(line) or b"NOT connected" in line)


class _Forward:
    """The thread that reads the pipe and writes what is kept to the real stdout."""

    def __init__(self, read: int, real: int):
        self.read, self.real, self.closing = read, real, threading.Event()
        self.thread = threading.Thread(target=self.run, name="gloo-lines", daemon=True)

    def write(self, data: bytes) -> None:
        try:
            os.write(self.real, data)
        except OSError:  # the reader of our stdout has gone: keep draining, so writers never block
            pass

    def run(self) -> None:
        held = b""  # the start of a line in gloo's words: written (or dropped) once it is whole
        while True:
            # A timeout, not a blocking read: after `stop` a process this one started may still
            # hold the pipe open, and what was written before `stop` must still come out.
            ready, _, _ = select.select([self.read], [], [], 0.05)
            if not ready:
                if self.closing.is_set():
                    break
                continue
            chunk = os.read(self.read, 1 << 16)
            if not chunk:
                break
            data = held + chunk
            cut = data.rfind(b"\n") + 1
            rest = data[cut:]  # a line's start: written now (the rest of it follows), unless it may be gloo's
            held = rest if _GLOO.search(rest) or b"[Gloo]" in rest else b""
            self.write(_keep(data[:cut]) + (b"" if held else rest))
        self.write(_keep(held))

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
    read, write = os.pipe()
    forward = _Forward(read, os.dup(1))
    os.dup2(write, 1)
    os.close(write)
    forward.thread.start()
    atexit.register(forward.stop)
    at_leave(forward.stop)

"""What a waiting plan says on stderr while it compiles (stdout is the plan): each compile as
the compiling process starts it, the seconds a long one has run, and the progress of a long
loop of layouts.
"""

from __future__ import annotations

import subprocess
import sys
import time

# A compile for a large mesh can take minutes: the waiting parent says it is still at work this often.
HEARTBEAT_S = 15.0


def wait_with_progress(child: subprocess.Popen, progress: str, every: float = HEARTBEAT_S) -> int:
    """Waits for the compiling child; its exit status. On stderr (stdout is the plan): each
    compile as the child starts it (it writes what it compiles to `progress`) and, while one runs,
    the elapsed time every `every` seconds."""
    label, started = "starting the compiling process", time.monotonic()
    beat = started
    while True:
        try:
            return child.wait(timeout=min(1.0, every))
        except subprocess.TimeoutExpired:
            pass
        now, current = time.monotonic(), _read_progress(progress)
        if current and current != label:
            label, started, beat = current, now, now
            print(label, file=sys.stderr, flush=True)
        elif now - beat >= every:
            beat = now
            print(f"{label} ... {now - started:.0f} s", file=sys.stderr, flush=True)


class Heartbeat:
    """`what (i of n) ... 16 s` on stderr every HEARTBEAT_S seconds of a long loop of `total`
    items (a search's hundreds of layouts), and nothing for a loop that ends sooner: a bad input
    stays one line. `tick()` once per item, before it."""

    def __init__(self, what: str, total: int, every: float = HEARTBEAT_S):
        self.what, self.total, self.every, self.done = what, total, every, 0
        self.start = self.beat = time.monotonic()

    def tick(self) -> None:
        now = time.monotonic()
        if now - self.beat >= self.every:
            self.beat = now
            print(f"{self.what} ({self.done} of {self.total}) ... {now - self.start:.0f} s", file=sys.stderr,
                  flush=True)
        self.done += 1


def _read_progress(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except FileNotFoundError:
        return ""

"""Which process makes the others wait: each process's own time per step, and the slow one named.

In a synchronous step every process finishes together: a slow process makes all the others wait
in the step's collectives, so their step times are alike. What differs is each process's *own*
time per step, the part of its loop not spent waiting for the device or the peers (reading data,
host code, a busy or throttled host). `StepClock` measures it in the loop; the watchdog
(ops.faults) publishes the last `straggler.steps` of it with its heartbeat and reads every
peer's; process 0 names a process whose own time exceeded `straggler.factor` times the median
of the other processes' in each of those steps (and by more than a tenth of the step, below which it is noise),
once, with its host.

`MESHLM_DEBUG_STEP_SLEEP_S` (an environment variable, so that one process of a job can be given
it while all share one config) makes this process sleep that long before each step: a straggler
to try the detection on.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from collections import deque
from typing import Iterator

SLOW_ENV = "MESHLM_DEBUG_STEP_SLEEP_S"
NOISE_FRACTION = 0.1  # an excess below this fraction of the step is not named


def injected_sleep() -> float:
    """Seconds this process sleeps before each step (MESHLM_DEBUG_STEP_SLEEP_S; 0 when unset)."""
    return float(os.environ.get(SLOW_ENV, "") or 0.0)


class StepClock:
    """Per step: (step, own seconds, wall seconds) of this process, the last `keep` steps."""

    def __init__(self, keep: int):
        self.samples: deque[tuple[int, float, float]] = deque(maxlen=keep)
        self._t0 = time.perf_counter()
        self._waited = 0.0

    def restart(self) -> None:
        """The next step starts now (after work that is no step: a save, an eval)."""
        self._t0, self._waited = time.perf_counter(), 0.0

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        """Time inside is waiting for the device or the peers, not this process's own."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._waited += time.perf_counter() - t0

    def lap(self, step: int) -> None:
        now = time.perf_counter()
        wall = now - self._t0
        self.samples.append((step, max(wall - self._waited, 0.0), wall))
        self._t0, self._waited = now, 0.0


def find_stragglers(samples: dict[int, list[tuple[int, float, float]]], factor: float,
                    steps: int) -> list[tuple[int, float, float]]:
    """(process, its mean own seconds, the other processes' median) for each process slower than
    that median in every one of the last `steps` steps every process has reported; [] while fewer
    are reported."""
    if len(samples) < 2 or factor <= 0:
        return []
    by_process = {p: {s: (own, wall) for s, own, wall in rows} for p, rows in samples.items()}
    common = sorted(set.intersection(*(set(rows) for rows in by_process.values())))[-steps:]
    if len(common) < steps:
        return []
    slow = []
    for p, rows in by_process.items():
        others = [other for q, other in by_process.items() if q != p]  # with two processes, the other one
        medians = [statistics.median(other[s][0] for other in others) for s in common]
        if all(rows[s][0] > factor * m and rows[s][0] - m > NOISE_FRACTION * rows[s][1] for s, m in zip(common, medians)):
            slow.append((p, statistics.mean(rows[s][0] for s in common), statistics.mean(medians)))
    return slow


def own_means(samples: dict[int, list[tuple[int, float, float]]]) -> dict[str, float]:
    """`own_s/p<i>`: each process's mean own seconds per step over what it last reported."""
    return {f"own_s/p{p}": statistics.mean(own for _, own, _ in rows) for p, rows in sorted(samples.items()) if rows}

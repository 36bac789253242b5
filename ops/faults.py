"""Failing loudly instead of hanging: preemption signals, a step watchdog, peer liveness.

- `StopSignal`: SIGTERM/SIGINT ask the loop to stop after the current step. With several
  processes the step to stop at is agreed through the coordination service (JAX's preemption
  sync point), so every process saves the same checkpoint.
- `Watchdog`: a daemon thread. If no step finishes within `train.step_timeout_s` it dumps every
  thread's stack and exits 4; if a peer process stops sending heartbeats it says which and
  exits 5, so no process waits forever in a collective.
- `poisoned`: fault injection (`debug.nan_steps`), batches that make given steps non-finite.
- `stops_on_outage`: a bucket run.dir's object store that stopped answering past its clients'
  retries becomes one line and exit 7 (StoreDown), whichever read or write met it first.
- `exit_at_once`: a stop whose process must not join its threads (a save the outage cut short):
  the line, told to every process of the job, each exiting with it, process 0 last.
"""

from __future__ import annotations

import contextlib
import dataclasses
import faulthandler
import hashlib
import itertools
import json
import os
import signal
import socket
import sys
import threading
import time
from types import FrameType
from typing import Callable, Iterator

import jax
import numpy as np

import storage
from configs import Config, ConfigError
from configs.schema import nan_steps
from sharding.distributed import FINISHED, ack_stop, peer_beats, publish_beat, stop_acks, tell_stop, told_stop
from ops.metrics import log
from ops.stragglers import StepClock, find_stragglers, own_means

EXIT_BAD_STEPS = 3
EXIT_HUNG = 4
EXIT_PEER_LOST = 5
EXIT_STORE_DOWN = 7  # 6 is ops.lease's EXIT_LOCK_LOST
# How long process 0 waits for the others to acknowledge a stop it told (exit_at_once): a few of
# their watchdogs' polls.
STOP_WAIT_S = 10.0
_EXITING = threading.Lock()

PROJECT_DIRS = ("configs", "model", "sharding", "data", "trainer")


class RunStopped(Exception):
    """The run stopped before train.steps; `exit_code` is what the process should return;
    `exit_at_once`: the process exits without joining the libraries' threads (train.py)."""

    exit_code = 1
    exit_at_once = False


class Preempted(RunStopped):
    def __init__(self, exit_code: int):
        super().__init__(f"preempted (exit {exit_code})")
        self.exit_code = exit_code


class TooManyBadSteps(RunStopped):
    exit_code = EXIT_BAD_STEPS


def store_down(error: BaseException | None, run_dir: str) -> BaseException | None:
    """The error in `error`'s chain saying that the object store of a bucket `run_dir` stopped
    answering (storage.unreachable), or None: also for a local run.dir."""
    return storage.unreachable(error) if storage.is_remote(run_dir) else None


@contextlib.contextmanager
def stops_on_outage(run_dir: str, committed: Callable[[], str]) -> Iterator[None]:
    """Turns any error of the block whose chain says the store of a bucket run.dir stopped
    answering (re-reading run.dir or restoring at start-up, an asynchronous save, a metrics
    rewrite, summary.json) into StoreDown: one line, its own exit status, and `committed()`, what
    is known committed (e.g. "step 4"). A chain holding storage.LeftRunning (a save or restore the
    outage cut short) makes it exit at once."""
    try:
        yield
    except ConfigError:
        raise  # bad input, e.g. a bucket the checks found unreachable (exit 2), whatever its chain holds
    except Exception as e:
        down = store_down(e, run_dir)
        if down is None:
            raise
        raise StoreDown(run_dir, committed(), down, exit_at_once=storage.left_running(e)) from e


class StoreDown(RunStopped):
    """The object store holding run.dir stopped answering past its clients' retries. The run.dir
    lock is left as it is (the store cannot take its release); the next run on this host takes
    it over, and resumes from `committed`, the last checkpoint known committed."""

    exit_code = EXIT_STORE_DOWN

    def __init__(self, run_dir: str, committed: str, error: BaseException, exit_at_once: bool = False):
        # A save the outage cut short leaves Orbax's threads waiting on signals that never come,
        # which the interpreter would join at exit. Otherwise the exit is the usual one (with
        # several processes, process 0's coordination service outlives the others' exits).
        self.exit_at_once = exit_at_once
        why = (str(error).splitlines() or [type(error).__name__])[0]
        super().__init__(f"run.dir={run_dir}: the object store stopped answering after its clients' retries ({why}); "
                         f"the last committed checkpoint: {committed} (nothing later is restored); run the same "
                         "command once the store answers")


def code_version() -> str:
    """A hash of the project's Python sources: processes running different code disagree on it."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    digest = hashlib.sha256()
    for folder in PROJECT_DIRS:
        for dirpath, dirnames, files in sorted(os.walk(os.path.join(root, folder))):
            dirnames.sort()
            for name in sorted(f for f in files if f.endswith(".py")):
                with open(os.path.join(dirpath, name), "rb") as f:
                    digest.update(name.encode() + f.read())
    return digest.hexdigest()[:16]


def fingerprint(cfg: Config) -> dict[str, object]:
    """What every process must share: the resolved config (less its own process id) and the code."""
    flat = {}
    for section, values in dataclasses.asdict(cfg).items():
        for key, value in values.items():
            flat[f"{section}.{key}"] = value
    flat.pop("dist.process_id")
    flat["code version"] = code_version()
    return flat


def poisoned(batches: Iterator[dict[str, np.ndarray]], cfg: Config, start: int) -> Iterator[dict[str, np.ndarray]]:
    """Fault injection (`debug.nan_steps`): token ids past the vocabulary at the given steps make
    the embedding lookup return NaN, as a corrupt data file would. `start`: the step before the
    first batch's."""
    steps, vocab = nan_steps(cfg), cfg.model.vocab_size  # read once, before the first batch is asked for

    def batches_of_steps() -> Iterator[dict[str, np.ndarray]]:
        for step, batch in enumerate(batches, start=start + 1):
            if step in steps:
                batch = {**batch, "tokens": np.full_like(batch["tokens"], vocab)}
            yield batch

    return batches_of_steps()


class StopSignal:
    """Set by SIGTERM or SIGINT; read by the loop at step boundaries."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, object] = {}
        self._multi = jax.process_count() > 1
        # With several processes JAX's own notifier owns SIGTERM (it agrees on a sync step); a
        # SIGINT is turned into a SIGTERM so that Ctrl-C takes the same path.
        signals = [signal.SIGINT] if self._multi else [signal.SIGTERM, signal.SIGINT]
        for signum in signals:
            self._previous[signum] = signal.signal(signum, self._handle)
        # The loop stops at a step boundary: a command's wake-up pipe (configs.interrupt), which
        # would end it at once, is set aside until `restore`.
        self._wakeup = signal.set_wakeup_fd(-1)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self._multi:
            os.kill(os.getpid(), signal.SIGTERM)
            return
        self.signum = signum

    def requested(self, step: int) -> bool:
        """True at the step where every process stops (call once per step, on every process)."""
        if self._multi:
            from jax.experimental import multihost_utils

            return multihost_utils.reached_preemption_sync_point(step)
        return self.signum is not None

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        signal.set_wakeup_fd(self._wakeup)


def _fatal(message: str, code: int, dump_stacks: bool) -> None:
    print(f"error: {message}", file=sys.stderr, flush=True)
    if dump_stacks:
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    sys.stderr.flush()
    os._exit(code)  # the main thread may be blocked inside XLA: no clean unwinding is possible


def exit_at_once(line: str, code: int, told: bool = False) -> None:
    """Prints `line` and exits with `code` without joining any thread. With several processes
    every one is told the line (the others' watchdogs print it and exit alike), and process 0,
    which holds the coordination service, exits last: once each has acknowledged it, or after
    STOP_WAIT_S. `told`: this process learnt it from another (tell nothing back)."""
    if not _EXITING.acquire(blocking=False):  # another thread of this process is on its way out
        threading.Event().wait()
    print(f"error: {line}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    if jax.process_count() > 1:
        try:
            if told:
                ack_stop()
            else:
                tell_stop(line)
            deadline = time.monotonic() + STOP_WAIT_S
            while jax.process_index() == 0 and stop_acks() < jax.process_count() and time.monotonic() < deadline:
                time.sleep(0.05)
        except Exception:  # the coordination service is gone: nobody is left to tell
            pass
    os._exit(code)


# Runs watched in this process so far: a job's processes run the same sequence of runs (a test may
# run several in one process), so the count names a run alike on every process.
_RUNS = itertools.count()


class Watchdog:
    """Call `beat(step)` when a step finishes; `pause()` around work that is not a step;
    `finished()` once the run has ended (its last save committed), before `close()`.

    With several processes its thread also publishes this process's heartbeat every `poll_s` and
    reads every peer's (sharding.distributed: one non-blocking call each). A peer whose heartbeat
    has stood still for `peer_timeout_s` without its run finished is dead. A peer counts only once
    it has beaten in this run: processes start their watchdogs after compiling, some later than
    others (one that dies before is the coordination service's to detect)."""

    def __init__(self, step_timeout_s: float, peer_timeout_s: float = 20.0, poll_s: float = 1.0,
                 clock: StepClock | None = None, straggler_factor: float = 0.0, straggler_steps: int = 5):
        self.timeout = step_timeout_s
        self.peer_timeout = peer_timeout_s
        self.poll = poll_s
        self.run = next(_RUNS)
        self.clock, self.factor, self.k = clock, straggler_factor, straggler_steps
        self.peers: dict[int, dict] = {}  # what each process published last: host, arrived step, own times
        self._named: set[int] = set()  # stragglers named and not yet caught up
        self._host = socket.gethostname()
        self._last = time.monotonic()
        self._step = 0
        self._arrived = 0  # the last step this process dispatched
        self._armed = False
        self._beats = 0
        self._seen: dict[int, tuple[str, float]] = {}  # peer -> (its last heartbeat, when it changed here)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="watchdog", daemon=True)
        self._thread.start()

    def beat(self, step: int) -> None:
        self._step, self._last, self._armed = step, time.monotonic(), True

    def arrive(self, step: int) -> None:
        """This process dispatches `step`: a hung step names the processes that have not."""
        self._arrived = step

    def pause(self) -> None:
        self._armed = False

    def finished(self) -> None:
        """The run has ended here: peers that find this process gone from now on know it was not a
        crash. Only on a run's normal end (or an agreed preemption stop), not on an error."""
        self.close()  # first: no heartbeat of this thread's may overwrite FINISHED
        publish_beat(self.run, FINISHED)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def dead_peers(self) -> list[int]:
        """Publishes this process's heartbeat; returns the peers whose heartbeat stood still too long."""
        self._beats += 1
        samples = list(self.clock.samples) if self.clock is not None else []
        publish_beat(self.run, json.dumps({"n": self._beats, "host": self._host, "arrived": self._arrived, "own": samples}))
        now, dead = time.monotonic(), []
        for peer, value in peer_beats(self.run).items():
            if value != FINISHED:
                self.peers[peer] = json.loads(value)
            last, since = self._seen.get(peer, ("", now))
            if value != last:
                self._seen[peer] = (value, now)
            elif value != FINISHED and now - since > self.peer_timeout:
                dead.append(peer)
        return dead

    def _run(self) -> None:
        while not self._stop.wait(self.poll):
            try:
                dead, lost = self.dead_peers(), None
            except Exception as e:  # the coordinator itself is gone
                dead, lost = [], e
            # The run ended while this thread was in the coordination service (close() waits 5 s at
            # most): what it found, a lost coordinator or a peer gone quiet, is no longer its to act on.
            if self._stop.is_set():
                return
            told = told_stop()  # a stop another process told: a save the object store cut short
            if told is not None:
                exit_at_once(told, EXIT_STORE_DOWN, told=True)
            if lost is not None:
                _fatal(f"lost the coordination service ({type(lost).__name__}: {lost}); stopping", EXIT_PEER_LOST,
                       False)
            if dead:
                _fatal(
                    f"process(es) {dead} of {jax.process_count()} stopped sending heartbeats (crashed or "
                    "preempted); stopping instead of waiting in a collective. Resume with the same command.",
                    EXIT_PEER_LOST,
                    False,
                )
            self._name_stragglers()
            waited = time.monotonic() - self._last
            if self._armed and self.timeout and waited > self.timeout:
                _fatal(
                    f"step {self._step + 1} has run {waited:.0f} s, more than train.step_timeout_s={self.timeout:g}"
                    f"{self._not_arrived()}; stacks of every thread follow",
                    EXIT_HUNG,
                    True,
                )

    def own_times(self) -> dict[str, float]:
        """Each process's mean own seconds per step, as last published (metrics: `own_s/p<i>`)."""
        return own_means({p: [tuple(r) for r in v.get("own", [])][-self.k:] for p, v in self.peers.items()})

    def _name_stragglers(self) -> None:
        """Process 0 names each process slow for the last `straggler.steps` steps, once until it
        catches up."""
        if jax.process_index() != 0 or self.clock is None or len(self.peers) < 2:
            return
        samples = {p: [tuple(r) for r in v.get("own", [])] for p, v in self.peers.items()}
        slow = find_stragglers(samples, self.factor, self.k)
        for p, own, median in slow:
            if p not in self._named:
                log(f"straggler: process {p} (host {self.peers[p].get('host', '?')}) spent {own:.3f} s per step on its "
                    f"own over the last {self.k} steps, {own / max(median, 1e-9):.1f}x the others' "
                    f"median {median:.3f} s; every process waits for it (straggler.factor={self.factor:g})")
        self._named = {p for p, _, _ in slow}

    def _not_arrived(self) -> str:
        """', process(es) [1] (host h) had not dispatched it' from the coordination service's view,
        or '' when every process has (or there is one)."""
        late = [p for p, v in sorted(self.peers.items()) if v.get("arrived", self._arrived) < self._arrived]
        if not late:
            return ""
        hosts = ", ".join(sorted({str(self.peers[p].get("host", "?")) for p in late}))
        return f"; process(es) {late} (host {hosts}) had not dispatched it (the coordination service's view)"

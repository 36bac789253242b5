"""One writer per run directory: a lease file, `run.dir/lock.json`, that process 0 of a run
creates before anything else is written there and refreshes from a background thread.

A second run started on the same `run.dir` while the holder lives is refused (ConfigError:
exit 2, one line naming the holder's host, pid and start time, nothing written). A holder that
is gone (killed, its node lost) is taken over:
- on this host (same hostname, boot and pid namespace) at once, when its pid is dead or now
  belongs to another process (the pid's start time differs);
- on another host after watching its heartbeat counter for `run.lock_timeout_s` seconds of
  this host's monotonic clock without seeing it move. No clocks are compared across hosts.

What it relies on, from a filesystem every host mounts (local disks, NFSv3 and later, Lustre):
an exclusive create (`O_CREAT | O_EXCL`) and a rename that are atomic, and a write followed by
fsync that the next open on another host reads (NFS close-to-open consistency). A mount that
lacks them (some object-store FUSE mounts) is not protected.

The holder's thread rereads the lease after every heartbeat; if another run has taken it over
(the holder was frozen or cut off longer than the timeout), the holder stops at once with exit
status 6 rather than write beside the new owner.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
import uuid
from typing import Callable, Iterator

import jax

import storage
from configs import ConfigError
from configs.interrupt import on_interrupt
from ops import object_lock
from ops.faults import store_down
from ops.lease import (BEATS_PER_TIMEOUT, EXIT_LOCK_LOST, LOCK_FILE, _describe, _host_key, _parse, _pid_alive,
                       new_record)
from sharding import distributed

_SHARE_KEY = "meshlm/run_dir_lock"


def _read_text(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except FileNotFoundError:
        return None


class Lease:
    """The held lock: its file descriptor (heartbeats go to this inode, so a holder whose lease
    was moved aside writes nowhere that matters) and the thread that refreshes it."""

    def __init__(self, path: str, fd: int, timeout_s: float):
        self.path, self.fd = path, fd
        self.record = new_record(timeout_s)
        self._write()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, args=(timeout_s / BEATS_PER_TIMEOUT,), daemon=True,
                                        name="run-dir-lock")
        self._thread.start()

    def _write(self) -> None:
        # The record only grows (the counter gains digits), so writing over it from offset 0 leaves no tail.
        os.pwrite(self.fd, json.dumps(self.record).encode(), 0)
        os.fsync(self.fd)

    def _beat(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            self.record["beat"] += 1
            try:
                self._write()
                text = _read_text(self.path)
            except OSError as e:  # a storage hiccup: the next beat tries again
                print(f"warning: could not refresh the run.dir lock {self.path}: {e}", file=sys.stderr, flush=True)
                continue
            now = _parse(text)
            if text is None or (now is not None and now.get("token") != self.record["token"]):
                taker = _describe(now) if text is not None else "nobody (it was deleted)"
                print(f"error: lost the run.dir lock {self.path} to {taker}; stopping so that only one run writes "
                      "there", file=sys.stderr, flush=True)
                os._exit(EXIT_LOCK_LOST)  # the main thread may be inside XLA: no clean unwinding

    def release(self) -> None:
        self._stop.set()
        self._thread.join()
        if (_parse(_read_text(self.path)) or {}).get("token") == self.record["token"]:
            os.unlink(self.path)
        os.close(self.fd)


def _judge(path: str, timeout_s: float, log: Callable[[str], None]) -> tuple[str, str] | None:
    """The text of a lease whose holder is gone (to break) and why it is taken to be gone, or
    None if the lease vanished meanwhile. Raises ConfigError naming a live holder."""
    text = _read_text(path)
    if text is None:
        return None
    record = _parse(text)
    run_dir = os.path.dirname(path)
    held = f"run.dir={run_dir} is in use by a live run: {{}} (its lock: {path}); stop it or use another run.dir"
    if record is not None and record.get("host_key") == _host_key():
        if _pid_alive(int(record["pid"]), record.get("pid_start")):
            raise ConfigError(held.format(_describe(record)))
        return text, f"pid {record['pid']} is gone from this host"
    # A holder on another host: alive iff its heartbeat moves within its timeout (or ours, if longer).
    wait_s = max(timeout_s, float((record or {}).get("timeout_s", 0)))
    log(f"run.dir lock held by {_describe(record)}; watching its heartbeat for up to {wait_s:g} s")
    t0 = time.monotonic()
    while time.monotonic() < t0 + wait_s:
        time.sleep(min(0.5, wait_s / 20))
        now = _read_text(path)
        if now is None:
            return None
        if now != text:
            raise ConfigError(held.format(_describe(_parse(now) or record)))
    return text, f"its heartbeat did not move in {time.monotonic() - t0:.1f} s"


def _break(path: str, seen: str) -> None:
    """Moves the dead lease `seen` out of the way. If another starter replaced it first, the
    lease moved is theirs: it goes back (unless a third one is there by then)."""
    aside = f"{path}.{uuid.uuid4().hex}.stale"
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return
    if _read_text(aside) != seen:
        with contextlib.suppress(FileExistsError):
            os.link(aside, path)
    os.unlink(aside)


def acquire(run_dir: str, timeout_s: float, log: Callable[[str], None]) -> Lease:
    """Takes the lock of `run_dir` (creating the directory), or raises ConfigError naming the
    live holder."""
    path = os.path.join(run_dir, LOCK_FILE)
    try:
        os.makedirs(run_dir, exist_ok=True)
        for _ in range(3):  # each pass takes the lease, refuses, or breaks a dead one and tries again
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                judged = _judge(path, timeout_s, log)
                if judged is not None:
                    seen, why = judged
                    _break(path, seen)
                    log(f"took over the run.dir lock from {_describe(_parse(seen))}: {why}")
                continue
            return Lease(path, fd, timeout_s)
    except OSError as e:
        raise ConfigError(f"run.dir={run_dir}: cannot take its lock {path}: {e}") from e
    raise ConfigError(f"run.dir={run_dir}: other runs keep taking its lock {path}; try again")


@contextlib.contextmanager
def hold(run_dir: str, timeout_s: float, wait_s: float, log: Callable[[str], None]) -> Iterator[None]:
    """Holds run.dir's lock for the block, released however it ends. Process 0 takes it once
    for the whole job; every process raises the same ConfigError if it refused, before any of
    them writes. `wait_s`: how long the others wait for process 0's answer. On an object store
    the lease is an object (ops.object_lock), with the same record and semantics; a run stopped by
    its object store (an error whose chain says so, ops.faults.store_down) leaves it where it is."""
    lease, refusal = None, ""
    take = object_lock.acquire if storage.is_remote(run_dir) else acquire
    if jax.process_index() == 0:
        try:
            lease = take(run_dir, timeout_s, log)
        except ConfigError as e:
            refusal = str(e)
    try:
        refusal = distributed.share_from_process_0(_SHARE_KEY, refusal, wait_s + timeout_s)
        if refusal:
            raise ConfigError(refusal)
        # A signal outside the loop ends the command at once (configs.interrupt): it frees the lock first.
        with on_interrupt(lease.release if lease is not None else lambda: None):
            yield
    except Exception as e:
        # The store stopped answering (StoreDown, or the error it will become): the release would
        # wait out the store's retries and fail; the next run takes the lease over.
        if lease is not None and store_down(e, run_dir) is not None:
            lease.abandon()
            lease = None
        raise
    finally:
        if lease is not None:
            lease.release()

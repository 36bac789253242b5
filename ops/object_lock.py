"""One writer per run directory on an object store: the lease `run.dir/lock.json` is an object
created and refreshed with generation preconditions, through TensorStore's kvstore (the client
Orbax's checkpoints use, with the same endpoint: storage.kvstore_spec).

The same record and semantics as the file lock (ops.rundir_lock): a second run is refused while
the holder lives (one ConfigError line naming host, pid and start time: exit 2); a holder gone
from this host (dead pid) is taken over at once, one on another host once its heartbeat counter
has not moved for `run.lock_timeout_s`; a holder that finds its lease taken over exits 6.

What a file lock gets from O_EXCL and rename, the object lock gets from preconditions: the lease
is created only if no object exists (S3 `If-None-Match: *`, GCS `ifGenerationMatch=0`), every
heartbeat and the release apply only to the generation the holder wrote last, and a takeover
replaces only the generation it judged dead. Two starters racing for it: one write wins, the
other sees its condition fail and judges again.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import Any, Callable

import storage
from configs import ConfigError
from ops.lease import (BEATS_PER_TIMEOUT, EXIT_LOCK_LOST, LOCK_FILE, _describe, _host_key, _parse, _pid_alive,
                       new_record)


def _open(run_dir: str) -> Any:
    import tensorstore as ts  # with Orbax already; imported here so a local run's import stays light

    spec = storage.kvstore_spec(run_dir)
    spec["path"] = spec["path"] + "/" if spec["path"] else ""  # keys are appended without a separator
    return ts.KvStore.open(spec).result()


def _won(stamp: Any) -> bool:
    """Whether a conditional write happened: TensorStore returns an empty generation when the
    object's generation no longer matched the condition."""
    return bool(stamp.generation)


class ObjectLease:
    """The held lease object, its last generation, and the thread that refreshes it."""

    def __init__(self, kv: Any, path: str, record: dict[str, Any], generation: bytes, timeout_s: float) -> None:
        self.kv, self.path, self.record, self.generation = kv, path, record, generation
        self.timeout_s, self.refreshed = timeout_s, time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, args=(timeout_s / BEATS_PER_TIMEOUT,), daemon=True,
                                        name="run-dir-lock")
        self._thread.start()

    def _beat(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            self.record["beat"] += 1
            try:
                stamp = self.kv.write(LOCK_FILE, json.dumps(self.record), if_equal=self.generation).result()
                if _won(stamp):
                    self.generation, self.refreshed = stamp.generation, time.monotonic()
                    continue
                now = self.kv.read(LOCK_FILE).result()
            except Exception as e:  # a storage hiccup: the next beat tries again
                # A store that does not answer stops the run where its own reads and writes meet
                # it (one line, ops.faults.StoreDown); the lease is worth a warning only once
                # half its timeout went unrefreshed, when another host could soon take it over.
                if storage.unreachable(e) is None or time.monotonic() - self.refreshed > self.timeout_s / 2:
                    print(f"warning: could not refresh the run.dir lock {self.path}: {e}", file=sys.stderr, flush=True)
                continue
            taker = _describe(_parse(now.value.decode())) if now.state == "value" else "nobody (it was deleted)"
            print(f"error: lost the run.dir lock {self.path} to {taker}; stopping so that only one run writes there",
                  file=sys.stderr, flush=True)
            os._exit(EXIT_LOCK_LOST)  # the main thread may be inside XLA: no clean unwinding

    def abandon(self) -> None:
        """Stops the heartbeat without waiting for a write in flight, and leaves the lease object
        as it is: the store no longer answers. The next run on this host finds its pid gone."""
        self._stop.set()

    def release(self) -> None:
        self._stop.set()
        self._thread.join()
        self.kv.write(LOCK_FILE, None, if_equal=self.generation).result()  # only if still ours


def _judge(kv: Any, path: str, timeout_s: float, log: Callable[[str], None]) -> tuple[bytes, str] | None:
    """The generation of a lease whose holder is gone (to replace) and why it is taken to be gone;
    None if the lease vanished meanwhile. Raises ConfigError naming a live holder."""
    found = kv.read(LOCK_FILE).result()
    if found.state != "value":
        return None
    record = _parse(found.value.decode())
    held = (f"run.dir={storage.parent(path)} is in use by a live run: {{}} (its lock: {path}); "
            "stop it or use another run.dir")
    if record is not None and record.get("host_key") == _host_key():
        if _pid_alive(int(record["pid"]), record.get("pid_start")):
            raise ConfigError(held.format(_describe(record)))
        return found.stamp.generation, f"pid {record['pid']} is gone from this host"
    wait_s = max(timeout_s, float((record or {}).get("timeout_s", 0)))
    log(f"run.dir lock held by {_describe(record)}; watching its heartbeat for up to {wait_s:g} s")
    t0 = time.monotonic()
    while time.monotonic() < t0 + wait_s:
        time.sleep(min(0.5, wait_s / 20))
        now = kv.read(LOCK_FILE).result()
        if now.state != "value":
            return None
        if now.stamp.generation != found.stamp.generation:
            raise ConfigError(held.format(_describe(_parse(now.value.decode()) or record)))
    return found.stamp.generation, f"its heartbeat did not move in {time.monotonic() - t0:.1f} s"


def acquire(run_dir: str, timeout_s: float, log: Callable[[str], None]) -> ObjectLease:
    """Takes the lease of `run_dir` on its object store, or raises ConfigError naming the live
    holder (or the storage error, one line)."""
    path = storage.join(run_dir, LOCK_FILE)
    try:
        kv = _open(run_dir)
        for _ in range(3):  # each pass creates the lease, refuses, or replaces a dead one
            missing = kv.read(LOCK_FILE).result()
            condition, why = missing.stamp.generation, ""
            if missing.state == "value":
                judged = _judge(kv, path, timeout_s, log)
                if judged is None:
                    continue
                condition, why = judged
            record = new_record(timeout_s)
            stamp = kv.write(LOCK_FILE, json.dumps(record), if_equal=condition).result()
            if _won(stamp):
                if why:
                    log(f"took over the run.dir lock {path}: {why}")
                return ObjectLease(kv, path, record, stamp.generation, timeout_s)
    except ConfigError:
        raise
    except Exception as e:  # TensorStore's errors: a missing bucket, a denied write, no endpoint
        raise ConfigError(f"run.dir={run_dir}: cannot take its lock {path}: {str(e).splitlines()[0]}") from e
    raise ConfigError(f"run.dir={run_dir}: other runs keep taking its lock {path}; try again")

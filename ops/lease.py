"""A run-dir lease's record and the judgements both kinds of lock make of it (ops.rundir_lock on
a filesystem, ops.object_lock on an object store): who holds it, and whether that holder is alive
on this host."""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import socket
import uuid
from typing import Any

LOCK_FILE = "lock.json"
EXIT_LOCK_LOST = 6
BEATS_PER_TIMEOUT = 4  # heartbeats per lock_timeout_s: a holder must miss several to lose the lease


def _parse(text: str | None) -> dict[str, Any] | None:
    """The lease's record; None for a missing, empty or half-written file."""
    try:
        record = json.loads(text) if text else None
    except json.JSONDecodeError:
        return None
    return record if isinstance(record, dict) else None


def _host_key() -> str:
    """Which pids this process can judge: the same hostname, kernel boot and pid namespace."""
    parts = [socket.gethostname()]
    with contextlib.suppress(OSError):
        with open("/proc/sys/kernel/random/boot_id") as f:
            parts.append(f.read().strip())
    with contextlib.suppress(OSError):
        parts.append(os.readlink("/proc/self/ns/pid"))
    return "/".join(parts)


def _pid_start(pid: int) -> str | None:
    """The pid's start time in clock ticks since boot (None where /proc cannot tell); 'Z' for
    a zombie, which is dead however long its parent takes to reap it."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return "Z" if fields[0] == "Z" else fields[19]


def _pid_alive(pid: int, start: str | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        pass
    now = _pid_start(pid)
    return now != "Z" and (start is None or now is None or now == start)


def _describe(record: dict[str, Any] | None) -> str:
    if record is None:
        return "an unreadable lock"
    return f"host {record.get('host')}, pid {record.get('pid')}, since {record.get('since')}"


def new_record(timeout_s: float) -> dict[str, Any]:
    """A new holder's lease record (this process; the object lock writes the same one)."""
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "since": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host_key": _host_key(),
        "pid_start": _pid_start(os.getpid()),
        "token": uuid.uuid4().hex,
        "timeout_s": timeout_s,
        "beat": 0,
    }

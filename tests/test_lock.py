"""One writer per run directory, the holders real `train.py` processes: a second run on the
run.dir of a live one exits 2 naming the holder and writes nothing; once the holder is killed
(this host) or its heartbeat stops (another host) the next run takes over; a holder whose lock
was taken over stops; of two runs breaking the same dead lock, the later keeps the newer lock."""

from __future__ import annotations

import datetime
import json
import os
import re
import signal
import socket
import threading
import time

import train
from conftest import stdlib_glob
from bench.procs import TINY, Train
from ops import rundir_lock

DATA = f"data.path={stdlib_glob('json')}"


def args(run_dir, *extra: str) -> list[str]:
    # The horizon of tests/test_faults.py's runs: the learning-rate schedule is a constant of the
    # compiled step, so runs of any length share that program (the shared compilation cache).
    return ["--config", TINY, f"run.dir={run_dir}", DATA, "train.log_every=1", "optim.decay_steps=12", *extra]


def main_here(capfd, *argv: str) -> tuple[int, str]:
    """`python train.py ARGV`'s exit status and output from its `main` in this process: the runs
    that meet a lock (refused, or taking it over) claim what they print, write and return, not
    anything of a process (one costs seconds of CPU time to start); a holder is a real process."""
    capfd.readouterr()
    code = train.main(list(argv))
    captured = capfd.readouterr()
    return code, captured.out + captured.err


def snapshot(run_dir) -> dict[str, tuple[int, int]]:
    """Every file under run_dir: (size, mtime in ns)."""
    out = {}
    for dirpath, _, files in os.walk(run_dir):
        for name in files:
            path = os.path.join(dirpath, name)
            st = os.stat(path)
            out[os.path.relpath(path, run_dir)] = (st.st_size, st.st_mtime_ns)
    return out


def held_line(run_dir, host: str, pid: int) -> str:
    return f"error: run.dir={run_dir} is in use by a live run: host {host}, pid {pid}, since "


def test_a_second_run_is_refused_while_the_first_lives_and_takes_over_after_kill_9(tmp_path, capfd):
    cmd = args(tmp_path, "train.steps=16", "checkpoint.every=2")
    first = Train(*cmd)
    first.wait_for(r"^step +3/16")
    deadline = time.monotonic() + 30
    while not (tmp_path / "checkpoints" / "2").exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    first.signal(signal.SIGSTOP)  # frozen alive: any change in run.dir now is the second run's doing
    before = snapshot(tmp_path)
    assert "lock.json" in before and "metrics.jsonl" in before
    code, out = main_here(capfd, *cmd)
    assert code == 2, out
    assert held_line(tmp_path, socket.gethostname(), first.proc.pid) in out, out
    assert "compiled" not in out and "resumed" not in out, out
    assert snapshot(tmp_path) == before, "the refused run wrote nothing"
    first.kill()  # kill -9, stopped or not
    code, out = main_here(capfd, *cmd)
    assert code == 0, out
    took = f"took over the run.dir lock from host {socket.gethostname()}, pid {first.proc.pid}, since "
    assert took in out and f"pid {first.proc.pid} is gone from this host" in out, out
    assert re.search(r"resumed from step \d+", out), out
    assert not (tmp_path / "lock.json").exists(), "released at the end"


def test_a_lock_of_another_host_is_refused_while_it_beats_and_taken_over_once_it_stops(tmp_path, capfd):
    """The test plays a holder on another host: it writes the lease and bumps its heartbeat."""
    lock = tmp_path / "lock.json"
    since = datetime.datetime(2026, 11, 1, tzinfo=datetime.timezone.utc).isoformat()  # "...T00:00:00+00:00"
    theirs = {"host": "node-b", "pid": 4242, "since": since, "host_key": "node-b/other-boot",
              "pid_start": "1", "token": "theirs", "timeout_s": 2, "beat": 0}
    lock.write_text(json.dumps(theirs))
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(0.3):
            theirs["beat"] += 1
            lock.write_text(json.dumps(theirs))

    beating = threading.Thread(target=beat, daemon=True)
    beating.start()
    cmd = args(tmp_path, "train.steps=2", "run.lock_timeout_s=2")
    try:
        code, out = main_here(capfd, *cmd)
    finally:
        stop.set()
        beating.join()
    assert code == 2, out
    assert held_line(tmp_path, "node-b", 4242) + since in out, out
    assert os.listdir(tmp_path) == ["lock.json"], "the refused run wrote nothing"
    code, out = main_here(capfd, *cmd)
    assert code == 0, out
    m = re.search(r"took over the run.dir lock from host node-b, pid 4242, .*: its heartbeat did not move in "
                  r"([\d.]+) s", out)
    assert m, out
    assert 2 <= float(m.group(1)) < 5, "waited for the timeout, not longer than it needed"
    assert not lock.exists(), "released at the end"


def test_a_holder_whose_lock_was_taken_over_stops(tmp_path):
    holder = Train(*args(tmp_path, "train.steps=100000", "checkpoint.every=100000", "run.lock_timeout_s=1"))
    holder.wait_for(r"^step +3/")
    lock = tmp_path / "lock.json"
    mine = json.loads(lock.read_text())
    assert mine["pid"] == holder.proc.pid
    # What a taker does: move the lease aside, create its own.
    os.rename(lock, tmp_path / "lock.json.aside")
    lock.write_text(json.dumps({**mine, "host": "node-b", "pid": 4242, "token": "theirs"}))
    taken = time.monotonic()
    assert holder.finish(30) == 6, holder.output
    print(f"the holder stopped {time.monotonic() - taken:.1f} s after losing its lock")
    assert "error: lost the run.dir lock" in holder.output and "host node-b, pid 4242" in holder.output


def test_breaking_a_dead_lock_never_removes_a_newer_one(tmp_path):
    """Two runs judge the same dead lock at once: the second to break it must not move aside
    the lock the first has created meanwhile."""
    path = tmp_path / "lock.json"
    path.write_text('{"token": "newer"}')
    rundir_lock._break(str(path), '{"token": "dead"}')
    assert os.listdir(tmp_path) == ["lock.json"] and path.read_text() == '{"token": "newer"}'
    rundir_lock._break(str(path), '{"token": "newer"}')
    assert os.listdir(tmp_path) == []

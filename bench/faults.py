"""Time to detect and to recover from each fault, injected for real into real `train.py` processes.

    python -m bench.faults [--out DIR]

Each row starts the tiny preset on 8 fake CPU devices (2 x 4 for the multi-process rows), injects
one fault and reads the times off the processes' output lines: how long from the fault to the
stack having acted on it (handled: exited with its checkpoint committed, warned, skipped), and how long the same command takes, started again, to train its
first new step (recovered; process start, restore and compile included), and how many steps of
work were lost. tests/test_faults.py and tests/test_distributed.py prove each behaviour; this
script only times it. CPU figures: a pod's restore and compile take longer, the detection bounds
(heartbeat, step timeout) are the same keys.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import shutil
import signal
import sysconfig
import tempfile
import time
from dataclasses import dataclass

from bench.procs import TINY, Train, two_processes

DATA = "data.path=" + os.path.join(sysconfig.get_paths()["stdlib"], "json", "**", "*.py")


@dataclass
class Row:
    fault: str
    handled_s: float | None  # fault -> the stack has acted on it (exited, warned or skipped)
    exit_code: int | None
    recovered_s: float | None  # the same command again -> its first new step logged
    lost_steps: int  # steps computed before the fault that had to be computed again
    note: str


def args(run_dir: str, *extra: str) -> list[str]:
    return ["--config", TINY, f"run.dir={run_dir}", DATA, "train.log_every=1", *extra]


def restart(run_dir: str, *extra: str) -> tuple[float, Train]:
    """Starts the command again and times it to its first trained step."""
    t = Train(*args(run_dir, *extra))
    t.wait_for(r"^step +\d+/", timeout=180)
    seconds = t.seen_at(r"^step +\d+/") - t.started
    t.finish(300)
    return seconds, t


def resumed_step(t: Train) -> int:
    return int(t.wait_for(r"resumed from step (\d+)").group(1))


def last_step(t: Train) -> int:
    """The last step the process logged (log_every=1: the last it finished)."""
    steps = [int(m.group(1)) for line in t.lines if (m := re.match(r"^step +(\d+)/", line))]
    return max(steps, default=0)


def preemption(root: str, signum: int = signal.SIGTERM, cache: str = "") -> Row:
    run_dir = os.path.join(root, f"preempt{signum}{'-cached' if cache else ''}")
    extra = ["train.steps=40", "checkpoint.every=1000"] + ([f"run.compile_cache={cache}"] if cache else [])
    t = Train(*args(run_dir, *extra))
    t.wait_for(r"^step +5/")
    t0 = time.monotonic()
    t.signal(signum)
    code = t.finish(120)
    detected = time.monotonic() - t0
    done = int(t.wait_for(r"preempted by \w+: checkpoint at step (\d+)").group(1))
    seconds, again = restart(run_dir, *extra)
    name = f"{signal.Signals(signum).name} mid-run" + (" (run.compile_cache warm)" if cache else "")
    start = resumed_step(again)
    return Row(name, detected, code, seconds, last_step(t) - start, f"saved step {done}, resumed from step {start}")


def kill_mid_run(root: str) -> Row:
    run_dir = os.path.join(root, "kill9")
    extra = ["train.steps=40", "checkpoint.every=4"]
    t = Train(*args(run_dir, *extra))
    t.wait_for(r"^step +10/")
    t.kill()
    last = last_step(t)
    seconds, again = restart(run_dir, *extra)
    start = resumed_step(again)
    return Row("kill -9 mid-run", None, -9, seconds, last - start, f"killed after step {last}, resumed from step {start}")


def half_written(run_dir: str) -> bool:
    return bool(glob.glob(os.path.join(run_dir, "checkpoints", "*tmp*")))


def complete(run_dir: str) -> bool:
    return any(d.isdigit() for d in os.listdir(os.path.join(run_dir, "checkpoints")))


def kill_mid_save(root: str) -> Row:
    """A ~27 MB state saved every step (synthetic tokens for the 16k vocabulary)."""
    run_dir = os.path.join(root, "killsave")
    extra = ["data.source=synthetic", "model.d_model=128", "model.head_dim=8", "model.vocab_size=16384",
             "checkpoint.every=1", "checkpoint.keep=2", "train.steps=30"]
    for _ in range(5):
        shutil.rmtree(run_dir, ignore_errors=True)
        t = Train(*args(run_dir, *extra))
        t.wait_for(r"^step +2/")
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not (half_written(run_dir) and complete(run_dir)):
            time.sleep(0.001)
        t.kill()
        if half_written(run_dir) and complete(run_dir):  # a save in flight, and one to fall back on
            break
    else:
        return Row("kill -9 mid-save", None, None, None, 0, "never caught a save in flight")
    last = last_step(t)
    seconds, again = restart(run_dir, *extra)
    start = resumed_step(again)
    return Row("kill -9 mid-save", None, -9, seconds, last - start,
               f"killed after step {last} with a save in flight; resumed from step {start}")


def damaged_newest(root: str) -> Row:
    run_dir = os.path.join(root, "damaged")
    Train(*args(run_dir, "train.steps=8", "checkpoint.every=4")).finish(120)
    state = os.path.join(run_dir, "checkpoints", "8", "state")
    largest = max((os.path.join(d, f) for d, _, fs in os.walk(state) for f in fs), key=os.path.getsize)
    with open(largest, "r+b") as f:
        f.truncate(os.path.getsize(largest) // 2)
    seconds, again = restart(run_dir, "train.steps=12", "checkpoint.every=4")
    warned = again.seen_at("cannot be read") - again.started
    start = resumed_step(again)
    return Row("newest checkpoint truncated", warned, None, seconds, 8 - start,
               f"warned (time from restart), fell back, resumed from step {start}")


def killed_peer(root: str) -> Row:
    procs = two_processes(*args(os.path.join(root, "peer"), "train.steps=100000", "checkpoint.every=100000"),
                          heartbeat=5)
    procs[0].wait_for(r"^step +3/", timeout=180)
    t0 = time.monotonic()
    procs[1].kill()
    code = procs[0].finish(120)
    return Row("peer process killed (2 x 4 devices)", time.monotonic() - t0, code, None, 0,
               "dist.heartbeat_timeout_s=5; the survivor exits, a scheduler restarts the job")


def config_mismatch(root: str) -> Row:
    procs = two_processes(*args(os.path.join(root, "mismatch"), "train.steps=4"),
                          per_process=(["optim.lr=0.001"], ["optim.lr=0.002"]), heartbeat=5)
    codes = [p.finish(120) for p in procs]
    seen = max(p.seen_at("processes disagree") - p.started for p in procs)
    return Row("processes disagree on the config", seen, max(codes), None, 0,
               "from launch; before the first compile, nothing written")


def nan_batch(root: str) -> Row:
    t = Train(*args(os.path.join(root, "nan"), "train.steps=6", "debug.nan_steps=3"))
    t.finish(120)
    detected = t.seen_at("step 3 has a non-finite") - t.seen_at(r"^step +2/")
    return Row("NaN batch at step 3", detected, t.proc.returncode, None, 0,
               "update skipped in the step itself; the run goes on")


def hung_step(root: str) -> Row:
    """The default model's step, longer on CPU than a 0.3 s timeout: the watchdog fires inside
    the first timed step; detected = from the last line before the dump to the dump."""
    run_dir = os.path.join(root, "hung")
    t = Train(f"run.dir={run_dir}", DATA, "train.steps=50", "train.log_every=1", "train.step_timeout_s=0.3")
    t.finish(120)
    dumped = t.lines.index(next(line for line in t.lines if "more than train.step_timeout_s" in line))
    detected = t.stamps[dumped] - t.stamps[dumped - 1]
    return Row("a step over train.step_timeout_s=0.3", detected, t.proc.returncode, None, 0,
               "every thread's stack dumped, exit 4; a real hang is caught the same way")


SCENARIOS = [preemption, kill_mid_run, kill_mid_save, damaged_newest, killed_peer, config_mismatch, nan_batch, hung_step]


def fmt(x: float | int | None) -> str:
    return "-" if x is None else f"{x:.1f}" if isinstance(x, float) else str(x)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="", help="keep the run directories here (default: a temp dir)")
    opts = parser.parse_args()
    root = opts.out or tempfile.mkdtemp(prefix="bench-faults-")
    rows = []
    for scenario in SCENARIOS:
        rows.append(scenario(root))
        if scenario is preemption:  # again with run.compile_cache: the restart finds its programs there
            rows.append(preemption(root, cache=os.path.join(root, "cache")))
    print("| fault | handled after s | exit | same command: first new step after s | steps recomputed | what happened |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r.fault} | {fmt(r.handled_s)} | {fmt(r.exit_code)} | {fmt(r.recovered_s)} | {r.lost_steps} | {r.note} |")
    if not opts.out:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()

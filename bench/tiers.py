"""What the local checkpoint tier costs and saves, on a real 4-process job (2 fake CPU devices each).

    python -m bench.tiers [--out DIR]

Two jobs of the tiny preset: the persistent tier alone (checkpoint.every=10), and with a local
tier too, saving every 2 steps. Each trains until step 17, when process 1 is
killed and its local directory removed (its host is gone) and the job is restarted whole, as a
scheduler would, and runs to step 40. Printed: the wall seconds per step before the kill (saves
included; the console lines' arrival times from step 5 to step 15), the share of the restarted
run's step time spent blocked in saves (its summary.json: checkpoint over checkpoint + steps),
the step resumed from, the steps computed again, and the restart's time to its first new step
(process start, restore and any fetch from a peer, compile).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sysconfig
import tempfile
from dataclasses import dataclass

from bench.procs import TINY, Train, processes
from configs import load_config
from trainer.tiers import layout_tag, process_dir

DATA = "data.path=" + os.path.join(sysconfig.get_paths()["stdlib"], "json", "**", "*.py")
N, KILL_AFTER = 4, 17


@dataclass
class Row:
    tiers: str
    step_s: float  # wall seconds per step, steps 5..15, saves included
    saving: float  # the restarted run's blocking save time over its step time plus that
    resumed: int
    lost: int  # steps computed before the kill that were computed again
    recovered_s: float  # restart -> its first new step logged


def stamp(t: Train, step: int) -> float:
    return t.seen_at(rf"^step +{step}/")


def job(root: str, name: str, *extra: str) -> Row:
    run_dir, local_dir = os.path.join(root, name, "run"), os.path.join(root, name, "local")
    cmd = ["--config", TINY, f"run.dir={run_dir}", DATA, "train.log_every=1", "train.steps=40", "checkpoint.every=10",
           f"checkpoint.local_dir={local_dir}" if extra else "checkpoint.local_dir=", *extra]
    first = processes(N, *cmd, heartbeat=5)
    first[0].wait_for(rf"^step +{KILL_AFTER}/", timeout=300)
    first[1].kill()
    if extra:
        shutil.rmtree(process_dir(load_config(TINY, cmd[2:]), layout_tag({"data": 8}, N), 1))
    for p in first:
        p.kill()
    step_s = (stamp(first[0], 15) - stamp(first[0], 5)) / 10
    again = processes(N, *cmd, heartbeat=5)
    resumed = int(again[0].wait_for(r"resumed from step (\d+)", timeout=300).group(1))
    again[0].wait_for(r"^step +\d+/", timeout=300)
    recovered = again[0].seen_at(r"^step +\d+/") - again[0].started
    assert [p.finish(600) for p in again] == [0] * N, again[0].output
    with open(os.path.join(run_dir, "summary.json")) as f:
        seconds = json.load(f)["invocations"][-1]["seconds"]
    saving = seconds["checkpoint"] / (seconds["checkpoint"] + seconds["productive"] + seconds["recompute"])
    last = max(int(m.group(1)) for line in first[0].lines if (m := re.match(r"^step +(\d+)/", line)))
    tiers = f"persistent + local ({extra[0]})" if extra else "persistent only"
    return Row(tiers, step_s, saving, resumed, last - resumed, recovered)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="", help="keep the run directories here (default: a temp dir)")
    opts = parser.parse_args()
    root = opts.out or tempfile.mkdtemp(prefix="bench-tiers-")
    rows = [job(root, "one"), job(root, "two", "checkpoint.local_every=2")]
    print(f"| tiers ({N} processes) | s/step, steps 5-15 | time blocked in saves, restarted run | killed after step "
          "| resumed from | steps recomputed | restart to first new step, s |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r.tiers} | {r.step_s:.3f} | {100 * r.saving:.1f}% | {r.resumed + r.lost} | {r.resumed} | {r.lost} "
              f"| {r.recovered_s:.1f} |")
    if not opts.out:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()

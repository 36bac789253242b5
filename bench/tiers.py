"""What the local checkpoint tier costs and saves, on a real 4-process job (2 fake CPU devices each).

    python -m bench.tiers [--repeat N] [--every 0,2,5,10] [--only cost|recovery] [--out DIR] [KEY=VALUE ...]
    python -m bench.tiers --breakdown [KEY=VALUE ...]

Cost: jobs of the tiny preset run 40 steps with a persistent save at the end alone
(checkpoint.every=40), without a local tier and with one saving every 2, 5 and 10 steps
(`--every`; 0 is no local tier), the variants taken in turn, `--repeat` times (default 3).
KEY=VALUE overrides apply to every job of the cost table and the breakdown: a larger batch
(`train.global_batch=64 model.seq_len=256`) makes steps longer with the same state to save, as
a pod's steps are next to the tiny preset's 512 tokens.
Printed per variant, medians over the repeats: the wall seconds per step from step 5 to step 35
(the console lines' arrival times, saves included), its growth over the job without a local tier,
the blocking seconds of one local save (the loop's own timing of the save call, from
summary.json), and their share of the `local_every` steps between two saves (timed without a local tier).

Breakdown: one cost job saving locally every 2 steps, whose processes record the timings Orbax
takes of its own saves (bench/orbax_events); printed for process 0, per local save: the loop's
blocking time, Orbax's blocking part, its parts on the loop's thread (the copy off the devices,
the barriers) and the rest; means over the run's local saves, the first (Orbax's one-time set-up)
included.

Recovery: two jobs, the persistent tier alone (checkpoint.every=10) and with a local tier saving
every 2 steps. Each trains until step 17, when process 1 is killed and its local directory removed
(its host is gone) and the job is restarted whole, as a scheduler would, and runs to step 40.
Printed: the wall seconds per step before the kill (steps 5 to 15), the share of the restarted
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
import statistics
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


def command(
    root: str, name: str, every: int, local_every: int, steps: int = 40, extra: tuple[str, ...] = ()
) -> list[str]:
    run_dir, local_dir = os.path.join(root, name, "run"), os.path.join(root, name, "local")
    local = [f"checkpoint.local_dir={local_dir}", f"checkpoint.local_every={local_every}"] if local_every else [
        "checkpoint.local_dir="]
    return ["--config", TINY, f"run.dir={run_dir}", DATA, "train.log_every=1", f"train.steps={steps}",
            f"checkpoint.every={every}", *local, *extra]


def last_invocation(cmd: list[str]) -> dict:
    with open(os.path.join(cmd[2].split("=", 1)[1], "summary.json")) as f:
        return json.load(f)["invocations"][-1]


def cost(root: str, name: str, local_every: int, extra: tuple[str, ...]) -> tuple[float, float | None]:
    """(wall s/step over steps 5..35, blocking seconds per local save or None) of one 40-step job."""
    cmd = command(root, name, 40, local_every, extra=extra)
    job = processes(N, *cmd, heartbeat=5)
    assert [p.finish(600) for p in job] == [0] * N, job[0].output
    step_s = (stamp(job[0], 35) - stamp(job[0], 5)) / 30
    local = last_invocation(cmd).get("saves", {}).get("local")
    return step_s, local["blocking_s"] / local["count"] if local else None


def cost_table(root: str, repeat: int, every: list[int], extra: tuple[str, ...]) -> None:
    runs: dict[int, list[tuple[float, float | None]]] = {e: [] for e in every}
    for r in range(repeat):  # the variants in turn, so that a change of the host's load hits them all
        for e in every:
            runs[e].append(cost(root, f"cost-{e}-{r}", e, extra))
    base = statistics.median(s for s, _ in runs[0]) if 0 in runs else None
    jobs = " ".join(extra) or "the tiny preset"
    print(f"| local tier ({N} processes, {jobs}, medians of {repeat}) | s/step, steps 5-35 | step time vs no local tier "
          "| blocking per local save, ms | blocking over the steps between saves |")
    print("| --- | --- | --- | --- | --- |")
    for e in every:
        step_s = statistics.median(s for s, _ in runs[e])
        label = f"checkpoint.local_every={e}" if e else "none"
        blocked = statistics.median(b for _, b in runs[e]) if e else 0.0
        growth = f"{100 * (step_s / base - 1):+.1f}%" if e and base else "-"
        share = f"{100 * blocked / (e * base):.1f}%" if e and base else "-"
        print(f"| {label} | {step_s:.3f} | {growth} | {f'{1000 * blocked:.0f}' if e else '-'} | {share} |")


EVENTS = {  # Orbax's jax.monitoring events of a save's blocking part, as the breakdown names them
    "/jax/orbax/write/async/blocking_duration_secs": "Orbax's blocking part of the save",
    "/jax/orbax/write/blocking_d2h_duration_secs": "copy off the devices",
    "/jax/checkpoint/sync_global_devices_duration_sec": "barriers",
}


def breakdown(root: str, extra: tuple[str, ...]) -> None:
    cmd = command(root, "breakdown", 40, 2, extra=extra)
    events_dir = os.path.join(root, "events")
    os.makedirs(events_dir, exist_ok=True)
    here = os.path.dirname(os.path.abspath(__file__))
    path = [os.path.join(here, "orbax_events"), os.path.dirname(here), os.environ.get("PYTHONPATH", "")]
    env = {"BENCH_EVENTS_DIR": events_dir, "PYTHONPATH": os.pathsep.join(path)}
    job = processes(N, *cmd, heartbeat=5, env={i: env for i in range(N)})
    assert [p.finish(600) for p in job] == [0] * N, job[0].output
    local = last_invocation(cmd)["saves"]["local"]
    saves, end = local["count"], stamp(job[0], 39)  # logged after the last local save (38), before step 40
    with open(os.path.join(events_dir, f"events-{job[0].proc.pid}.jsonl")) as f:
        events = [e for line in f if (e := json.loads(line))["t"] < end and e["name"] in EVENTS and e["main"]]
    print(f"| part of one local save (process 0 of {N}, {saves} saves, checkpoint.local_every=2) | ms per save "
          "| events per save |")
    print("| --- | --- | --- |")
    loop_ms = 1000 * local["blocking_s"] / saves
    print(f"| the loop's blocking time (summary.json) | {loop_ms:.0f} | 1 |")
    parts = 0.0
    for name, label in EVENTS.items():
        seconds = [e["s"] for e in events if e["name"] == name]
        ms = 1000 * sum(seconds) / saves
        parts += ms if name != "/jax/orbax/write/async/blocking_duration_secs" else 0.0
        print(f"| {label} | {ms:.0f} | {len(seconds) / saves:.0f} |")
    print(f"| the rest (threads, directories, Orbax's bookkeeping) | {loop_ms - parts:.0f} | - |")


def recovery(root: str, name: str, local_every: int) -> Row:
    cmd = command(root, name, 10, local_every)
    first = processes(N, *cmd, heartbeat=5)
    first[0].wait_for(rf"^step +{KILL_AFTER}/", timeout=300)
    first[1].kill()
    if local_every:
        shutil.rmtree(process_dir(load_config(TINY, cmd[2:]), layout_tag({"data": 8}, N), 1))
    for p in first:
        p.kill()
    step_s = (stamp(first[0], 15) - stamp(first[0], 5)) / 10
    again = processes(N, *cmd, heartbeat=5)
    resumed = int(again[0].wait_for(r"resumed from step (\d+)", timeout=300).group(1))
    again[0].wait_for(r"^step +\d+/", timeout=300)
    recovered = again[0].seen_at(r"^step +\d+/") - again[0].started
    assert [p.finish(600) for p in again] == [0] * N, again[0].output
    seconds = last_invocation(cmd)["seconds"]
    saving = seconds["checkpoint"] / (seconds["checkpoint"] + seconds["productive"] + seconds["recompute"])
    last = max(int(m.group(1)) for line in first[0].lines if (m := re.match(r"^step +(\d+)/", line)))
    tiers = f"persistent + local (checkpoint.local_every={local_every})" if local_every else "persistent only"
    return Row(tiers, step_s, saving, resumed, last - resumed, recovered)


def recovery_table(root: str) -> None:
    rows = [recovery(root, "one", 0), recovery(root, "two", 2)]
    print(f"| tiers ({N} processes) | s/step, steps 5-15 | time blocked in saves, restarted run | killed after step "
          "| resumed from | steps recomputed | restart to first new step, s |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r.tiers} | {r.step_s:.3f} | {100 * r.saving:.1f}% | {r.resumed + r.lost} | {r.resumed} | {r.lost} "
              f"| {r.recovered_s:.1f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="", help="keep the run directories here (default: a temp dir)")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each cost variant (default 3)")
    parser.add_argument("--every", default="0,2,5,10", help="checkpoint.local_every of the cost jobs, 0: none")
    parser.add_argument("--breakdown", action="store_true", help="print where one local save's blocking time goes")
    parser.add_argument("--only", choices=("cost", "recovery"), help="print one of the two tables")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides of the cost and breakdown jobs")
    opts = parser.parse_args()
    extra = tuple(opts.overrides)
    root = opts.out or tempfile.mkdtemp(prefix="bench-tiers-")
    if opts.breakdown:
        breakdown(root, extra)
    elif opts.only != "recovery":
        cost_table(root, opts.repeat, [int(e) for e in opts.every.split(",")], extra)
    if opts.only != "cost" and not opts.breakdown:
        recovery_table(root)
    if not opts.out:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()

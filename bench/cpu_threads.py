"""Where the CPU step leaves cores idle: traces a few compiled steps with `jax.profiler` and
prints the share of wall time during which 0, 1, 2, ... of XLA:CPU's pool threads work, and the
operations that run while the other threads wait (the serial part that keeps the step from
using every core). CPU figures only: this says nothing about GPUs or TPUs.

    python -m bench.cpu_threads                       # the default run's step, 3 traced steps
    python -m bench.cpu_threads --steps 5 model.attention_block=128

How it reads the trace (jax 0.10.2's XLA:CPU): each thunk (a fusion, a matmul library call) is an
event on the pool thread that runs it, and a pool thread helping another one's parallel loop
shows as `ThreadpoolListener::StartRegion` .. `StopRegion`. A thread is busy while it runs a
thunk or is inside such a region. Operations are grouped by the HLO op that the compiled
program's fusion names in its metadata (`op_name`), so an attention einsum and a block matmul
are told apart.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import sys
import tempfile

import jax

from bench.step import compiled_step  # importing trainer (there) sets the stack's XLA flags
from configs import ConfigError, load_config
from trainer.xla_env import mesh_device_count

Interval = tuple[float, float]
Thread = tuple[int, int]  # the trace's (pid, tid)


def _merge(intervals: list[Interval]) -> list[Interval]:
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _overlap(a: float, b: float, merged: list[Interval]) -> float:
    return sum(max(0.0, min(b, y) - max(a, x)) for x, y in merged if y > a and x < b)


def busy_intervals(trace: dict) -> tuple[dict[Thread, list[Interval]], list[tuple[float, float, Thread, str]]]:
    """Per pool thread, its merged busy intervals (us); and every thunk as (start, end, thread, name)."""
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in trace["traceEvents"]
             if e.get("ph") == "M" and e.get("name") == "thread_name"}
    events = sorted((e for e in trace["traceEvents"] if e.get("ph") == "X"
                     and "Eigen" in names.get((e["pid"], e["tid"]), "")), key=lambda e: e["ts"])
    busy: dict[Thread, list[Interval]] = collections.defaultdict(list)
    thunks, opened = [], {}
    for e in events:
        thread, name = (e["pid"], e["tid"]), e["name"]
        if name == "ThreadpoolListener::StartRegion":
            opened[thread] = e["ts"]
        elif name == "ThreadpoolListener::StopRegion":
            if thread in opened:
                busy[thread].append((opened.pop(thread), e["ts"]))
        elif not name.startswith(("ThreadpoolListener", "end:", "ThunkExecutor")) and "Await" not in name:
            busy[thread].append((e["ts"], e["ts"] + e["dur"]))
            thunks.append((e["ts"], e["ts"] + e["dur"], thread, name))
    return {t: _merge(iv) for t, iv in busy.items()}, thunks


def concurrency(busy: dict[Thread, list[Interval]]) -> dict[int, float]:
    """Microseconds of the traced window spent with n threads busy, for each n."""
    points = sorted((x, d) for merged in busy.values() for a, b in merged for x, d in ((a, 1), (b, -1)))
    spent: dict[int, float] = collections.Counter()
    running, last = 0, points[0][0]
    for x, d in points:
        spent[running] += x - last
        running, last = running + d, x
    return dict(spent)


def alone_by_op(busy: dict[Thread, list[Interval]], thunks: list, op_names: dict[str, str]) -> dict[str, list[float]]:
    """Per HLO op (the thunk's op_name, else its fusion kind): [thunk time, time no other thread worked]."""
    out: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0])
    for a, b, thread, name in thunks:
        others = sum(_overlap(a, b, merged) for t, merged in busy.items() if t != thread)
        op = op_names.get(name) or re.sub(r"\.\d+$", "", name)
        out[op][0] += b - a
        out[op][1] += max(0.0, (b - a) - others)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", help="a YAML preset (path or name in configs/)")
    parser.add_argument("--steps", type=int, default=3, help="traced steps (after 3 untraced ones)")
    parser.add_argument("--top", type=int, default=10, help="operations listed")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config, ["mesh.data=1", *args.overrides, "data.source=synthetic", "data.packing=concat"])
        # The mesh's own devices (a test process has more CPU devices than the one the default uses).
        _, step, _, state, batch = compiled_step(cfg, jax.devices()[:mesh_device_count(cfg)])
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    # Library fusions (kind=kCustom) and custom calls (the CPU matmul kernel's) by their HLO op.
    op_names = dict(re.findall(r'%?(\S+) = [^\n]*?(?:kind=kCustom|custom-call\()[^\n]*?op_name="([^"]+)"',
                               step.as_text()))
    for _ in range(3):
        state, metrics = step(state, batch)
    jax.block_until_ready(metrics)
    with tempfile.TemporaryDirectory() as d:
        jax.profiler.start_trace(d)
        for _ in range(args.steps):
            state, metrics = step(state, batch)
            jax.block_until_ready(metrics)
        jax.profiler.stop_trace()
        (path,) = glob.glob(os.path.join(d, "plugins", "profile", "*", "*.trace.json.gz"))
        with gzip.open(path) as f:
            trace = json.load(f)
    busy, thunks = busy_intervals(trace)
    spent = concurrency(busy)
    window = sum(spent.values())
    per_step = 1e-3 / args.steps
    print(f"CPU only: {os.cpu_count()} cores, XLA:CPU pool threads seen {len(busy)}, load average "
          f"{os.getloadavg()[0]:.1f}; {args.steps} traced steps, {window * per_step:.0f} ms of wall per step (traced)")
    print("| threads busy | ms per step | share of wall |")
    print("| --- | --- | --- |")
    for n in sorted(spent):
        print(f"| {n} | {spent[n] * per_step:.0f} | {100 * spent[n] / window:.1f}% |")
    print(f"\nOperations by the time they run with every other thread idle (top {args.top}):")
    print("| op (HLO op_name, else fusion kind) | ms per step | of it alone | share alone |")
    print("| --- | --- | --- | --- |")
    ops = sorted(alone_by_op(busy, thunks, op_names).items(), key=lambda kv: -kv[1][1])
    for op, (total, alone) in ops[:args.top]:
        short = op.removeprefix("jit(train_step)/").replace("closed_call/", "")[-70:]
        print(f"| {short} | {total * per_step:.1f} | {alone * per_step:.1f} | {100 * alone / max(total, 1e-9):.0f}% |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

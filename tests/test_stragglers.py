"""Stragglers named (trainer/stragglers.py): one real process of a 2-process job slowed by the
environment variable the detection is tried with; and the rule itself on given times."""

from __future__ import annotations

import json
import os
import re

from bench.procs import TINY, processes
from conftest import stdlib_glob
from trainer.stragglers import SLOW_ENV, find_stragglers

DATA = f"data.path={stdlib_glob('json')}"


def test_a_slowed_process_is_named_within_k_steps(tmp_path):
    run_dir = tmp_path / "run"
    job = processes(2, "--config", TINY, f"run.dir={run_dir}", DATA, "train.log_every=1", "train.steps=14",
                    "checkpoint.every=100", "straggler.steps=3", "straggler.factor=2", "optim.decay_steps=12",
                    env={1: {SLOW_ENV: "0.4"}})
    codes = [p.finish(240) for p in job]
    out = job[0].output
    assert codes == [0, 0], out + job[1].output
    named = [i for i, line in enumerate(job[0].lines) if line.startswith("straggler:")]
    assert len(named) == 1, out
    line = job[0].lines[named[0]]
    assert re.match(r"straggler: process 1 \(host [^)]+\) spent 0\.[45]\d\d s per step on its own over the last 3 "
                    r"steps, \d+\.\dx the others' median 0\.\d+ s; every process waits for it", line), line
    # Named within K steps of the slowdown's start, plus the watchdog's 1 s poll (two steps here).
    steps_before = [int(m.group(1)) for l in job[0].lines[:named[0]] if (m := re.match(r"^step +(\d+)/", l))]
    assert max(steps_before) <= 3 + 4, steps_before
    with open(run_dir / "metrics.jsonl") as f:
        records = [json.loads(line) for line in f]
    late = [r for r in records if r["step"] >= 8]
    assert all(r["own_s/p1"] > 0.35 and r["own_s/p0"] < 0.2 for r in late), late


def rows(own: list[float], wall: float = 1.0) -> list[tuple[int, float, float]]:
    return [(step, s, wall) for step, s in enumerate(own, start=1)]


def test_the_rule_names_only_a_process_slow_in_each_of_the_last_k_steps():
    fast, slow = [0.1] * 5, [0.1, 0.1, 0.5, 0.5, 0.5]
    assert find_stragglers({0: rows(fast), 1: rows(slow), 2: rows(fast)}, 2.0, 3) == [(1, 0.5, 0.1)]
    assert find_stragglers({0: rows(fast), 1: rows(slow), 2: rows(fast)}, 2.0, 4) == [], "slow for 3 steps, not 4"
    assert find_stragglers({0: rows(fast), 1: rows(fast)}, 2.0, 3) == [], "nobody slow"
    # Twice the median but by less than a tenth of the step: noise, not named.
    assert find_stragglers({0: rows([0.01] * 3), 1: rows([0.03] * 3)}, 2.0, 3) == []
    assert find_stragglers({0: rows(fast), 1: rows(slow)}, 0.0, 3) == [], "straggler.factor=0: off"
    # Only the steps every process has reported count.
    assert find_stragglers({0: rows(fast[:3]), 1: rows(slow)}, 2.0, 3) == []
    assert os.environ.get(SLOW_ENV) is None


def test_a_step_timeout_names_the_process_that_had_not_arrived(tmp_path):
    job = processes(2, "--config", TINY, f"run.dir={tmp_path / 'run'}", DATA, "train.steps=4", "train.step_timeout_s=4",
                    env={1: {SLOW_ENV: "600"}})
    try:
        assert job[0].finish(180) == 4, job[0].output
    finally:
        job[1].kill()
    (line,) = [line for line in job[0].lines if "more than train.step_timeout_s" in line]
    assert re.match(r"error: step 1 has run \d+ s, more than train\.step_timeout_s=4; process\(es\) \[1\] \(host [^)]+\) "
                    r"had not dispatched it \(the coordination service's view\); stacks of every thread follow$", line), line

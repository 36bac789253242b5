"""Stragglers and hangs named (ops/stragglers.py, ops/faults.py): the rule on given times,
and a real 2-process job whose process 1 never dispatches its step. A slowed process of a real
2-process job is named in tests/test_tiers.py (its first job, which a replaced host interrupts)."""

from __future__ import annotations

import os
import re

from bench.procs import TINY, processes
from conftest import stdlib_glob
from ops.stragglers import SLOW_ENV, find_stragglers

DATA = f"data.path={stdlib_glob('json')}"


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
    # One device a process: the claim is about processes, and every device costs each process CPU time.
    job = processes(2, "--config", TINY, f"run.dir={tmp_path / 'run'}", DATA, "train.steps=4", "train.step_timeout_s=4",
                    env={1: {SLOW_ENV: "600"}}, devices=1)
    try:
        assert job[0].finish(180) == 4, job[0].output
    finally:
        job[1].kill()
    (line,) = [line for line in job[0].lines if "more than train.step_timeout_s" in line]
    assert re.match(r"error: step 1 has run \d+ s, more than train\.step_timeout_s=4; process\(es\) \[1\] \(host [^)]+\) "
                    r"had not dispatched it \(the coordination service's view\); stacks of every thread follow$", line), line

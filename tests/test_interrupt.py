"""A signal at any moment outside the training loop, for real: `train.py` and `plan.py` processes
are sent SIGINT or SIGTERM while they import, start up or compile. Each ends with one line saying
what was kept, exit 128 + the signal (130, 143), no traceback and no crash of the runtime;
run.dir's lock is released and nothing there reads as a checkpoint, so the same command then runs.
(A signal inside the loop: tests/test_faults.py.)"""

from __future__ import annotations

import importlib
import os
import signal
import subprocess
import sys
import time
from typing import Callable

import pytest

from bench.procs import ROOT, TINY, Train, cpu_env

KEPT = ("stopped before the training loop; checkpoints already in run.dir are intact (a save in flight is never "
        "read); run the same command to start or resume")


def _one_line(output: str, signum: int, kept: str) -> None:
    assert "Traceback" not in output and "Segmentation" not in output, output
    assert output.splitlines()[-1] == f"interrupted by {signal.Signals(signum).name}: {kept}", output


@pytest.mark.parametrize("signum, when", [(signal.SIGINT, "importing"), (signal.SIGTERM, "starting up")])
def test_train_py_interrupted_before_the_loop_leaves_one_line_and_a_usable_run_dir(tmp_path, signum, when):
    """While it imports (0.3 s in) or once it has printed its mesh (it then builds the initial
    state, a compile, and the train step's compile)."""
    cmd = ["--config", TINY, f"run.dir={tmp_path}", "train.steps=2", "train.log_every=1"]
    first = Train(*cmd, devices=1)
    if when == "importing":
        _wait_until_it_catches_sigterm(first.proc.pid)  # train.py's handlers are in; JAX is not imported yet
    else:
        first.wait_for(r"^mesh ")
    first.signal(signum)
    assert first.finish(60) == 128 + signum, first.output
    _one_line(first.output, signum, KEPT)
    assert not os.path.exists(tmp_path / "lock.json"), "the lock is released"
    left = os.listdir(tmp_path / "checkpoints") if os.path.isdir(tmp_path / "checkpoints") else []
    assert not [d for d in left if d.isdigit()], left
    again = Train(*cmd, devices=1)
    assert again.finish(120) == 0, again.output
    assert "resumed from" not in again.output and "took over" not in again.output, again.output


def test_plan_py_interrupted_while_its_child_compiles_leaves_no_compile_running(tmp_path):
    out, scratch = tmp_path / "plan.json", tmp_path / "tmp"
    scratch.mkdir()
    env = dict(cpu_env(1), PYTHONUNBUFFERED="1", TMPDIR=str(scratch))  # where the child's spec goes
    plan = subprocess.Popen([sys.executable, "plan.py", "--config", "tiny", "--devices", "8", "--out", str(out)],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = plan.stderr.readline()  # "compiling tiny for 8 x h100 ...": the child has started
    assert line.startswith("compiling"), line
    children = [int(p) for p in subprocess.run(["pgrep", "-P", str(plan.pid)], capture_output=True,
                                               text=True).stdout.split()]
    assert children, "the compiling child"
    plan.send_signal(signal.SIGINT)
    rest = plan.stderr.read()
    assert plan.wait(30) == 130
    _one_line(line + rest, signal.SIGINT, "the compile was stopped and nothing was written")
    assert not out.exists()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(_running(p) for p in children):
        time.sleep(0.05)
    assert not any(_running(p) for p in children), "no orphaned compile runs on"
    assert not os.listdir(scratch), "the child's spec and log are removed"


def _wait_until_it_catches_sigterm(pid: int) -> None:
    """Until the process has a handler for SIGTERM (/proc's SigCgt mask): Python installs none of
    its own, so the command's (configs.interrupt) is in place. A signal before the interpreter runs
    at all is the kernel's alone to handle."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/status") as f:
            caught = int(next(line for line in f if line.startswith("SigCgt:")).split()[1], 16)
        if caught >> (signal.SIGTERM - 1) & 1:
            return
        time.sleep(0.002)
    raise AssertionError("the process never caught SIGTERM")


def _running(pid: int) -> bool:
    """Alive and not a zombie (a killed child nobody waited for)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


# Each entry point's command line, and its module's line of what a signal leaves (KEPT).
COMMANDS = {
    "train.py": ["train.py", "--config", "tiny", "run.dir={tmp}/run"],
    "sweep.py": ["sweep.py", "configs/sweeps/tiny_lr.yaml"],
    "plan.py": ["plan.py", "--config", "tiny", "--devices", "8"],
    "eval.py": ["eval.py", "--run-dir", "{tmp}/run", "--tasks", "arc_easy"],
    "data.prepare": ["-m", "data.prepare", "--input", "{tmp}/in.jsonl", "--output", "{tmp}/out"],
    "data.examples": ["-m", "data.examples", "--output", "{tmp}/examples"],
    "hf.py": ["hf.py", "export", "--run-dir", "{tmp}/run", "--out", "{tmp}/out"],
    "generate.py": ["generate.py", "--run-dir", "{tmp}/run", "--prompt", "a"],
}


def _interrupted_once_imported(tmp_path, name: str, moment: Callable[[str], bool]) -> None:
    """`name`'s command sent SIGINT once `-X importtime` reports a module for which `moment` holds
    (each module is named as it finishes): exit 130 and the command's one line."""
    argv = [a.replace("{tmp}", str(tmp_path)) for a in COMMANDS[name]]
    kept = importlib.import_module(name.removesuffix(".py")).KEPT
    proc = subprocess.Popen([sys.executable, "-X", "importtime", *argv], cwd=ROOT, env=dict(cpu_env(1)),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen = []
    for line in proc.stderr:
        seen.append(line)
        if line.startswith("import time:") and moment(line.rpartition("|")[2].strip()):
            proc.send_signal(signal.SIGINT)
            break
    rest = proc.stderr.read()
    assert proc.wait(30) == 130, "".join(seen) + rest
    output = "".join(line for line in (seen + rest.splitlines(keepends=True)) if not line.startswith("import time:"))
    _one_line(output, signal.SIGINT, kept)


@pytest.mark.parametrize("name", ["plan.py", "hf.py", "generate.py"])
def test_a_command_interrupted_while_it_imports_jax_leaves_one_line(tmp_path, name):
    """Ctrl-C while JAX is being imported (the first of JAX's own modules is the moment), the
    commands' arguments already parsed."""
    _interrupted_once_imported(tmp_path, name, lambda module: module.startswith("jax."))


@pytest.mark.parametrize("name", list(COMMANDS))
def test_a_command_interrupted_while_it_loads_its_config_schema_leaves_one_line(tmp_path, name):
    """Ctrl-C in the first tenth of a second, once the first module of the config schema is imported
    (configs.interrupt aside), before any argument is parsed: each entry point has its handler in
    before its own imports."""
    _interrupted_once_imported(tmp_path, name,
                               lambda module: module.startswith("configs.") and module != "configs.interrupt")

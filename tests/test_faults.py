"""Faults injected for real, on real files and, where the fault or its report is a process's,
in real train.py processes: preemption signals, kill -9 mid-run and mid-save, damaged
checkpoints, a hung step. Non-finite steps, and the resumes after a signal or a kill (what they
claim is read from run.dir, not from a process), run train.py's own main in this process; the
damaged-checkpoint resumes stay processes: their claim is the console of a whole process."""

from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

import train
import trainer
from configs import load_config
from conftest import ROOT, stdlib_glob, stopped_at
from bench.procs import TINY, Train, cpu_env, run

DATA = f"data.path={stdlib_glob('json')}"


def args(run_dir, *extra: str) -> list[str]:
    # One learning-rate horizon for runs of every length: the schedule is a constant of the
    # compiled step, so with it the tiny runs here share one program (compiled once, then served
    # by the shared compilation cache) instead of compiling one per train.steps.
    return ["--config", TINY, f"run.dir={run_dir}", DATA, "train.log_every=1", "optim.decay_steps=12", *extra]


def train_here(run_dir, *extra: str, devices: int = 8) -> None:
    """The run of `args(run_dir, *extra)` in this process, on its first `devices` devices: for the
    references and resumes, whose claim is not about a process (the same program as train.py's on
    as many devices, so the same numbers, without its start-up)."""
    trainer.run(load_config(TINY, args(run_dir, *extra)[2:]), jax.devices()[:devices])


def main_here(capfd, *argv: str) -> tuple[int, str]:
    """`python train.py ARGV`'s exit status and output, from its own `main` run in this process:
    for the claims about what a run prints, writes and returns, not about a process (a process
    costs seconds of CPU time in imports and teardown)."""
    capfd.readouterr()
    code = train.main(list(argv))
    captured = capfd.readouterr()
    return code, captured.out + captured.err


def final_losses(run_dir) -> dict[int, float]:
    """Step -> loss from metrics.jsonl, the last line for a step winning (as after a resume)."""
    out = {}
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for line in f:
            r = json.loads(line)
            out[r["step"]] = r["loss"]
    return out


def steps_on_disk(run_dir) -> list[int]:
    return sorted(int(d) for d in os.listdir(os.path.join(run_dir, "checkpoints")) if d.isdigit())


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signal_saves_the_current_step_and_the_same_command_resumes(tmp_path, capfd, signum):
    # 16 steps: the signal at step 5 leaves 11 for it to land in (the resume runs what is left).
    cmd = args(tmp_path, "train.steps=16", "checkpoint.every=1000")
    first = Train(*cmd)
    first.wait_for(r"^step +5/16")
    first.signal(signum)
    assert first.finish(60) == (130 if signum == signal.SIGINT else 143), first.output
    stopped = int(first.wait_for(r"preempted by SIG\w+: checkpoint at step (\d+) committed").group(1))
    assert stopped >= 5 and steps_on_disk(tmp_path) == [stopped]
    # The signal is the process's; the resume reads run.dir, whoever runs the command.
    code, out = main_here(capfd, *cmd)
    assert code == 0, out
    assert f"resumed from step {stopped}" in out
    assert sorted(final_losses(tmp_path)) == list(range(1, 17)), "every step's metrics are kept"


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The reference run: 12 steps without interruption, its checkpoints at 4, 8 and 12 kept."""
    run_dir = tmp_path_factory.mktemp("straight") / "run"
    train_here(run_dir, "train.steps=12", "checkpoint.every=4", "checkpoint.keep=3")
    assert steps_on_disk(run_dir) == [4, 8, 12]
    return run_dir


@pytest.fixture(scope="module")
def uninterrupted(straight):
    """The reference's losses."""
    return final_losses(straight)


def test_kill_9_mid_run_resumes_bit_for_bit(tmp_path, capfd, uninterrupted):
    cmd = args(tmp_path, "train.steps=12", "checkpoint.every=4")
    victim = Train(*cmd)
    victim.wait_for(r"^step +6/12")
    deadline = time.monotonic() + 30  # the save of step 4 commits in the background
    while not (tmp_path / "checkpoints" / "4").exists() and time.monotonic() < deadline:
        time.sleep(0.005)
    victim.kill()
    on_disk = steps_on_disk(tmp_path)
    assert 4 in on_disk and 12 not in on_disk, "killed mid-run"
    code, out = main_here(capfd, *cmd)
    assert code == 0 and f"resumed from step {max(on_disk)}" in out, out
    assert final_losses(tmp_path) == uninterrupted


# Synthetic tokens: a 16k vocabulary is far from the byte tokenizer's, which the text source refuses.
# The state is the vocabulary's; 64 tokens a step (not the preset's 512) keep its steps short. One
# device: the state's size on disk is the same, but 8 data-parallel replicas make every step (each
# replica's optimizer update, the gradients' all-reduce) and the trace several times slower.
BIG_STATE = ["data.source=synthetic", "model.d_model=128", "model.head_dim=8", "model.vocab_size=16384",
             "train.global_batch=8", "model.seq_len=8", "checkpoint.every=1", "checkpoint.keep=2", "train.steps=6",
             "mesh.data=1"]


def test_kill_9_mid_save_ignores_the_half_written_checkpoint(tmp_path, capfd):
    """A state of ~27 MB saved every step: kill -9 as soon as a save is seen in flight."""
    reference = tmp_path / "reference"
    # its losses are the claim, not its saves
    train_here(reference, *BIG_STATE, "checkpoint.every=1000", devices=1)
    for attempt in range(3):
        run_dir = tmp_path / f"attempt{attempt}"
        victim = Train(*args(run_dir, *BIG_STATE), devices=1)
        victim.wait_for(r"^step +2/6")
        deadline = time.monotonic() + 30
        # At least one complete checkpoint, and a later save half-written.
        while time.monotonic() < deadline and not (
            glob.glob(str(run_dir / "checkpoints" / "*tmp*")) and steps_on_disk(run_dir)
        ):
            time.sleep(0.001)
        victim.kill()
        half = glob.glob(str(run_dir / "checkpoints" / "*tmp*"))
        if half:
            break
    else:
        pytest.fail("three attempts never caught a save in flight")
    complete = steps_on_disk(run_dir)
    # The resume reads run.dir, whoever runs the command: trainer.run, train.main's call, as on one
    # device (train.main would refuse a 1-device mesh in this 8-device process); it raises on a failure.
    capfd.readouterr()
    train_here(run_dir, *BIG_STATE, devices=1)
    out = "".join(capfd.readouterr())
    assert f"resumed from step {max(complete)}" in out, out
    assert final_losses(run_dir) == final_losses(reference)


@pytest.fixture(scope="module")
def finished_8(tmp_path_factory, straight):
    """A run with checkpoints at steps 4 and 8, to be damaged in copies: the reference as it was
    after step 8 (the same program and data to step 8 as an 8-step run on the 12-step horizon,
    optim.decay_steps, so the same files; without running those 8 steps again): its checkpoint
    12, metrics past step 8 and summary removed."""
    run_dir = stopped_at(straight, tmp_path_factory.mktemp("damaged") / "run", 8)
    (run_dir / "summary.json").unlink()
    metrics = run_dir / "metrics.jsonl"
    metrics.write_text("".join(line for line in metrics.read_text().splitlines(keepends=True)
                               if json.loads(line)["step"] <= 8))
    assert steps_on_disk(run_dir) == [4, 8] and max(final_losses(run_dir)) == 8
    return run_dir


def _truncate(path: str) -> None:
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def _largest_file(folder) -> str:
    files = [os.path.join(d, f) for d, _, fs in os.walk(folder) for f in fs]
    return max(files, key=os.path.getsize)


DAMAGE = {
    "truncated array data": lambda step: _truncate(_largest_file(step / "state")),
    "missing files": lambda step: shutil.rmtree(step / "state"),
    "bad metadata": lambda step: (step / "state" / "_METADATA").write_text("{not json"),
}


# What the warning says each damage is: the innermost error of the failed read, on one line.
WHY = {
    "truncated array data": "(ValueError: OUT_OF_RANGE: Error reading ",
    "missing files": "(KeyError: Item \"state\" was not found in the checkpoint. Available items: ['data'])",
    "bad metadata": "(JSONDecodeError: Expecting property name enclosed in double quotes: line 1 column 2 (char 1))",
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damaged_newest_checkpoint_falls_back_to_the_previous(tmp_path, finished_8, uninterrupted, damage):
    run_dir = tmp_path / "run"
    shutil.copytree(finished_8, run_dir)
    DAMAGE[damage](run_dir / "checkpoints" / "8")
    code, out = run(*args(run_dir, "train.steps=12", "checkpoint.every=4"))
    assert code == 0, out
    (aside,) = os.listdir(run_dir / "checkpoints.damaged")  # kept aside, not deleted
    # One line, whole: what is wrong, where it went, what the run does instead; the library's own
    # tracebacks (hundreds of lines on a bigger state) are in run.dir/library.log, not the console.
    (warning,) = [line for line in out.splitlines() if "checkpoint" in line and "cannot be read" in line]
    assert warning.startswith(f"warning: checkpoint {run_dir / 'checkpoints' / '8'} cannot be read ("), warning
    assert warning.endswith(f"); moved to {run_dir / 'checkpoints.damaged' / aside}; resuming from step 4 instead "
                            f"(library messages: {run_dir / 'library.log'})"), warning
    assert WHY[damage] in warning, warning
    assert "Traceback" not in out and "Exception ignored" not in out, out
    assert "Traceback" in (run_dir / "library.log").read_text()
    assert "resumed from step 4" in out
    assert steps_on_disk(run_dir) == [8, 12]  # checkpoint.keep=2 in tiny.yaml
    losses = final_losses(run_dir)
    assert {s: losses[s] for s in range(5, 13)} == {s: uninterrupted[s] for s in range(5, 13)}


def test_no_readable_checkpoint_is_an_error_unless_asked_to_start_over(tmp_path, capfd, finished_8):
    run_dir = tmp_path / "run"
    shutil.copytree(finished_8, run_dir)
    for step in (4, 8):
        DAMAGE["truncated array data"](run_dir / "checkpoints" / str(step))
    before = sorted(os.listdir(run_dir / "checkpoints"))
    code, out = main_here(capfd, *args(run_dir, "train.steps=12", "checkpoint.every=4"))
    assert code == 2, out
    assert "error: no checkpoint in" in out and "checkpoint.fresh_if_unreadable=true" in out
    assert sorted(os.listdir(run_dir / "checkpoints")) == before
    code, out = main_here(capfd, *args(run_dir, "train.steps=12", "checkpoint.every=4", "checkpoint.fresh_if_unreadable=true"))
    assert code == 0 and "starting over" in out and "resumed from" not in out, out


def test_a_nan_batch_skips_its_update(tmp_path, capfd):
    import orbax.checkpoint as ocp

    code, out = main_here(capfd, *args(tmp_path, "train.steps=5", "debug.nan_steps=3", "checkpoint.every=1", "checkpoint.keep=10"))
    assert code == 0, out
    assert "warning: step 3 has a non-finite loss" in out
    records = {r["step"]: r for r in strict_records(tmp_path)}
    # Strict JSON: the skipped step's loss and gradient norm are null, and its `finite` flag 0.
    assert records[3]["loss"] is None and records[3]["grad_norm"] is None and records[3]["finite"] == 0
    assert records[2]["finite"] == 1 and records[4]["finite"] == 1
    # Had the NaN gradients been applied, every later loss would be NaN too.
    assert np.isfinite(records[4]["loss"]) and np.isfinite(records[5]["loss"])
    assert [records[s]["skipped_steps"] for s in range(1, 6)] == [0, 0, 1, 1, 1]
    assert steps_on_disk(tmp_path) == [1, 2, 4, 5], "no checkpoint is written inside a bad streak"
    adam_updates = {
        s: int(ocp.StandardCheckpointer().restore(tmp_path / "checkpoints" / str(s) / "state")["opt_state"][1][0]["count"])
        for s in (2, 4)
    }
    assert adam_updates == {2: 2, 4: 3}, "step 3 left the optimizer state as it was"


def strict_records(run_dir) -> list[dict]:
    """metrics.jsonl read by a strict JSON reader (one that refuses NaN and Infinity)."""

    def refuse(constant: str) -> None:
        raise ValueError(f"{constant} is not JSON")

    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line, parse_constant=refuse) for line in f]


def test_too_many_bad_steps_in_a_row_stop_the_run(tmp_path, capfd):
    code, out = main_here(capfd, *args(tmp_path, "train.steps=10", "debug.nan_steps=3,4,5", "train.max_bad_steps=3",
                          "checkpoint.every=1"))
    assert code == 3, out
    assert "error: 3 non-finite steps in a row (train.max_bad_steps=3), the last at step 5; " \
           "the last good checkpoint is step 2" in out
    assert max(steps_on_disk(tmp_path)) == 2
    assert "summary: step 5/10 (stopped: TooManyBadSteps)" in out, "the summary stops where the error does"


def test_too_many_bad_steps_before_any_checkpoint_say_there_is_none(tmp_path, capfd):
    code, out = main_here(capfd, *args(tmp_path, "train.steps=30", "debug.nan_steps=2,3,4", "train.max_bad_steps=3"))
    assert code == 3, out
    assert "error: 3 non-finite steps in a row (train.max_bad_steps=3), the last at step 4; " \
           "there is no checkpoint (rerunning starts over)" in out
    assert steps_on_disk(tmp_path) == []
    assert "summary: step 4/30 (stopped: TooManyBadSteps)" in out
    assert [r["loss"] is None for r in strict_records(tmp_path)] == [False, True, True, True]


# train.py whose first step never returns, as a step wedged in a collective or a driver would:
# the watchdog must fire however fast or slow the machine runs real steps.
HUNG_TRAIN = """
import sys, threading
import trainer.loop

def hung_step(state, batch):
    threading.Event().wait()

assert hasattr(trainer.loop, "instrument"), "the seam this test hangs the step through has moved"
trainer.loop.instrument = lambda step_fn, *args: hung_step
import train
sys.exit(train.main(sys.argv[1:]))
"""


def test_a_hung_step_dumps_stacks_and_exits(tmp_path):
    proc = subprocess.run([sys.executable, "-c", HUNG_TRAIN, *args(tmp_path, "train.step_timeout_s=1")],
                          cwd=ROOT, env=cpu_env(8), capture_output=True, text=True, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 4, out
    assert "error: step 1 has run" in out and "more than train.step_timeout_s=1; stacks of every thread follow" in out
    assert "Current thread" in out or "Thread 0x" in out, "every thread's stack is dumped"
    assert 'in hung_step' in out, "the dump shows where the step hangs"


def test_a_damaged_checkpoint_is_one_line_on_the_console(tmp_path):
    """The default model's state (3.2M parameters, truncated in its largest file): a failed read
    leaves the checkpoint library's tasks failing ("Event loop is closed", "Exception ignored in:
    <coroutine ...>"; hundreds on a quiet machine, as few as two when another test file runs
    beside it); they go to run.dir/library.log, and the console has one line. Any one of them on
    the console fails the test, so one kept in the log is enough to show the noisy path ran."""
    cmd = ["train.steps=2", "checkpoint.every=1", "train.global_batch=4", "model.seq_len=64", "eval.every=0",
           f"run.dir={tmp_path}", DATA]
    # The run that writes the checkpoints claims nothing about its process or console: in this
    # process (trainer.run, train.main's call) on one device, as the resume's process runs.
    trainer.run(load_config(None, cmd), jax.devices()[:1])
    assert steps_on_disk(tmp_path) == [1, 2]
    _truncate(_largest_file(tmp_path / "checkpoints" / "2" / "state"))
    code, out = run(*cmd[1:], "train.steps=3", devices=1)
    assert code == 0, out
    assert "Traceback" not in out and "Exception ignored" not in out, out
    (warning,) = [line for line in out.splitlines() if "cannot be read" in line]
    assert "; resuming from step 1 instead (library messages: " in warning, warning
    assert (tmp_path / "library.log").read_text().count("Traceback") >= 1, "the library's tracebacks are kept"

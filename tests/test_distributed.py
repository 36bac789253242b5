"""Several processes and elastic resume: 2 processes x 4 devices train exactly like 1 x 8 (also
with the pipeline stages on different processes, and with document packing), a checkpoint
moves from 8 devices to 4 with the data continuing at the next example, a job holds its
run.dir's lock once and a second job is refused, a dead peer is detected within 60 s, and
processes that disagree on the config refuse to start."""

from __future__ import annotations

import functools
import json
import os
import socket
import subprocess
import sys
import time
from typing import Callable

import jax
import numpy as np
import pytest

import trainer
from configs import load_config
from conftest import ROOT, stdlib_glob
from bench.procs import TINY
from bench.procs import two_processes as start_two

DATA = f"data.path={stdlib_glob('json')}"
LAYOUT = ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"]
# The learning-rate horizon of tests/test_faults.py's runs (the schedule is a constant of the
# compiled step): the one-process runs here on their layouts run their programs.
HORIZON = "optim.decay_steps=12"


def cfg(run_dir, *overrides: str):
    return load_config(TINY, [f"run.dir={run_dir}", DATA, "train.log_every=1", *overrides])


def two_processes(run_dir, *extra: str, **kw) -> list:
    return start_two("--config", TINY, f"run.dir={run_dir}", DATA, "train.log_every=1", *extra, **kw)


def metrics(run_dir) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def moving(losses: list[float]) -> list[float]:
    """The losses, once seen to change at every step (equal curves that stay flat prove nothing)."""
    assert all(a != b for a, b in zip(losses, losses[1:])), losses
    return losses


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> Callable[[], list[dict]]:
    """The 1 x 8 reference run (LAYOUT, HORIZON, 3 steps), made at the first call and shared: a
    test calls it after starting its processes, so it runs while they import, meet and compile."""
    return functools.cache(lambda: trainer.run(cfg(tmp_path_factory.mktemp("one"), *LAYOUT, HORIZON, "train.steps=3")))


def test_two_processes_train_like_one(tmp_path, one_process):
    # The one-process resume below, on test_faults' layout and horizon, runs their program.
    procs = two_processes(tmp_path / "two", *LAYOUT, HORIZON, "train.steps=3")
    reference = one_process()
    codes = [p.finish(180) for p in procs]
    assert codes == [0, 0], procs[0].output + procs[1].output
    records = metrics(tmp_path / "two")
    assert [r["step"] for r in records] == [1, 2, 3], "only process 0 writes metrics"
    assert "step 1/3" in procs[0].output and "step 1/3" not in procs[1].output, "only process 0 logs"
    # gloo's line per device as it connects (sharding/gloo_lines.py), not the run's own lines
    assert not [line for p in procs for line in p.output.splitlines() if "[Gloo]" in line or "peer ranks" in line]
    np.testing.assert_allclose(moving([r["loss"] for r in records]), [r["loss"] for r in reference], rtol=2e-5)
    assert sorted(os.listdir(tmp_path / "two" / "checkpoints")) == ["3"], "written collectively, once"
    # The two-process checkpoint resumes in one process with another layout.
    resumed = trainer.run(cfg(tmp_path / "two", "mesh.data=8", "train.steps=5"))
    assert [r["step"] for r in resumed] == [4, 5]


@pytest.mark.parametrize("layout, own_reference", [
    # pipeline is the outermost mesh axis and each process's devices are consecutive: one stage per
    # process. Against the shared 1 x 8 run without a pipeline (the pipelined step computes the
    # plain scan's losses: tests/test_pipeline.py), not a pipelined one-process run of its own.
    pytest.param(["mesh.pipeline=2", "mesh.data=2", "mesh.tensor=2", HORIZON], False, id="pipeline-across-processes"),
    # The settings of tests/test_data_run.py's document-packing runs: the reference here is their
    # program, compiled once in the suite (the shared compilation cache).
    pytest.param([*LAYOUT, "data.packing=document", "optim.schedule=constant", "optim.warmup_steps=0"], True,
                 id="document-packing"),
])
def test_two_processes_train_like_one_with(tmp_path, one_process, layout, own_reference):
    procs = two_processes(tmp_path / "two", *layout, "train.steps=3")  # started first: see one_process
    reference = trainer.run(cfg(tmp_path / "one", *layout, "train.steps=3")) if own_reference else one_process()
    codes = [p.finish(180) for p in procs]
    assert codes == [0, 0], procs[0].output + procs[1].output
    assert "2 process(es)" in procs[0].output
    records = metrics(tmp_path / "two")
    assert [r["step"] for r in records] == [1, 2, 3]
    np.testing.assert_allclose(moving([r["loss"] for r in records]), [r["loss"] for r in reference], rtol=2e-5)


def test_elastic_resume_from_8_devices_to_4(tmp_path, capsys):
    common = ["optim.schedule=constant", "optim.warmup_steps=0", "checkpoint.every=2"]
    straight = trainer.run(cfg(tmp_path / "straight", "mesh.data=1", "mesh.fsdp=8", "train.steps=4", *common))
    moved = tmp_path / "moved"
    trainer.run(cfg(moved, "mesh.data=1", "mesh.fsdp=8", "train.steps=2", *common))
    four = jax.devices()[:4]
    resumed = trainer.run(cfg(moved, "mesh.data=2", "mesh.tensor=2", "train.steps=4", *common), devices=four)
    out = capsys.readouterr().out
    assert "resumed from step 2" in out and "on 4 cpu devices" in out
    np.testing.assert_allclose(moving([r["loss"] for r in resumed]), [r["loss"] for r in straight[2:]], rtol=2e-5)


def test_a_second_job_is_refused_and_a_killed_peer_stops_the_others_within_60_s(tmp_path):
    """One 2-process job holds run.dir's lock once (process 0); a second 2-process job on that
    run.dir exits 2 in both processes, naming the holder; then a killed peer stops the first."""
    # The layout and learning-rate horizon of test_two_processes_train_like_one: its compiled
    # program, served by the shared cache, where a program of its own would be compiled here.
    procs = two_processes(tmp_path, *LAYOUT, HORIZON, "train.steps=100000", "checkpoint.every=100000",
                          heartbeat=5)
    # The second job starts as soon as the lock is held (while the first compiles), not after
    # steps whose work is no part of the claim.
    holder = wait_for_lock(tmp_path, procs[0])
    assert [f for f in os.listdir(tmp_path) if f.startswith("lock")] == ["lock.json"]
    assert holder == procs[0].proc.pid, "held by process 0 for the job"
    second = two_processes(tmp_path, "train.steps=100000", "checkpoint.every=100000")
    assert [p.finish(120) for p in second] == [2, 2], second[0].output + second[1].output
    for p in second:
        assert f"error: run.dir={tmp_path} is in use by a live run: host {socket.gethostname()}, pid " \
               f"{procs[0].proc.pid}, since " in p.output, p.output
        assert "compiled" not in p.output
    assert procs[0].proc.poll() is None and procs[1].proc.poll() is None, "the holder runs on"
    # The peer dies while the job trains: its first step is logged, its second under way (more
    # steps before the kill are no part of the claim).
    procs[0].wait_for(r"^step +1/", timeout=120)
    procs[1].kill()
    t0 = time.monotonic()
    code = procs[0].finish(90)
    elapsed = time.monotonic() - t0
    print(f"survivor exited {code} {elapsed:.1f} s after the kill")
    assert code != 0 and elapsed < 60, (code, elapsed)
    out = procs[0].output
    # Three ways the survivor learns of it: the coordination service's heartbeat check, its
    # "another task died" broadcast, or (first, under load) the step's own CPU collective, whose
    # gloo transport aborts the process when the dead peer's connection breaks mid-message.
    peer_gone = ("stopped sending heartbeats", "another task died", "[enforce fail at external/gloo/gloo/transport")
    assert any(reason in out for reason in peer_gone), out[-2000:]


# Processes 0 and 1 of a job, each with the stack's Watchdog (heartbeats every 0.1 s, a peer dead
# after 2 s still), meet; process 1 ends its run (saying so, or not: `announce`) and exits, as a
# peer that has committed its last save does, while process 0 goes on 4 s more (saving its own).
FINISHED_PEER = """
import sys, time
import jax
pid, port, announce = int(sys.argv[1]), sys.argv[2], sys.argv[3] == "announce"
jax.distributed.initialize(f"127.0.0.1:{port}", 2, pid, heartbeat_timeout_seconds=30, shutdown_timeout_seconds=60)
from jax._src import distributed
from ops.faults import Watchdog
watchdog, client = Watchdog(0, peer_timeout_s=2, poll_s=0.1), distributed.global_state.client
client.key_value_set(f"up/{pid}", "1")
client.blocking_key_value_get(f"up/{1 - pid}", 60_000)
time.sleep(0.5 if pid else 4.5)
if announce or pid == 0:
    watchdog.finished()
watchdog.close()
print(f"process {pid} ended its run", flush=True)
"""


@pytest.mark.parametrize("announce", ["announce", "silent"])
def test_a_peer_that_ended_its_run_first_is_not_taken_for_a_dead_one(announce):
    """The processes of a job end their last step together, but one can commit its save and exit
    while another still saves; the first then waits in jax.distributed's shutdown barrier. The
    other must exit 0, not stop as if its peer had crashed, nor block its watchdog in the
    coordination service's liveness query, which waits for every live peer to ask too. A peer
    that ends its run says so (`Watchdog.finished`); one that stops beating without saying so is
    dead, and the survivor says which and exits 5."""
    import subprocess
    import sys

    from bench.procs import ROOT, cpu_env, free_port

    port, env = str(free_port()), cpu_env(1)
    procs = [subprocess.Popen([sys.executable, "-c", FINISHED_PEER, str(i), port, announce], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    codes = [p.returncode for p in procs]
    if announce == "announce":
        assert codes == [0, 0], outs
        assert all(f"process {i} ended its run" in out for i, out in enumerate(outs)), outs
    else:
        assert codes[0] == 5 and "process(es) [1] of 2 stopped sending heartbeats" in outs[0], (codes, outs)
        assert "process 0 ended its run" not in outs[0], outs


def wait_for_lock(run_dir, proc, timeout: float = 120) -> int:
    """The pid in run_dir/lock.json once it is there and whole (it is written in place)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.proc.poll() is None:
        try:
            with open(run_dir / "lock.json") as f:
                return json.load(f)["pid"]
        except (FileNotFoundError, json.JSONDecodeError, KeyError):
            time.sleep(0.05)
    raise AssertionError(f"no lock.json in {run_dir}; output:\n{proc.output[-3000:]}")


def test_processes_with_different_configs_refuse_to_start(tmp_path):
    procs = two_processes(tmp_path, "train.steps=4", per_process=(["optim.lr=0.001"], ["optim.lr=0.002"]))
    codes = [p.finish(120) for p in procs]
    assert codes == [2, 2], procs[0].output + procs[1].output
    for p in procs:
        assert "error: processes disagree on optim.lr: " in p.output
    assert not os.path.exists(tmp_path / "checkpoints")


def test_gloo_lines_leave_stdout_and_everything_else_stays_in_order():
    """A process writes to its file descriptor 1 as gloo's C++ does (its threads' text interleaved)
    among its own lines, part-lines and a NOT-connected line, then exits by a signal: only gloo's
    connection lines are gone."""
    gloo = b"[Gloo] Rank 2 is connected to 7 peer ranks. Expected number of connected peer ranks is : 7\n"
    mangled = (b"[Gloo] Rank [Gloo] Rank 3 is connected to 71 peer ranks. Expected number of connected peer ranks "
               b"is : 7\n is connected to 7 peer ranks. Expected number of connected peer ranks is : 7\n1 peer ranks. \n"
               b"7\n\n")
    lost = b"[Gloo] Rank 1 is NOT connected to: [0]\n"
    writes = [b"compiled\n", gloo, b"step 1", b"/2 | loss 5.4\n", mangled, b"[Gloo] Rank 0 is conn",
              b"ected to 7 peer ranks. Expected number of connected peer ranks is : 7\n", lost, b"done"]
    # Lines of numbers alone are gloo's only amid its lines: a run's own, a second later, stays.
    writes += [b"sleep", b"4\n"]
    script = ("import os, signal, sys, time\n"
              "from configs import guarded\n"
              "from sharding.gloo_lines import drop_gloo_lines\n"
              "def main():\n"
              "    drop_gloo_lines()\n"
              f"    for w in {writes!r}:\n"
              "        time.sleep(1.2 if w == b'sleep' else 0.01)\n"
              "        os.write(1, w) if w != b'sleep' else None\n"
              "    print(' and printed', flush=True)\n"
              "    os.kill(os.getpid(), signal.SIGTERM)\n"
              "    time.sleep(30)\n"
              "guarded(main, 'nothing')\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, timeout=60)
    assert done.returncode == 143, done.stderr
    assert done.stdout == b"compiled\nstep 1/2 | loss 5.4\n" + lost + b"done4\n and printed\n", done.stdout
    assert done.stderr.decode().splitlines()[-1] == "interrupted by SIGTERM: nothing", done.stderr

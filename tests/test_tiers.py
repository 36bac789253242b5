"""The local checkpoint tier (trainer/tiers.py) for real: real train.py processes on fake CPU
devices are killed, a host's local directory removed as a replaced host's would be, and the job
started again; restores across tiers and bad values of the tier's keys."""

from __future__ import annotations

import json
import os
import re
import shutil
import time

import jax
import pytest

import trainer
from bench.procs import TINY, processes
from configs import ConfigError, load_config
from conftest import stdlib_glob
from ops.goodput import describe
from ops.stragglers import SLOW_ENV
from trainer.tiers import POSITION_BYTES, layout_tag, local_root, position_array, process_dir, read_position

DATA = f"data.path={stdlib_glob('json')}"


def args(run_dir, local_dir, *extra: str) -> list[str]:
    return ["--config", TINY, f"run.dir={run_dir}", DATA, "train.log_every=1", "optim.decay_steps=12",
            f"checkpoint.local_dir={local_dir}", "checkpoint.every=4", "checkpoint.local_every=3", *extra]


def records(run_dir) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if '"loss"' in line]


def wait_for_dirs(paths: list[str], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not all(os.path.isdir(p) for p in paths):
        assert time.monotonic() < deadline, f"never saw all of {paths}"
        time.sleep(0.01)


def test_a_replaced_host_resumes_from_the_peers_local_step(tmp_path):
    """2 processes x 2 devices, persistent every 4 steps, local every 3: killed after step 10, the
    job restarts from the local step 9 (process 1's copy gone with its host, fetched from its peer,
    process 0), not the persistent step 8, and computes step 10 again bit for bit. Process 1 of the
    first job is slowed (ops.stragglers) and named within K=3 steps; process 0 is never named, in
    either job. Two processes are enough for each claim: a peer to fetch from, another process to
    be named against (a process start is seconds of CPU time); 2 devices each, not 4, as no claim
    is about devices (a multi-process step costs CPU time per device)."""
    n = 2
    run_dir, local_dir = tmp_path / "run", tmp_path / "local"
    cmd = args(run_dir, local_dir, "train.steps=12", "straggler.steps=3")
    cfg = load_config(TINY, cmd[2:])
    job = processes(n, *cmd, heartbeat=5, env={1: {SLOW_ENV: "0.3"}}, devices=2)
    job[0].wait_for(r"^step +10/12", timeout=240)
    layout = layout_tag({"data": 4}, n)
    wait_for_dirs([os.path.join(process_dir(cfg, layout, i), "9") for i in range(n)])
    job[1].kill()  # the host is gone, its disk with it
    shutil.rmtree(process_dir(cfg, layout, 1))
    for p in job:  # the scheduler restarts the whole job
        p.kill()
    before = {r["step"]: r for r in records(run_dir)}
    persistent = sorted(int(d) for d in os.listdir(run_dir / "checkpoints") if d.isdigit())
    assert 10 in before and max(persistent) == 8, (sorted(before), persistent)
    again = processes(n, *cmd, heartbeat=5, devices=2)
    codes = [p.finish(240) for p in again]
    out = again[0].output
    assert codes == [0] * n, out + again[1].output
    assert ("restoring from the local tier: step 9 (process(es) [1] fetched their shards from peers); "
            "the persistent tier's newest is step 8") in out, out
    assert "resumed from step 9" in out
    assert "no other process holds a copy" not in out, "mesh.data=4 spans the processes: each has a peer"
    after = records(run_dir)
    redone = [r["loss"] for r in after if r["step"] == 10]
    assert len(redone) == 2 and redone[0] == redone[1] == before[10]["loss"], "step 10 again, bit for bit"
    assert sorted({r["step"] for r in after}) == list(range(1, 13))
    tiers = json.loads((run_dir / "summary.json").read_text())["restarts_by_tier"]
    # Step 10, and step 11 where the first job got that far before the kill (a loaded host).
    assert list(tiers) == ["local"] and tiers["local"]["recomputed_steps"] == max(before) - 9, (tiers, sorted(before))
    named = [(i, line) for i, line in enumerate(job[0].lines) if line.startswith("straggler:")]
    assert all("straggler" not in p.output for p in [*job[1:], *again]), "with no slow process nothing is named"
    (i, line), = named
    assert re.match(r"straggler: process 1 \(host [^)]+\) spent 0\.[34]\d\d s per step on its own over the last 3 "
                    r"steps, [\d.]+x the others' median 0\.\d+ s; every process waits for it", line), line
    # Within K steps of the first timed one, plus the watchdog's 1 s poll (about three steps here).
    logged = [int(m.group(1)) for row in job[0].lines[:i] if (m := re.match(r"^step +(\d+)/", row))]
    assert max(logged) <= 2 + 3 + 3, logged
    assert all(before[s]["own_s/p1"] > 0.25 > before[s]["own_s/p0"] for s in (7, 8, 9))


@pytest.fixture(scope="module")
def ran_9(tmp_path_factory):
    """One process, 8 devices: 9 steps, persistent at 4 and 8 (and 9, the last), local at 3 and 6."""
    root = tmp_path_factory.mktemp("tiers")
    run_dir, local_dir = root / "run", root / "local"
    cmd = args(run_dir, local_dir, "train.steps=9", "checkpoint.keep=3")
    history = trainer.run(load_config(TINY, cmd[2:]))
    return run_dir, local_dir, {r["step"]: r["loss"] for r in history}


def test_the_summary_counts_each_tiers_saves_and_their_blocking_time(ran_9):
    """Local every 3, persistent every 4 and at the end, of 9 steps: local saves at 3 and 6,
    persistent ones at 4, 8 and 9; each tier's blocking seconds are its own."""
    run_dir = ran_9[0]
    summary = json.loads((run_dir / "summary.json").read_text())
    saves = summary["invocations"][-1]["saves"]
    assert {t: r["count"] for t, r in saves.items()} == {"local": 2, "persistent": 3}, saves
    checkpoint_s = summary["invocations"][-1]["seconds"]["checkpoint"]
    assert 0 < saves["local"]["blocking_s"] and 0 < saves["persistent"]["blocking_s"], saves
    assert saves["local"]["blocking_s"] + saves["persistent"]["blocking_s"] <= checkpoint_s, (saves, checkpoint_s)
    line, = [s for s in describe(summary) if s.startswith("saves:")]
    assert re.fullmatch(r"saves: local 2x, \d+ ms blocking each; persistent 3x, \d+ ms blocking each", line), line


def test_a_newer_persistent_step_wins_over_an_older_local_one(tmp_path, ran_9, capsys):
    run_dir, local_dir, reference = ran_9
    copy_run, copy_local = tmp_path / "run", tmp_path / "local"
    shutil.copytree(run_dir, copy_run)
    shutil.rmtree(copy_run / "checkpoints" / "9")
    cmd = args(copy_run, copy_local, "train.steps=9")
    cfg = load_config(TINY, cmd[2:])
    shutil.copytree(local_root(load_config(TINY, args(run_dir, local_dir)[2:])), local_root(cfg))
    capsys.readouterr()
    history = trainer.run(cfg)
    out = capsys.readouterr().out
    assert "restoring from the local tier" not in out, "the persistent step 8 is newer than the local step 6"
    assert "restoring from the persistent tier: step 8" in out and "resumed from step 8" in out, out
    assert {r["step"]: r["loss"] for r in history} == {9: reference[9]}


def test_another_layout_never_reads_the_local_tier(tmp_path, ran_9, capsys):
    """A local step holds one layout's shards: 4 devices instead of 8 take the persistent tier,
    even though the local step 6 is newer than the persistent step 4 left."""
    run_dir, local_dir, reference = ran_9
    copy_run, copy_local = tmp_path / "run", tmp_path / "local"
    shutil.copytree(run_dir, copy_run)
    for step in ("8", "9"):
        shutil.rmtree(copy_run / "checkpoints" / step)
    cfg = load_config(TINY, args(copy_run, copy_local, "train.steps=9", "mesh.data=4")[2:])
    shutil.copytree(local_root(load_config(TINY, args(run_dir, local_dir)[2:])), local_root(cfg))
    capsys.readouterr()
    trainer.run(cfg, jax.devices()[:4])
    out = capsys.readouterr().out
    assert "restoring from the persistent tier: step 4" in out and "resumed from step 4" in out, out
    assert sorted(os.listdir(local_root(cfg))) == ["data4-1p", "data8-1p"]


def test_without_any_local_copy_the_run_resumes_from_the_persistent_tier(tmp_path, ran_9, capsys):
    run_dir, local_dir, reference = ran_9
    copy_run, copy_local = tmp_path / "run", tmp_path / "local"
    shutil.copytree(run_dir, copy_run)
    for step in ("8", "9"):
        shutil.rmtree(copy_run / "checkpoints" / step)
    cmd = args(copy_run, copy_local, "train.steps=9")
    cfg = load_config(TINY, cmd[2:])
    shutil.copytree(local_root(load_config(TINY, args(run_dir, local_dir)[2:])), local_root(cfg))
    # The local step 6 is newer than the persistent step 4: it is the one restored.
    history = trainer.run(cfg)
    out = capsys.readouterr().out
    assert ("restoring from the local tier: step 6 (every process from its own disk); the persistent tier's "
            "newest is step 4") in out, out
    assert "resumed from step 6" in out
    assert {r["step"]: r["loss"] for r in history} == {s: reference[s] for s in (7, 8, 9)}
    summary = json.loads((copy_run / "summary.json").read_text())
    assert summary["invocations"][-1]["restored_from"] == "local"
    local = summary["restarts_by_tier"]["local"]
    assert local["restarts"] == 1 and local["recomputed_steps"] == 3 and local["restart_s"] > 0, summary
    assert re.search(r"restarts: from the local tier 1x, [\d.]+ s lost \(3 steps recomputed\)$", out, re.M), out
    # Every local copy gone (and a half-written one left): the persistent tier.
    shutil.rmtree(copy_run)
    shutil.copytree(run_dir, copy_run)
    for step in ("8", "9"):
        shutil.rmtree(copy_run / "checkpoints" / step)
    shutil.rmtree(local_root(cfg))
    half = os.path.join(process_dir(cfg, layout_tag({"data": 8}, 1), 0), "7.orbax-checkpoint-tmp-123")
    os.makedirs(os.path.join(half, "state"))
    history = trainer.run(cfg)
    out = capsys.readouterr().out
    assert out.count("half-written") == 1 and f"warning: skipped a half-written local checkpoint {half}" in out, out
    assert "restoring from the persistent tier: step 4" in out and "resumed from step 4" in out, out
    assert {r["step"]: r["loss"] for r in history} == {s: reference[s] for s in range(5, 10)}
    tiers = json.loads((copy_run / "summary.json").read_text())["restarts_by_tier"]
    assert list(tiers) == ["persistent"] and tiers["persistent"]["recomputed_steps"] == 5, tiers


def test_a_run_held_by_the_local_tier_alone_is_a_resume(tmp_path, ran_9, capsys):
    """Every persistent checkpoint gone (a pod's first minutes, before the first persistent save):
    the local tier's steps 3 and 6 alone make the run a resume. A changed key that fixes the state
    is refused with one line naming the key and the tier, nothing written; init.from_hf, which a
    resume does not read, is neither checked nor imported; the unchanged config resumes from step 6
    and computes steps 7 to 9 bit for bit."""
    run_dir, local_dir, reference = ran_9
    copy_run, copy_local = tmp_path / "run", tmp_path / "local"
    shutil.copytree(run_dir, copy_run)
    shutil.rmtree(copy_run / "checkpoints")
    cfg = load_config(TINY, args(copy_run, copy_local, "train.steps=9")[2:])
    shutil.copytree(local_root(load_config(TINY, args(run_dir, local_dir)[2:])), local_root(cfg))
    step_dir = process_dir(cfg, layout_tag({"data": 8}, 1), 0)
    config_text = (copy_run / "config.yaml").read_text()
    changed = load_config(TINY, args(copy_run, copy_local, "train.steps=9", "model.d_ff=512")[2:])
    with pytest.raises(ConfigError) as refused:
        trainer.run(changed)
    assert str(refused.value) == (f"model.d_ff=512 differs from {cfg.model.d_ff} in the checkpoints of run.dir={copy_run} "
                                  "(the local tier's step(s) 3, 6, checkpoint.local_dir); resume with the same value "
                                  "or use a new run.dir"), refused.value
    assert (copy_run / "config.yaml").read_text() == config_text and sorted(os.listdir(step_dir)) == ["3", "6"]
    capsys.readouterr()
    history = trainer.run(load_config(TINY, args(copy_run, copy_local, "train.steps=9",
                                                 f"init.from_hf={tmp_path / 'gone'}")[2:]))
    out = capsys.readouterr().out
    assert "resumed from step 6" in out and "init.from_hf" not in out, out
    assert {r["step"]: r["loss"] for r in history} == {s: reference[s] for s in (7, 8, 9)}


@pytest.mark.parametrize("damage", ["arrays", "state"])
def test_an_unreadable_local_step_is_computed_and_saved_again(tmp_path, ran_9, capsys, caplog, damage):
    """The local step 6 is newer than the persistent step 4 left but cannot be read: its arrays gone
    (the restore fails; the step is removed once the run resumes from the persistent tier) or its
    whole state (no process's data: removed at start, before Orbax's manager would stop on it).
    Each removal is one line; the run saves step 6 again when it gets there, and the losses are the
    uninterrupted run's."""
    run_dir, local_dir, reference = ran_9
    copy_run, copy_local = tmp_path / "run", tmp_path / "local"
    shutil.copytree(run_dir, copy_run)
    for step in ("8", "9"):
        shutil.rmtree(copy_run / "checkpoints" / step)
    cfg = load_config(TINY, args(copy_run, copy_local, "train.steps=9")[2:])
    shutil.copytree(local_root(load_config(TINY, args(run_dir, local_dir)[2:])), local_root(cfg))
    step_6 = os.path.join(process_dir(cfg, layout_tag({"data": 8}, 1), 0), "6")
    shutil.rmtree(os.path.join(step_6, "state", "d") if damage == "arrays" else os.path.join(step_6, "state"))
    capsys.readouterr()
    history = trainer.run(cfg)
    out = capsys.readouterr().out
    if damage == "arrays":
        assert re.search(r"warning: local checkpoint step 6 cannot be restored on every process \(NOT_FOUND: Error "
                         r"opening .{100,200}\); using the persistent tier", out), out
        assert not [r for r in caplog.records if "Local/P2P restore" in r.getMessage()], "Orbax's traceback: dropped"
        assert (f"warning: removed local checkpoint step(s) 6 of {os.path.dirname(step_6)}: the run resumes from "
                "step 4 and computes them again") in out, out
    else:
        assert (f"warning: skipped an unreadable local checkpoint {step_6} (no process's state in it; removed)"
                in out), out
        assert "removed local checkpoint" not in out and "cannot be restored" not in out, out
    assert "restoring from the persistent tier: step 4" in out and "resumed from step 4" in out, out
    assert {r["step"]: r["loss"] for r in history} == {s: reference[s] for s in range(5, 10)}
    assert os.path.isdir(os.path.join(step_6, "state", "d")), "step 6 saved again"


@pytest.mark.parametrize("extra, message", [
    (["checkpoint.local_every=3"], "checkpoint.local_dir: empty, but checkpoint.local_every=3 asks for a local tier"),
    (["checkpoint.local_dir=/tmp/x"], "checkpoint.local_every: 0, but checkpoint.local_dir=/tmp/x asks for a local tier"),
    (["checkpoint.local_dir=/tmp/x", "checkpoint.local_every=4", "checkpoint.every=4"],
     "checkpoint.local_every: 4 is not below checkpoint.every=4"),
])
def test_bad_tier_keys_are_one_line(extra, message):
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        load_config(TINY, extra)


def test_an_unwritable_local_dir_exits_2_before_compiling(tmp_path, capfd):
    import train

    not_a_dir = tmp_path / "a-file"  # unwritable whoever runs the test (root writes anywhere else)
    not_a_dir.write_text("")
    code = train.main(["--config", TINY, f"run.dir={tmp_path / 'run'}", DATA, "checkpoint.every=4",
                       "checkpoint.local_every=2", f"checkpoint.local_dir={not_a_dir / 'local'}"])
    out = "".join(capfd.readouterr())
    assert code == 2, out
    assert out.strip() == f"error: checkpoint.local_dir={not_a_dir / 'local'}: {not_a_dir} is not a writable directory", out
    assert not os.path.exists(tmp_path / "run")


def test_the_data_position_rides_in_a_replicated_array():
    """A Grain position (here a multi-worker one, the largest kind) survives position_array and
    read_position exactly, replicated on the mesh; one too large for the array is refused."""
    mesh = jax.sharding.Mesh(jax.devices()[:2], ("data",))
    position = {"next_index_in_cycle": 5, "iterators_in_use_indices": list(range(16)),
                "iterators_in_use_states": [{"next_index": 3 + i % 2} for i in range(16)]}
    array = position_array(position, mesh)
    assert array.shape == (POSITION_BYTES,) and array.sharding.is_fully_replicated
    assert read_position(array) == position
    with pytest.raises(ValueError, match="data iterator's state takes"):
        position_array({"states": ["x" * 64] * (POSITION_BYTES // 64)}, mesh)

"""Experiment trackers (ops/trackers.py), with no network: a run and its resume log into
one W&B run (offline mode) and one MLflow run (a file store), and what each stored, read back,
equals metrics.jsonl, the config and summary.json."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import jax
import pytest

import trainer
from configs import ConfigError, load_config
from conftest import ROOT, require, stdlib_glob
from ops import trackers
from trainer.spec import prepare

require("wandb", "trackers", lazy=True)
require("mlflow", "trackers", lazy=True)


def _wandb_records(path: str) -> list:
    """The protobuf records of a W&B offline run file: a 7-byte header (":W&B", magic, version),
    then a LevelDB log (32 KiB blocks of chunks: crc32, length, type 1 full / 2 first / 3 middle /
    4 last). wandb ships no reader for it."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, records, part = open(path, "rb").read(), 7, [], b""
    while pos + 7 <= len(data):
        block_left = 32768 - pos % 32768
        if block_left < 7:  # a block's tail too short for a header is padding
            pos += block_left
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        if kind == 0 and length == 0:
            break
        part += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(part)
            records.append(record)
            part = b""
    return records


@pytest.fixture(scope="module")
def tracked_run(tmp_path_factory):
    """4 steps, then a resume to 8, with all three trackers."""
    mp = pytest.MonkeyPatch()
    mp.setenv("WANDB_MODE", "offline")
    mp.setenv("WANDB_SILENT", "true")
    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "WANDB_PROJECT"):
        mp.delenv(name, raising=False)
    run_dir = tmp_path_factory.mktemp("tracked")
    for steps in (4, 8):
        cfg = load_config("tiny", [f"run.dir={run_dir}", f"data.path={stdlib_glob('json')}", "train.log_every=1",
                                   f"train.steps={steps}", "mesh.data=1", "checkpoint.every=4",
                                   "run.trackers=[tensorboard,wandb,mlflow]"])
        trainer.run(cfg, devices=jax.devices()[:1])
    mp.undo()
    metrics = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    return run_dir, {r["step"]: r["loss"] for r in metrics}, json.load(open(run_dir / "summary.json"))


def test_mlflow_holds_every_loss_the_config_and_the_summary(tracked_run):
    from mlflow.tracking import MlflowClient

    run_dir, losses, summary = tracked_run
    run_id = json.load(open(run_dir / trackers.IDS_FILE))["mlflow"]
    client = MlflowClient("file:" + str(run_dir / "mlruns"))
    (experiment,) = [e for e in client.search_experiments() if e.name == "meshlm"]
    assert [r.info.run_id for r in client.search_runs([experiment.experiment_id])] == [run_id]  # one run, resumed
    history = {m.step: m.value for m in client.get_metric_history(run_id, "loss")}
    assert history == pytest.approx(losses, rel=1e-6) and sorted(history) == list(range(1, 9))
    run = client.get_run(run_id)
    assert run.data.params["model.d_model"] == "64" and run.data.params["train.steps"] == "4"  # the first start's
    assert run.info.status == "FINISHED"
    names = {a.path for a in client.list_artifacts(run_id)}
    assert names == {"config.step0.yaml", "config.step4.yaml", "summary.json"}
    stored = json.load(open(client.download_artifacts(run_id, "summary.json", str(run_dir / "dl"))))
    assert stored == summary
    assert load_config(client.download_artifacts(run_id, "config.step4.yaml", str(run_dir / "dl"))).train.steps == 8


def test_wandb_holds_every_loss_the_config_and_the_summary(tracked_run):
    run_dir, losses, summary = tracked_run
    run_id = json.load(open(run_dir / trackers.IDS_FILE))["wandb"]
    files = sorted(glob.glob(str(run_dir / "wandb" / "offline-run-*" / "run-*.wandb")))
    assert len(files) == 2 and all(f.endswith(f"run-{run_id}.wandb") for f in files)  # both invocations, one id
    history, config, final = {}, {}, {}

    def items(entries: list) -> dict:
        return {e.key or "/".join(e.nested_key): json.loads(e.value_json) for e in entries}

    for f in files:
        for record in _wandb_records(f):
            kind = record.WhichOneof("record_type")
            if kind == "history":
                values = items(record.history.item)
                if "loss" in values:
                    history[values["_step"]] = values["loss"]
            elif kind == "run":  # the config travels with the run record
                config.update(items(record.run.config.update))
            elif kind == "summary":
                final.update(items(record.summary.update))
    assert history == pytest.approx(losses, rel=1e-6) and sorted(history) == list(range(1, 9))
    assert config["model"]["d_model"] == 64
    assert final["final_step"] == summary["final_step"] == 8 and final["final_loss"] == pytest.approx(summary["final_loss"])


def test_a_tracker_that_is_not_installed_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    monkeypatch.setitem(trackers.EXTRA, "wandb", "wandb_is_not_installed")
    cfg = load_config("tiny", [f"run.dir={tmp_path / 'run'}", f"data.path={stdlib_glob('json')}",
                               "run.trackers=[wandb]"])
    with pytest.raises(ConfigError, match=r"run.trackers: wandb is not installed \(pip install 'meshlm\[trackers\]'\)"):
        prepare(cfg, 8)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("tracker, variable, value", [
    ("wandb", "WANDB_DIR", "/proc/wandb"), ("mlflow", "MLFLOW_TRACKING_URI", "file:/proc/mlruns"),
    ("mlflow", "MLFLOW_TRACKING_URI", "/proc/mlruns")])
def test_an_unwritable_tracker_folder_is_one_line_before_anything_is_written(tmp_path, monkeypatch, tracker, variable,
                                                                            value):
    """A tracker's folder outside run.dir (the user's WANDB_DIR, an MLflow file store) that cannot
    be written: one line naming the variable and the path, nothing created."""
    monkeypatch.setenv(variable, value)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    cfg = load_config("tiny", [f"run.dir={tmp_path / 'run'}", f"data.path={stdlib_glob('json')}",
                               f"run.trackers=[{tracker}]"])
    with pytest.raises(ConfigError, match=rf"^{variable} \(run.trackers: {tracker}\)=/proc/\w+: /proc is not a "
                                          "writable directory"):
        prepare(cfg, 8)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("uri", ["file:{tmp}/store", "{tmp}/store"])
def test_an_mlflow_file_store_without_the_opt_in_is_refused_in_one_line(tmp_path, monkeypatch, uri):
    """MLflow 3 refuses a file store unless MLFLOW_ALLOW_FILE_STORE is true: one line naming the
    store and what to do, before anything is written or compiled."""
    uri = uri.format(tmp=tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    cfg = load_config("tiny", [f"run.dir={tmp_path / 'run'}", f"data.path={stdlib_glob('json')}",
                               "run.trackers=[mlflow]"])
    with pytest.raises(ConfigError) as err:
        prepare(cfg, 8)
    assert str(err.value) == (f"run.trackers: mlflow refuses the file store at {uri}; set MLFLOW_ALLOW_FILE_STORE=true "
                              "or MLFLOW_TRACKING_URI to a server")
    assert not (tmp_path / "run").exists() and not (tmp_path / "store").exists()
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    trackers.check_trackers(cfg)  # the opt-in given: accepted
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://localhost:5000")
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE")
    trackers.check_trackers(cfg)  # a server: no file store to refuse
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    trackers.check_trackers(cfg)  # the default store beside the run opts in itself
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "false")  # ... unless the user said otherwise
    with pytest.raises(ConfigError, match=f"at file:{tmp_path / 'run' / 'mlruns'}; set MLFLOW_ALLOW_FILE_STORE"):
        trackers.check_trackers(cfg)


def test_the_users_wandb_dir_wins(tmp_path):
    """WANDB_DIR set by the user holds the W&B run; run.dir is only the default. In a fresh
    process, as a user's run starts: W&B reads its environment once per process."""
    env = dict(os.environ, WANDB_MODE="offline", WANDB_SILENT="true", WANDB_DIR=str(tmp_path / "elsewhere"))
    (tmp_path / "elsewhere").mkdir()
    code = ("import sys; from configs import load_config; from ops import trackers; "
            "cfg = load_config('tiny', [f'run.dir={sys.argv[1]}', 'run.trackers=[wandb]']); "
            "trackers._Wandb(cfg, {}, 0).close('done')")
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "run")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert glob.glob(str(tmp_path / "elsewhere" / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert not (tmp_path / "run" / "wandb").exists()

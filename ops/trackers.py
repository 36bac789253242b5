"""Experiment trackers (`run.trackers`): every scalar of `metrics.jsonl`, the resolved config and
the run's summary, from process 0 only.

- `tensorboard` (default): event files in `run.dir/tb/` (ops.observe).
- `wandb` (extra `trackers`): a Weights & Biases run in `WANDB_DIR/wandb/` (default
  `run.dir/wandb/`), online or offline as `WANDB_MODE` says; project `WANDB_PROJECT` (default
  meshlm), named after run.dir.
- `mlflow` (extra `trackers`): an MLflow run at `MLFLOW_TRACKING_URI` (default a file store,
  `run.dir/mlruns`: MLflow 3 keeps file stores in maintenance mode, so the default sets
  MLFLOW_ALLOW_FILE_STORE; a file store the user names needs it set, or the run stops with one
  line before compiling; with mlflow-skinny a database store needs a tracking server), experiment
  `MLFLOW_EXPERIMENT_NAME` (default meshlm).

The user's environment wins over these defaults.

A restarted or resumed run logs into the same tracker run: the ids are kept in
`run.dir/trackers.json`. Steps recomputed after a restart (those after the last checkpoint) are
logged again; W&B keeps the first value of a step, MLflow both.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import time
import urllib.parse
import uuid
from typing import Any, Protocol

import storage
from configs import Config, ConfigError, check_writable, dump_config
from configs.schema import TRACKERS
from ops.observe import TensorBoard

IDS_FILE = "trackers.json"
EXTRA = {"wandb": "wandb", "mlflow": "mlflow"}  # tracker -> the module it needs


class Tracker(Protocol):
    def scalars(self, record: dict[str, Any]) -> None: ...
    def summary(self, summary: dict[str, Any]) -> None: ...
    def close(self, outcome: str) -> None: ...


def check_trackers(cfg: Config) -> None:
    """Each tracker named in run.trackers must be installed and able to start: one line before
    anything is written or compiled."""
    for name in cfg.run.trackers:
        module = EXTRA.get(name)
        if module and importlib.util.find_spec(module) is None:
            raise ConfigError(f"run.trackers: {name} is not installed (pip install 'meshlm[trackers]')")
    if storage.is_remote(cfg.run.dir):
        # Their own files go beside the run, through their own clients, which write local paths only.
        for name, variable in (("wandb", "WANDB_DIR"), ("mlflow", "MLFLOW_TRACKING_URI")):
            if name in cfg.run.trackers and not os.environ.get(variable):
                raise ConfigError(f"run.trackers: {name} keeps its files in run.dir, which is on an object store "
                                  f"(run.dir={cfg.run.dir}); set {variable} for it")
    if "mlflow" in cfg.run.trackers:
        _check_mlflow_store(cfg.run.dir)
    _check_tracker_folders(cfg)


def _check_tracker_folders(cfg: Config) -> None:
    """The folders the trackers write outside run.dir (which is checked as run.dir): the user's
    WANDB_DIR, and a file store MLFLOW_TRACKING_URI names. One line naming the variable."""
    if "wandb" in cfg.run.trackers and os.environ.get("WANDB_DIR"):
        check_writable(os.environ["WANDB_DIR"], "WANDB_DIR (run.trackers: wandb)")
    uri = os.environ.get("MLFLOW_TRACKING_URI", "")
    parsed = urllib.parse.urlparse(uri)
    if "mlflow" in cfg.run.trackers and uri and parsed.scheme in ("", "file"):
        check_writable(parsed.path if parsed.scheme else uri, "MLFLOW_TRACKING_URI (run.trackers: mlflow)")


def _check_mlflow_store(run_dir: str) -> None:
    """MLflow 3 refuses a file store (a `file:` URI, or a bare path) unless MLFLOW_ALLOW_FILE_STORE
    is true, and says so in a traceback once the run has started. The default store beside the
    run opts in itself (`_Mlflow`), unless the user set the variable otherwise."""
    uri = os.environ.get("MLFLOW_TRACKING_URI", "")
    allowed = os.environ.get("MLFLOW_ALLOW_FILE_STORE", "" if uri else "true").strip().lower() in ("true", "1")
    if allowed or urllib.parse.urlparse(uri).scheme not in ("", "file") or not _mlflow_has_file_store_opt_in():
        return
    raise ConfigError(f"run.trackers: mlflow refuses the file store at {uri or _default_store(run_dir)}; "
                      "set MLFLOW_ALLOW_FILE_STORE=true or MLFLOW_TRACKING_URI to a server")


def _mlflow_has_file_store_opt_in() -> bool:
    """Whether the installed MLflow knows MLFLOW_ALLOW_FILE_STORE (the versions that refuse file
    stores without it), read from its source: importing mlflow takes seconds."""
    spec = importlib.util.find_spec("mlflow")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(folder, "environment_variables.py")
        if os.path.exists(path):
            with open(path) as f:
                return "MLFLOW_ALLOW_FILE_STORE" in f.read()
    return False


def _default_store(run_dir: str) -> str:
    """The tracking URI when MLFLOW_TRACKING_URI is unset: a file store beside the run."""
    return "file:" + os.path.join(os.path.abspath(run_dir), "mlruns")


def _numbers(record: dict[str, Any]) -> dict[str, float]:
    """The finite scalars of a metrics record, `step` aside (a null, a skipped step's loss, is none)."""
    return {k: float(v) for k, v in record.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool) and v == v}


def _flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


class _TensorBoard:
    def __init__(self, cfg: Config, ids: dict[str, str], start: int):
        self.tb = TensorBoard(cfg.run.dir)

    def scalars(self, record: dict[str, Any]) -> None:
        self.tb.write(record)

    def summary(self, summary: dict[str, Any]) -> None:
        pass  # TensorBoard has scalars only; summary.json holds the summary

    def close(self, outcome: str) -> None:
        self.tb.close()  # a remote run.dir's event file uploaded whole


class _Wandb:
    def __init__(self, cfg: Config, ids: dict[str, str], start: int):
        import wandb

        ids.setdefault("wandb", uuid.uuid4().hex[:12])
        # The user's WANDB_DIR wins: wandb.init's dir argument would override it.
        where = {} if os.environ.get("WANDB_DIR") else {"dir": cfg.run.dir}
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "meshlm"), name=os.path.basename(
            os.path.abspath(cfg.run.dir)), id=ids["wandb"], resume="allow", config=dataclasses.asdict(cfg), **where)

    def scalars(self, record: dict[str, Any]) -> None:
        self.run.log(_numbers(record), step=int(record["step"]))

    def summary(self, summary: dict[str, Any]) -> None:
        self.run.summary.update(summary)

    def close(self, outcome: str) -> None:
        self.run.finish(exit_code=0 if outcome in ("done", "preempted") else 1)


class _Mlflow:
    def __init__(self, cfg: Config, ids: dict[str, str], start: int):
        from mlflow.entities import Metric
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:  # a file store beside the run: MLflow 3 keeps it (maintenance mode) behind this opt-in
            uri = _default_store(cfg.run.dir)
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client, self.metric = MlflowClient(uri), Metric
        if "mlflow" not in ids:
            name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "meshlm")
            found = self.client.get_experiment_by_name(name)
            experiment = found.experiment_id if found else self.client.create_experiment(name)
            run = self.client.create_run(experiment, run_name=os.path.basename(os.path.abspath(cfg.run.dir)))
            ids["mlflow"] = run.info.run_id
            # Parameters cannot change within an MLflow run: the first start's are logged as
            # parameters, and every start's resolved config as an artifact.
            for key, value in _flat(dataclasses.asdict(cfg)).items():
                self.client.log_param(run.info.run_id, key, str(value)[:6000])
        else:
            self.client.update_run(ids["mlflow"], status="RUNNING")
        self.run_id = ids["mlflow"]
        self.client.log_text(self.run_id, dump_config(cfg), f"config.step{start}.yaml")

    def scalars(self, record: dict[str, Any]) -> None:
        now = int(time.time() * 1000)
        metrics = [self.metric(k, v, now, int(record["step"])) for k, v in _numbers(record).items()]
        self.client.log_batch(self.run_id, metrics=metrics)

    def summary(self, summary: dict[str, Any]) -> None:
        self.client.log_dict(self.run_id, summary, "summary.json")

    def close(self, outcome: str) -> None:
        self.client.set_terminated(self.run_id, "FINISHED" if outcome in ("done", "preempted") else "FAILED")


_KINDS = {"tensorboard": _TensorBoard, "wandb": _Wandb, "mlflow": _Mlflow}
assert set(_KINDS) == set(TRACKERS)


class Trackers:
    """The trackers of one invocation, on process 0 (elsewhere: none). `open` starts their runs
    (the file writes begin there, so a run with nothing to do writes none)."""

    def __init__(self, cfg: Config, is_main: bool):
        self.cfg, self.names = cfg, list(cfg.run.trackers) if is_main else []
        self.active: list[Tracker] = []
        if "tensorboard" in self.names:  # its import takes a second: not inside a timed step
            self.active.append(_TensorBoard(cfg, {}, 0))

    def open(self, start: int) -> None:
        """Starts (or resumes) each tracker's run; this invocation starts at step `start`."""
        path = storage.join(self.cfg.run.dir, IDS_FILE)
        ids = json.loads(storage.read_text(path)) if storage.exists(path) else {}
        for name in self.names:
            if name != "tensorboard":
                self.active.append(_KINDS[name](self.cfg, ids, start))
        if ids:
            storage.write_text(path, json.dumps(ids), atomic=True)

    def scalars(self, record: dict[str, Any]) -> None:
        for t in self.active:
            t.scalars(record)

    def finish(self, summary: dict[str, Any] | None, outcome: str) -> None:
        for t in self.active:
            if summary is not None:
                t.summary(summary)
            t.close(outcome)
        self.active = []

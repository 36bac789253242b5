"""lm-evaluation-harness tasks on a meshlm model: which tasks a name means (the local YAML tasks
of a folder such as configs/eval/, whose data files are read relative to it, or the harness's
own), running them on an `evaluation.harness.MeshLM`, and `TaskHook`, which does so during training.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import subprocess
from typing import Any, Callable

import datasets
import lm_eval.evaluator
from lm_eval import simple_evaluate
from lm_eval.loggers.utils import get_commit_from_path
from lm_eval.tasks import TaskManager
from lm_eval.tasks._yaml_loader import load_yaml

import storage
from configs import Config, ConfigError
from data.tokenizer import load_tokenizer
from evaluation.harness import Evaluator, MeshLM
from evaluation.task_names import check_task_names, task_folder
from ops.goodput import Goodput
from ops.metrics import MetricsLogger, log

# What the harness reports beside the scores: the examples counted.
SKIPPED = ("sample_len", "samples")


def _git_hash() -> str | None:
    """The harness's record of the working directory's git commit, as it finds it, without git's
    `fatal: not a git repository` line on the console for each task run outside a repository."""
    try:
        return subprocess.check_output(["git", "describe", "--always"], stderr=subprocess.DEVNULL).strip().decode()
    except (subprocess.CalledProcessError, FileNotFoundError):
        return get_commit_from_path(os.getcwd())


lm_eval.evaluator.get_git_commit_hash = _git_hash  # simple_evaluate calls it by this name


def _local_config(path: str) -> dict:
    """A local task's config with its `data_files` read relative to the YAML's folder; a missing
    file is a ConfigError naming it."""
    config = load_yaml(path, resolve_func=True)
    kwargs = dict(config.get("dataset_kwargs") or {})
    files = kwargs.get("data_files")
    if files is not None:
        here = os.path.dirname(os.path.abspath(path))
        # data_files is a file, a list of them, or a split -> file or list mapping (datasets' forms).
        as_list = lambda v: [v] if isinstance(v, str) else list(v)  # noqa: E731
        splits = files if isinstance(files, dict) else {None: files}
        splits = {k: [f if os.path.isabs(f) else os.path.join(here, f) for f in as_list(v)] for k, v in splits.items()}
        for f in (f for fs in splits.values() for f in fs):
            if not os.path.exists(f):
                raise ConfigError(f"eval task {config['task']} ({path}): data file {f} does not exist")
        config["dataset_kwargs"] = {**kwargs, "data_files": splits if isinstance(files, dict) else splits[None]}
    return config


# The harness's own index (some 15,000 task YAMLs, seconds to read) is built only if a name is
# not local, and once per process.
@functools.lru_cache(maxsize=4)
def _manager(folder: str | None, standard: bool) -> TaskManager:
    return TaskManager(include_path=folder, include_defaults=standard)


@dataclasses.dataclass
class Tasks:
    """Checked harness tasks: the local ones as configs (their data files found), the others by
    name, with the TaskManager that knows both."""

    names: tuple[str, ...]
    specs: list  # a config dict per local task, the name of each standard one
    manager: Any


def resolve_tasks(names: list[str] | tuple[str, ...], folder: str, key: str = "eval.tasks") -> Tasks:
    """The tasks `names` from `folder`'s YAMLs or the harness's own. Raises ConfigError naming
    `key` for an unknown task (evaluation.task_names: without the harness's index), or the file
    of a local task whose data file is missing."""
    local = check_task_names(names, folder, key)
    standard = any(name not in local for name in names)
    folder = task_folder(folder)
    manager = _manager(os.path.abspath(folder) if local else None, standard)
    specs: list = []
    for name in names:
        if name in local:
            specs.append(_local_config(local[name]))
        elif name in manager.all_tasks:
            specs.append(name)
        else:  # in the cached names, not in this harness's index: the cache is stale
            raise ConfigError(f"{key}: unknown task {name!r}: not one of the harness's (`lm_eval ls tasks`)")
    return Tasks(tuple(names), specs, manager)


def write_scores(path: str, record: dict[str, Any]) -> None:
    """eval.py --output: the scores and their step as one JSON file, local or an object on a bucket."""
    storage.write_text(path, json.dumps(record, indent=1))


def run_tasks(lm: MeshLM, tasks: Tasks, limit: int = 0) -> dict[str, float]:
    """Runs the tasks with the harness; returns {"task/NAME/METRIC": value} of every numeric
    metric (standard errors left out). `limit`: the first examples of each task only (0: all)."""
    datasets.disable_progress_bars()  # a bar per split read would fill the run's log
    results = simple_evaluate(model=lm, tasks=list(tasks.specs), task_manager=tasks.manager, limit=limit or None,
                              log_samples=False, bootstrap_iters=0, verbosity="ERROR")
    scores: dict[str, float] = {}
    for task, metrics in (results or {}).get("results", {}).items():
        for key, value in metrics.items():
            metric = key.split(",")[0]
            if isinstance(value, (int, float)) and not isinstance(value, bool) and metric not in SKIPPED \
                    and "stderr" not in metric:
                scores[f"task/{task}/{metric}"] = float(value)
    return scores


def each_task(tasks: Tasks) -> list[Tasks]:
    """The tasks one by one, so that one failing costs only its own scores."""
    return [Tasks((name,), [spec], tasks.manager) for name, spec in zip(tasks.names, tasks.specs)]


class TaskHook:
    """A `trainer.hooks.Hook`: runs eval.tasks on the training state, on the training mesh, at
    `eval.tasks_every` and the last step; the scores go to metrics.jsonl and the trackers, the time
    to goodput's eval. A task that fails is one warning line: the run goes on."""

    def __init__(self, cfg: Config, tasks: Tasks, evaluator: Callable[[dict], Evaluator], logger: MetricsLogger,
                 goodput: Goodput):
        """`evaluator`: the run's `Evaluator` of given parameters (trainer/scoring.py)."""
        self.every, self.last, self.limit, self.cfg = cfg.eval.tasks_every, cfg.train.steps, cfg.eval.tasks_limit, cfg
        self.tasks, self.evaluator, self.logger, self.goodput = tasks, evaluator, logger, goodput
        self.lm: MeshLM | None = None
        self.tokenizer = load_tokenizer(cfg.data.tokenizer)

    def begin(self, start: int, state: Any) -> None:
        """Nothing before the first step."""

    def due(self, step: int, stopping: bool) -> bool:
        return not stopping and ((self.every > 0 and step % self.every == 0) or step == self.last)

    def run(self, step: int, state: Any, stopping: bool) -> None:
        scores: dict[str, float] = {}
        with self.goodput.phase("eval"):
            if self.lm is None:  # one model for the run: its compiled scoring steps are kept
                self.lm = MeshLM(self.evaluator(state.params), self.tokenizer, self.cfg.model)
            self.lm.ev.params = state.params
            for one in each_task(self.tasks):
                try:
                    scores.update(run_tasks(self.lm, one, self.limit))
                except Exception as e:  # noqa: BLE001  (a task's failure must not end the training run)
                    first = (str(e).strip().splitlines() or [""])[0]
                    log(f"warning: eval task {one.names[0]} failed at step {step}, training goes on: "
                        f"{type(e).__name__}: {first}")
        if scores:
            self.logger.write_tasks(step, scores)

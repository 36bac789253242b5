"""Which eval task names exist, answered in well under a second: the local YAML tasks of a folder
(configs/eval/ by default) and the harness's own names, read from a cache file.

lm-evaluation-harness finds its own tasks by reading some 15,000 YAML files (seconds to tens of
seconds); a misspelt name should not wait for that. The names are read once per installed harness
version and kept in the user's cache directory (`$XDG_CACHE_HOME/meshlm`, else `~/.cache/meshlm`),
written aside and renamed whole; later checks read that one file. Nothing here imports the harness
unless that file must be built. Running a task still takes the harness's own index
(evaluation/tasks.py).
"""

from __future__ import annotations

import difflib
import importlib.metadata
import json
import os
import tempfile

import yaml

import configs
import storage
from configs import ConfigError, load_config


def task_folder(folder: str) -> str:
    """`folder` as given, or, relative and not found from here, inside the meshlm checkout (so
    the default configs/eval is found from any working directory)."""
    if not folder or os.path.isabs(folder) or os.path.isdir(folder):
        return folder
    beside = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(configs.__file__))), folder)
    return beside if os.path.isdir(beside) else folder


class _TaskYaml(yaml.SafeLoader):
    """A harness task YAML read for its `task:` name alone: its tags (`!function module.name`) are
    kept as text, not resolved."""


_TaskYaml.add_multi_constructor("!", lambda loader, suffix, node: None)


def _read(path: str) -> object:
    with open(path) as f:
        return yaml.load(f, Loader=_TaskYaml)  # noqa: S506 (a SafeLoader that drops unknown tags)


def local_tasks(folder: str) -> dict[str, str]:
    """{task name: YAML path} of the harness task YAMLs directly in `folder`."""
    if not folder or not os.path.isdir(folder):
        return {}
    found = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith((".yaml", ".yml")):
            config = _read(os.path.join(folder, name))
            if isinstance(config, dict) and isinstance(config.get("task"), str):
                found[config["task"]] = os.path.join(folder, name)
    return found


def folder_names(folder: str) -> set[str]:
    """Every task, group and tag name the YAMLs under `folder` (its subfolders too) define: the
    harness, given the folder, runs them by name."""
    names: set[str] = set()
    for here, _, files in os.walk(folder) if folder and os.path.isdir(folder) else ():
        for name in (n for n in files if n.endswith((".yaml", ".yml"))):
            config = _read(os.path.join(here, name))
            if not isinstance(config, dict):
                continue
            # A group's `task:` lists the tasks it runs (named elsewhere); a tag may be a list.
            names.update(v for v in (config.get("task"), config.get("group")) if isinstance(v, str))
            tags = config.get("tag")
            names.update(t for t in (tags if isinstance(tags, list) else [tags]) if isinstance(t, str))
    return names


def cache_file() -> str:
    """Where the harness's task names are kept: one file per installed lm-eval version."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "meshlm", f"lm_eval-{importlib.metadata.version('lm_eval')}-tasks.json")


def harness_tasks() -> frozenset[str]:
    """Every task, group and tag name the installed harness knows: from the cache file, or, the
    first time for this version (or when that file cannot be read), from the harness's own index,
    then kept there. A cache directory that cannot be written only costs the next check the build
    again."""
    path = cache_file()
    try:
        with open(path) as f:
            return frozenset(json.load(f))
    except (OSError, ValueError):
        pass
    from lm_eval.tasks import TaskManager

    names = sorted(TaskManager(include_defaults=True).all_tasks)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=os.path.dirname(path), suffix=".tmp", delete=False) as f:
            json.dump(names, f)
        os.replace(f.name, path)  # a reader sees the whole list or none
    except OSError:
        pass
    return frozenset(names)


def check_task_names(names: list[str] | tuple[str, ...], folder: str, key: str) -> dict[str, str]:
    """{name: YAML path} of `folder`'s local tasks, once every one of `names` is found there or
    among the harness's; raises ConfigError naming `key` and the closest known name otherwise."""
    folder = task_folder(folder)
    local = local_tasks(folder)
    # The harness is given the folder (its subfolders, groups and tags too) only if it holds tasks.
    mine = folder_names(folder) if local and any(name not in local for name in names) else set(local)
    unknown = [name for name in names if name not in mine]
    if not unknown:
        return local
    standard = harness_tasks()
    for name in unknown:
        if name not in standard:
            close = difflib.get_close_matches(name, sorted(mine), n=1, cutoff=0.6) or \
                difflib.get_close_matches(name, sorted(standard), n=1, cutoff=0.6)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            listed = f" (local: {', '.join(local)})" if local else ""
            raise ConfigError(f"{key}: unknown task {name!r}{hint}: neither a YAML task in {folder}{listed} nor one "
                              "of the harness's (`lm_eval ls tasks`)")
    return local


def check_run_tasks(names: list[str] | tuple[str, ...], run_dir: str, tasks_dir: str | None, key: str) -> None:
    """eval.py's check of `names` against `tasks_dir`, or the run's own `eval.tasks_dir` (its
    config.yaml), before anything heavy is imported; nothing without a config.yaml (the
    checkpoint's lookup says so then)."""
    cfg_file = storage.join(run_dir, "config.yaml")
    if tasks_dir or storage.exists(cfg_file):
        check_task_names(names, tasks_dir or load_config(cfg_file).eval.tasks_dir, key)

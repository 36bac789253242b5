"""A misspelt eval task is refused in seconds, with the closest name: eval.py checks the run's local
tasks and the harness's names, kept in a cache file per lm-eval version, before it imports JAX or
builds the harness's index (tens of seconds). Real eval.py processes, timed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from conftest import ROOT, require

require("lm_eval", "eval", lazy=True)

from configs import ConfigError, dump_config, load_config  # noqa: E402
from evaluation.task_names import cache_file, harness_tasks  # noqa: E402

# Well under the seconds the harness's own index takes: the bound is for a loaded test machine.
REFUSED_WITHIN_S = 5.0


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A run directory as eval.py reads it first: its config.yaml (the names are checked before
    its checkpoints are looked for)."""
    path = tmp_path_factory.mktemp("names")
    (path / "config.yaml").write_text(dump_config(load_config("tiny", [f"run.dir={path}"])))
    return str(path)


@pytest.fixture(scope="module")
def harness_names() -> frozenset[str]:
    """The harness's names, from the user's cache file (built here, the once per lm-eval version
    that costs the harness's whole index, if no earlier run built it)."""
    return harness_tasks()


def _refused(run_dir: str, tasks: str, env: dict[str, str] | None = None) -> tuple[str, float]:
    """(eval.py's one error line, its wall seconds), its exit status checked."""
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "eval.py", "--run-dir", run_dir, "--tasks", tasks], cwd=ROOT,
                          capture_output=True, text=True, env=env, timeout=120)
    seconds = time.perf_counter() - t0
    assert done.returncode == 2, done.stderr
    err = done.stderr.strip()
    assert err.startswith("error: --tasks: unknown task") and "\n" not in err, err
    return err, seconds


def test_the_cache_holds_the_harness_names(harness_names):
    assert {"hellaswag", "arc_easy", "mmlu"} <= harness_names
    with open(cache_file()) as f:
        assert frozenset(json.load(f)) == harness_names


@pytest.mark.parametrize("typo, meant", [("stdlib_word", "stdlib_words"), ("hellaswg", "hellaswag")])
def test_a_misspelt_task_is_refused_fast_with_the_closest_name(run_dir, harness_names, typo, meant):
    err, seconds = _refused(run_dir, f"stdlib_words,{typo}")
    assert f"unknown task {typo!r} (did you mean {meant!r}?)" in err, err
    assert seconds < REFUSED_WITHIN_S, f"refused after {seconds:.1f} s"


def test_the_names_come_from_the_cache_file_of_this_lm_eval_version(run_dir, tmp_path):
    """A cache directory whose file for this version names one made-up task: that file is what is
    read (the harness's index is not), so its task is the closest name."""
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path))
    path = subprocess.run([sys.executable, "-c", "from evaluation.task_names import cache_file; print(cache_file())"],
                          cwd=ROOT, env=env, capture_output=True, text=True, check=True).stdout.strip()
    assert path.startswith(str(tmp_path)) and os.path.basename(path) == os.path.basename(cache_file())
    os.makedirs(os.path.dirname(path))
    with open(path, "w") as f:
        json.dump(["made_up_harness_task"], f)
    err, seconds = _refused(run_dir, "made_up_harnes_task", env)
    assert "(did you mean 'made_up_harness_task'?)" in err, err
    assert seconds < REFUSED_WITHIN_S, f"refused after {seconds:.1f} s"


def test_a_task_under_the_tasks_folder_is_known_by_its_name_group_or_tag(tmp_path):
    """The harness, given a folder of tasks, also runs those in its subfolders and their groups
    and tags: the check knows them too, and suggests them."""
    from evaluation.task_names import check_task_names

    words = os.path.join(ROOT, "configs", "eval", "stdlib_words.yaml")
    (tmp_path / "stdlib_words.yaml").write_text(open(words).read())
    (tmp_path / "more").mkdir()
    (tmp_path / "more" / "sub.yaml").write_text("task: sub_words\ntag: [my_tag]\ndataset_path: json\n")
    (tmp_path / "more" / "group.yaml").write_text("group: my_group\ntask: [sub_words, stdlib_words]\n")
    local = check_task_names(["stdlib_words", "sub_words", "my_tag", "my_group"], str(tmp_path), "--tasks")
    assert list(local) == ["stdlib_words"]
    with pytest.raises(ConfigError, match=r"unknown task 'sub_word' \(did you mean 'sub_words'\?\)"):
        check_task_names(["sub_word"], str(tmp_path), "--tasks")

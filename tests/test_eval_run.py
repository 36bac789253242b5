"""Harness tasks in training (eval.tasks) and from a checkpoint (eval.py), on one short real run of
the tiny model: the local task's score rises from chance as the model learns, is logged at the
configured steps (metrics.jsonl and TensorBoard), survives a resume, and eval.py reads the same
score from the checkpoint. Bad input is one line and exit status 2."""

from __future__ import annotations

import glob
import json
import logging
import os
import shutil
import struct

import jax
import pytest

from conftest import ROOT, require, stdlib_glob

require("lm_eval", "eval")

import trainer  # noqa: E402
from configs import load_config  # noqa: E402
from data.tokenizer import ByteTokenizer  # noqa: E402
from eval import main as eval_main  # noqa: E402
from train import main as train_main  # noqa: E402
from evaluation.harness import MeshLM  # noqa: E402
from trainer.scoring import evaluator_of  # noqa: E402
from trainer.program import abstract_program  # noqa: E402
from trainer.state import init_state  # noqa: E402
from evaluation.tasks import resolve_tasks, run_tasks  # noqa: E402

TASK, LIMIT, STEPS = "stdlib_words", 80, 120
SCORE = f"task/{TASK}/acc"


def _config(run_dir: str, *overrides: str):
    base = [f"run.dir={run_dir}", f"data.path={stdlib_glob('email')}", "optim.lr=1e-2", "train.log_every=60",
            f"eval.tasks=[{TASK}]", f"eval.tasks_limit={LIMIT}", "checkpoint.every=60"]
    return load_config(os.path.join(ROOT, "configs", "tiny.yaml"), base + list(overrides))


def _tensorboard(run_dir: str, tag: str) -> dict[int, float]:
    """{step: value} of `tag` in the run's TensorBoard event files (TFRecord framing: a length, its
    CRC, the Event, the Event's CRC)."""
    from tensorboardX.proto import event_pb2

    found = {}
    for path in glob.glob(os.path.join(run_dir, "tb", "events.out.tfevents.*")):
        data, i = open(path, "rb").read(), 0
        while i < len(data):
            n = struct.unpack("<Q", data[i:i + 8])[0]
            event = event_pb2.Event.FromString(data[i + 12:i + 12 + n])
            i += 12 + n + 4
            found.update({event.step: v.simple_value for v in event.summary.value if v.tag == tag})
    return found


def _task_records(run_dir: str) -> dict[int, dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    return {r["step"]: r for r in records if any(k.startswith("task/") for k in r)}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A run of STEPS steps on two devices with the task every STEPS // 2 steps."""
    path = str(tmp_path_factory.mktemp("eval") / "run")
    trainer.run(_config(path, f"train.steps={STEPS}", f"eval.tasks_every={STEPS // 2}"), jax.devices()[:2])
    return path


def test_training_logs_the_task_score_above_chance_and_untrained_is_near_it(run_dir):
    records = _task_records(run_dir)
    assert sorted(records) == [STEPS // 2, STEPS]
    trained = records[STEPS][SCORE]
    with open(os.path.join(run_dir, "summary.json")) as f:  # the tiny preset has no held-out eval: tasks alone
        assert json.load(f)["seconds"]["eval"] > 0
    board = _tensorboard(run_dir, SCORE)
    assert sorted(board) == sorted(records)
    assert all(abs(board[s] - records[s][SCORE]) < 1e-6 for s in board), (board, records)
    # An untrained model of the same config, through the same harness and task: near chance (1/4).
    cfg = _config(run_dir)
    program = abstract_program(cfg, jax.devices()[:2])
    state = init_state(cfg.model, program.tx, 0, program.state_sh)
    untrained = run_tasks(MeshLM(evaluator_of(program, state.params), ByteTokenizer(), cfg.model),
                          resolve_tasks([TASK], cfg.eval.tasks_dir), LIMIT)[SCORE]
    assert 0.1 <= untrained <= 0.4, untrained
    assert trained >= 0.5, (trained, records)
    assert records[STEPS // 2][SCORE] != trained  # the score follows the training


def test_resume_keeps_the_scores_and_a_failing_task_is_one_warning(run_dir, tmp_path, capsys):
    before = _task_records(run_dir)
    tasks_dir = tmp_path / "tasks"
    shutil.copytree(os.path.join(ROOT, "configs", "eval"), tasks_dir)
    (tasks_dir / "broken.jsonl").write_text("{not json\n")
    (tasks_dir / "broken.yaml").write_text((tasks_dir / f"{TASK}.yaml").read_text()
                                           .replace(f"task: {TASK}", "task: broken")
                                           .replace(f"{TASK}.jsonl", "broken.jsonl"))
    cfg = _config(run_dir, f"train.steps={STEPS + 10}", f"eval.tasks=[broken,{TASK}]", f"eval.tasks_dir={tasks_dir}")
    trainer.run(cfg, jax.devices()[:2])
    out = capsys.readouterr().out
    assert f"resumed from step {STEPS}" in out
    warnings = [line for line in out.splitlines() if "broken" in line]
    assert len(warnings) == 1 and warnings[0].startswith("warning: eval task broken failed at step 130"), warnings
    after = _task_records(run_dir)
    assert sorted(after) == [STEPS // 2, STEPS, STEPS + 10]
    assert {s: after[s] for s in before} == before
    assert set(after[STEPS + 10]) == {"step", SCORE}


def test_eval_py_scores_the_checkpoint_as_training_did(run_dir, tmp_path, capsys, caplog):
    """eval.py on the newest checkpoint, on this process's 8 devices (training ran on 2)."""
    last = max(_task_records(run_dir))
    out = tmp_path / "scores.json"
    tasks = f"{TASK},stdlib_text,stdlib_complete"  # multiple choice, rolling text, generation
    argv = ["--run-dir", run_dir, "--tasks", tasks, "--limit", str(LIMIT), "--output", str(out)]
    # The harness's warnings shown as in a process of its own (an earlier evaluation in this one
    # set its logger to errors only).
    caplog.set_level(logging.WARNING, logger="lm_eval")
    assert eval_main(argv) == 0
    written = json.loads(out.read_text())
    assert written["step"] == last and written["requests"] > 4 * LIMIT
    assert written["scores"][SCORE] == _task_records(run_dir)[last][SCORE]
    assert f"{TASK}/acc " in capsys.readouterr().out
    # No harness warning for the shipped tasks (their metrics' aggregation said in full): each
    # would be a line on eval.py's stderr.
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and r.name.startswith("lm_eval")]
    assert not warned, warned
    # The text task (rolling log-likelihood): better than a uniform guess over the 264 ids, 8.04 bits.
    assert 1 < written["scores"]["task/stdlib_text/bits_per_byte"] < 6, written
    assert 0 <= written["scores"]["task/stdlib_complete/exact_match"] <= 1  # too hard for this model: runs only


def test_bad_input_is_one_line_and_exit_2(run_dir, tmp_path, capsys):
    def refused(argv: list[str], main=eval_main) -> str:
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and "\n" not in err, err
        return err

    assert "unknown task 'no_such_task'" in refused(["--run-dir", run_dir, "--tasks", "no_such_task"])
    tasks_dir = tmp_path / "tasks"
    tasks_dir.mkdir()
    (tasks_dir / "gone.yaml").write_text((open(os.path.join(ROOT, "configs", "eval", f"{TASK}.yaml")).read())
                                         .replace(f"task: {TASK}", "task: gone").replace(f"{TASK}.jsonl", "gone.jsonl"))
    err = refused(["--run-dir", run_dir, "--tasks", "gone", "--tasks-dir", str(tasks_dir)])
    assert "gone.jsonl does not exist" in err
    empty = tmp_path / "empty"
    empty.mkdir()
    shutil.copy(os.path.join(run_dir, "config.yaml"), empty)
    assert "no checkpoints" in refused(["--run-dir", str(empty), "--tasks", TASK])
    # Training refuses an unknown task before it writes anything.
    fresh = tmp_path / "fresh"
    err = refused(["--config", "tiny", f"run.dir={fresh}", "eval.tasks=[no_such_task]"], train_main)
    assert "eval.tasks: unknown task" in err and not fresh.exists()


def test_a_task_run_outside_a_git_repository_prints_nothing_of_git(tmp_path, monkeypatch, capfd):
    """The harness records the working directory's commit with `git describe` on every run; outside
    a repository that printed git's `fatal: not a git repository` once per task."""
    import lm_eval.evaluator

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))  # no repository above tmp_path either
    assert lm_eval.evaluator.get_git_commit_hash() is None
    assert capfd.readouterr().err == ""

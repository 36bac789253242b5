"""Sweeps: bad sweep files stop before anything runs; points and their directory names; the
SLURM array job; a real sweep that runs, reports a failed point, summarizes and resumes."""

from __future__ import annotations

import csv
import json
import os
import subprocess

import pytest

import train
from configs import load_config
from bench.procs import cpu_env
from conftest import ROOT, stdlib_glob

TINY = os.path.join(ROOT, "configs", "tiny.yaml")


def write_sweep(tmp_path, body: str) -> str:
    path = tmp_path / "sweep.yaml"
    path.write_text(f"base: {TINY}\ndir: {tmp_path / 'out'}\n{body}")
    return str(path)


BAD = {
    "typo in a swept key": ("grid: {optim.lrr: [0.1, 0.2]}", "unknown config key 'optim.lrr' (did you mean optim.lr?)"),
    "typo in overrides": ("overrides: {train.stpes: 3}\ngrid: {optim.lr: [0.1]}", "did you mean train.steps?"),
    "typo in a sweep key": ("gird: {optim.lr: [0.1]}", "unknown sweep key 'gird' (did you mean grid?)"),
    "empty grid": ("grid: {}", "grid and zip are both empty: nothing to sweep"),
    "no values": ("grid: {optim.lr: []}", "grid.optim.lr: empty list of values"),
    "not a list": ("grid: {optim.lr: 0.1}", "grid.optim.lr: expected a list of values, got 0.1"),
    "unequal zip": ("zip: {optim.lr: [0.1, 0.2], model.d_model: [64, 128, 256]}",
                    "zip: the lists must have equal lengths, got optim.lr: 2, model.d_model: 3"),
    "wrong type": ("grid: {train.steps: [2, many]}", "point train.steps=many: train.steps: expected int, got 'many'"),
    "impossible value": ("grid: {optim.lr: [0.1, -1]}", "optim.lr: must be > 0, got -1.0"),
    "swept run.dir": ("grid: {run.dir: [a, b]}", "run.dir cannot be swept"),
    "swept and fixed": ("overrides: {optim.lr: 0.1}\ngrid: {optim.lr: [0.2]}",
                        "optim.lr cannot be overridden for every point"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_sweep_file_exits_2_before_anything_runs(case, tmp_path, capsys):
    body, message = BAD[case]
    path = write_sweep(tmp_path, body)
    assert train.main(["--sweep", path]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {path}: ") and err.count("\n") == 1, err
    assert message in err, err
    assert not (tmp_path / "out").exists()


def test_bad_command_lines(tmp_path, capsys):
    assert train.main(["--sweep", str(tmp_path / "none.yaml")]) == 2
    assert f"sweep file not found: {tmp_path / 'none.yaml'}" in capsys.readouterr().err
    path = write_sweep(tmp_path, "grid: {optim.lr: [0.1]}")
    assert train.main(["--sweep", path, "optim.lr=0.3"]) == 2, "a swept key cannot be overridden from the command line"
    assert train.main(["--sweep", path, "--config", TINY]) == 2
    assert train.main(["--emit", "slurm"]) == 2
    assert not (tmp_path / "out").exists()


def test_points_are_the_grid_times_the_zip_with_stable_names(tmp_path):
    from sweep import load_sweep

    path = write_sweep(
        tmp_path,
        "overrides: {train.steps: 7}\n"
        "grid: {optim.lr: [1.0e-3, 3.0e-3], data.path: ['/a/b*.txt']}\n"
        "zip: {model.d_model: [64, 128], model.d_ff: [128, 256]}\n",
    )
    sweep = load_sweep(path, ["train.log_every=3"])
    names = [p.name for p in sweep.points]
    assert names == [
        f"optim.lr={lr},data.path=_a_b_.txt,model.d_model={d},model.d_ff={f}"
        for lr in ("0.001", "0.003") for d, f in (("64", "128"), ("128", "256"))
    ]
    assert [p.name for p in load_sweep(path, ["train.log_every=3"]).points] == names, "names are stable"
    last = sweep.points[-1].cfg
    assert (last.optim.lr, last.model.d_model, last.model.d_ff, last.train.steps, last.train.log_every) == (
        0.003, 128, 256, 7, 3)
    assert last.run.dir == os.path.join(str(tmp_path / "out"), names[-1])


def test_emit_slurm_writes_an_array_job_and_the_commands(tmp_path):
    path = write_sweep(tmp_path, "grid: {optim.lr: [0.001, 0.01], train.steps: [2, 3]}\nslurm: ['--time=00:10:00']")
    assert train.main(["--sweep", path, "--emit", "slurm", "train.log_every=1"]) == 0
    out = tmp_path / "out"
    commands = (out / "commands.txt").read_text().splitlines()
    script = (out / "sweep.sbatch").read_text()
    assert len(commands) == 4 and all(c.startswith("python ") and "train.log_every=1" in c for c in commands)
    assert "#SBATCH --array=0-3\n" in script and "#SBATCH --time=00:10:00\n" in script
    assert sorted(os.listdir(out)) == ["commands.txt", "sweep.sbatch"], "nothing ran"
    for task in (0, 3):  # `echo` as the interpreter shows which command each array task runs
        env = dict(os.environ, PYTHON="echo", SLURM_ARRAY_TASK_ID=str(task))
        shown = subprocess.run(["bash", str(out / "sweep.sbatch")], env=env, capture_output=True, text=True, check=True)
        assert "python " + shown.stdout.strip() == commands[task]
    assert "optim.lr=0.01" in commands[3] and "train.steps=3" in commands[3]


def test_a_sweep_runs_its_points_reports_a_failure_and_resumes(tmp_path, monkeypatch, capsys):
    # The sweep runs here; its points are real train.py processes, on one device for speed. The
    # second point passes the static checks but needs 2 devices where there is 1: it fails at start-up.
    # The suite's other XLA flags are kept (bench.procs.cpu_env): its faster compiles.
    monkeypatch.setenv("XLA_FLAGS", cpu_env(1)["XLA_FLAGS"])
    path = write_sweep(
        tmp_path,
        "overrides: {train.steps: 3, train.log_every: 1}\n"
        "zip: {optim.lr: [0.001, 0.01], mesh.data: [1, 2]}\n",
    )
    args = ["--sweep", path, f"data.path={stdlib_glob('json')}"]
    code, output = train.main(args), capsys.readouterr().out
    assert code == 1, output
    out = tmp_path / "out"
    names = ["optim.lr=0.001,mesh.data=1", "optim.lr=0.01,mesh.data=2"]
    assert f"[sweep 2/2] {names[1]}: FAILED (exit 2)" in output
    assert "mesh: pipeline=1 x data=2" in (out / names[1] / "train.log").read_text(), "the point's own error is kept"
    with open(out / "summary.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["point"], r["optim.lr"], r["status"], r["step"]) for r in rows] == [
        (names[0], "0.001", "done", "3"), (names[1], "0.01", "failed", "0")]
    assert load_config(str(out / names[0] / "config.yaml")).optim.lr == 0.001
    with open(out / names[0] / "summary.json") as f:
        assert json.load(f)["final_loss"] == float(rows[0]["loss"])
    assert float(rows[0]["tokens_per_s"]) > 0
    markdown = (out / "summary.md").read_text()
    assert "| point | status | step | final loss | tokens/s | MFU | goodput |" in markdown
    assert f"| `{names[0]}` | done | 3 | {float(rows[0]['loss']):.4f} |" in markdown
    assert f"| `{names[1]}` | failed | 0 |" in markdown
    assert (out / "loss_curves.png").stat().st_size > 10_000
    metrics = (out / names[0] / "metrics.jsonl").read_text()

    code, output = train.main(args), capsys.readouterr().out
    assert code == 1, output
    assert f"[sweep 1/2] {names[0]}: finished earlier (step 3), skipped" in output and "FAILED (exit 2)" in output
    assert (out / names[0] / "metrics.jsonl").read_text() == metrics, "a finished point is not run again"

    (out / "summary.md").unlink()
    assert train.main([*args, "--summarize"]) == 0
    assert (out / "summary.md").read_text() == markdown.replace("| failed |", "| not run |")

"""Sweeps: one base config, a set of overrides per point, one run directory per point.

A sweep file (YAML, see configs/sweeps/):

    base: configs/tiny.yaml          # a config file or preset name
    overrides: {train.steps: 20}     # for every point (a mapping, or a list of "key=value")
    grid: {optim.lr: [1e-3, 3e-3]}   # cartesian product over the keys
    zip: {model.d_model: [64, 128], model.d_ff: [128, 256]}  # equal-length lists, taken together
    dir: runs/sweeps/lr              # root (or gs:// s3://); each point runs in dir/<its overrides>
    slurm: ["--time=01:00:00"]       # extra #SBATCH lines for --emit slurm

`python train.py --sweep FILE [key=value ...]` checks every point with the config loader (so a
misspelt key gets its did-you-mean error) before anything runs, then runs the points one after
another, each in its own `train.py` process. A point whose summary.json says it reached
train.steps is skipped, so rerunning the command resumes the sweep; a failed point is reported
and the sweep goes on (exit 1 at the end). `--emit slurm` writes an array job and commands.txt
instead; `--summarize` only rewrites summary.csv, summary.md and loss_curves.png.
"""

from __future__ import annotations

from configs import handle_interrupts

# What a signal before the command finishes leaves.
KEPT = ("the points that finished are kept, a stopped one has its checkpoint; run the same "
        "command to resume the sweep")

if __name__ == "__main__":  # before the imports below (pydantic, JAX): a signal while they load gets the line too
    handle_interrupts(KEPT)

import argparse
import csv
import dataclasses
import difflib
import hashlib
import io
import itertools
import json
import os
import re
import shlex
import signal
import subprocess
import sys
from typing import Any

import yaml

import storage
from configs import Config, ConfigError, check_output, guarded, load_config
from configs.load import resolve_preset

TRAIN_PY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "train.py")
SWEEP_KEYS = ("base", "overrides", "grid", "zip", "dir", "slurm")
MAX_NAME = 120  # longer directory names are cut and end in a hash of the whole


@dataclasses.dataclass
class Point:
    index: int
    name: str  # its directory name, e.g. "optim.lr=0.001,model.d_model=128"
    values: dict[str, str]  # swept key -> its value as a command-line string
    run_dir: str
    cfg: Config


@dataclasses.dataclass
class Sweep:
    path: str
    base: str
    overrides: list[str]  # "key=value" for every point: the file's, then the command line's
    dir: str
    keys: list[str]  # the swept keys, grid first
    points: list[Point]
    slurm: list[str]


def _cli(value: Any) -> str:
    """A YAML value as the command line's `key=value` string the config loader reads back."""
    if isinstance(value, bool) or value is None or isinstance(value, (list, dict)):
        return json.dumps(value, separators=(",", ":"))  # JSON is YAML: true, null, [2,3]
    return repr(value) if isinstance(value, float) else str(value)


def _dir_name(values: dict[str, str]) -> str:
    """Stable and filesystem-safe: the same overrides always give the same name."""
    name = re.sub(r"[^A-Za-z0-9._=,+-]", "_", ",".join(f"{k}={v}" for k, v in values.items()))
    if len(name) > MAX_NAME:
        name = name[: MAX_NAME - 9] + "-" + hashlib.sha1(name.encode()).hexdigest()[:8]
    return name


def _values(path: str, section: str, table: Any) -> dict[str, list[Any]]:
    if table is None:
        return {}
    if not isinstance(table, dict):
        raise ConfigError(f"{path}: {section}: expected a mapping of dotted keys to lists of values")
    for key, values in table.items():
        if not isinstance(values, list):
            raise ConfigError(f"{path}: {section}.{key}: expected a list of values, got {values!r}")
        if not values:
            raise ConfigError(f"{path}: {section}.{key}: empty list of values")
    return {str(k): v for k, v in table.items()}


def _overrides(path: str, table: Any) -> list[str]:
    if table is None:
        return []
    if isinstance(table, dict):
        return [f"{k}={_cli(v)}" for k, v in table.items()]
    if isinstance(table, list) and all(isinstance(x, str) and "=" in x for x in table):
        return list(table)
    raise ConfigError(f"{path}: overrides: expected a mapping of dotted keys or a list of key=value")


def load_sweep(path: str, cli_overrides: list[str] | tuple[str, ...] = ()) -> Sweep:
    """Reads and checks a sweep file: every point's config is loaded (types, did-you-mean for
    unknown keys, static checks). Raises ConfigError with a one-line message naming the file."""
    try:
        with open(path) as f:
            tree = yaml.safe_load(f)
    except OSError:
        raise ConfigError(f"sweep file not found: {path}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(tree, dict):
        raise ConfigError(f"{path}: expected a mapping with base, grid and/or zip, dir")
    for key in tree:
        if key not in SWEEP_KEYS:
            close = difflib.get_close_matches(str(key), SWEEP_KEYS, n=1)
            hint = f" (did you mean {close[0]}?)" if close else f" (expected {', '.join(SWEEP_KEYS)})"
            raise ConfigError(f"{path}: unknown sweep key {key!r}{hint}")
    if not isinstance(tree.get("base"), str):
        raise ConfigError(f"{path}: base: expected the path of a config file")
    base = tree["base"]
    try:
        resolve_preset(base)
    except ConfigError as e:
        raise ConfigError(f"{path}: base: {e}") from None
    grid, zipped = _values(path, "grid", tree.get("grid")), _values(path, "zip", tree.get("zip"))
    if not grid and not zipped:
        raise ConfigError(f"{path}: grid and zip are both empty: nothing to sweep")
    if len({len(v) for v in zipped.values()}) > 1:
        lengths = ", ".join(f"{k}: {len(v)}" for k, v in zipped.items())
        raise ConfigError(f"{path}: zip: the lists must have equal lengths, got {lengths}")
    if set(grid) & set(zipped):
        raise ConfigError(f"{path}: {sorted(set(grid) & set(zipped))[0]} is in both grid and zip")
    common = _overrides(path, tree.get("overrides")) + list(cli_overrides)
    keys = list(grid) + list(zipped)
    for item in common:
        key = item.split("=", 1)[0].strip()
        if key == "run.dir" or key in keys:
            why = "set dir: in the sweep file" if key == "run.dir" else "it is swept"
            raise ConfigError(f"{path}: {key} cannot be overridden for every point ({why})")
    if "run.dir" in keys:
        raise ConfigError(f"{path}: run.dir cannot be swept; each point gets dir/<its overrides>")
    root = tree.get("dir") or os.path.join("runs", "sweeps", os.path.splitext(os.path.basename(path))[0])
    slurm = tree.get("slurm") or []
    if not isinstance(root, str) or not isinstance(slurm, list):
        raise ConfigError(f"{path}: dir must be a path and slurm a list of #SBATCH options")

    zip_rows = list(zip(*zipped.values())) or [()]
    points, names = [], {}
    for index, (grid_row, zip_row) in enumerate(itertools.product(itertools.product(*grid.values()), zip_rows)):
        values = {k: _cli(v) for k, v in zip(keys, grid_row + zip_row)}
        name = _dir_name(values)
        if name in names:
            raise ConfigError(f"{path}: points {names[name]} and {index} get the same directory name {name!r}")
        names[name] = index
        run_dir = storage.join(root, name)
        try:
            cfg = load_config(base, [*common, *(f"{k}={v}" for k, v in values.items()), f"run.dir={run_dir}"])
        except ConfigError as e:
            raise ConfigError(f"{path}: point {name}: {e}") from None
        points.append(Point(index, name, values, run_dir, cfg))
    return Sweep(path, base, common, root, keys, points, [str(s) for s in slurm])


def command(sweep: Sweep, point: Point, python: str = sys.executable, train_py: str = TRAIN_PY) -> list[str]:
    overrides = [*sweep.overrides, *(f"{k}={v}" for k, v in point.values.items()), f"run.dir={point.run_dir}"]
    return [python, train_py, "--config", sweep.base, *overrides]


def finished(point: Point) -> bool:
    from ops.goodput import read_summary  # here, not at the top: ops imports JAX, which the sweep itself needs not

    summary = read_summary(point.run_dir)
    return bool(summary) and summary.get("final_step") == point.cfg.train.steps


def _run_point(sweep: Sweep, point: Point) -> tuple[int, bool]:
    """Runs one point in its own process (own session: a terminal's Ctrl-C reaches the sweep,
    which passes it on once), its output shown and appended to run_dir/train.log. Returns its
    exit status and whether the sweep was asked to stop meanwhile. On a bucket, train.log is
    rewritten whole every few seconds and at the point's end (storage.AppendLog)."""
    storage.makedirs(point.run_dir)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        command(sweep, point), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        start_new_session=True,
    )

    stopped = False

    def forward(signum: int, frame: Any) -> None:
        nonlocal stopped
        stopped = True
        proc.send_signal(signum)  # the trainer checkpoints and exits; the sweep then stops

    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    # The command's wake-up pipe (configs.interrupt) would end the sweep at once, before the point
    # has checkpointed and the summary is written: set aside while the point owns the signals.
    wakeup = signal.set_wakeup_fd(-1)
    log = storage.AppendLog(storage.join(point.run_dir, "train.log"), storage.REMOTE_FLUSH_S)
    try:
        for line in proc.stdout:
            sys.stdout.write(line)
            log.append(line.rstrip("\n"))
        return proc.wait(), stopped
    finally:
        log.flush()
        for s, handler in previous.items():
            signal.signal(s, handler)
        signal.set_wakeup_fd(wakeup)


def run_sweep(sweep: Sweep) -> int:
    """Runs every unfinished point; writes the summaries. 0: all done; 1: some failed; a
    point's preemption code when the sweep itself was asked to stop."""
    failed: list[Point] = []
    n = len(sweep.points)
    for point in sweep.points:
        head = f"[sweep {point.index + 1}/{n}] {point.name}"
        if finished(point):
            print(f"{head}: finished earlier (step {point.cfg.train.steps}), skipped", flush=True)
            continue
        print(f"{head}: {point.run_dir}", flush=True)
        code, stopped = _run_point(sweep, point)
        if stopped:
            print(f"{head}: stopped (exit {code}); run the same command to resume the sweep", flush=True)
            summarize(sweep, failed)
            return code
        if code != 0:
            print(f"{head}: FAILED (exit {code}); see {storage.join(point.run_dir, 'train.log')}", flush=True)
            failed.append(point)
    print(summarize(sweep, failed), flush=True)
    if failed:
        print(f"{len(failed)} of {n} points failed: {', '.join(p.name for p in failed)}", flush=True)
    return 1 if failed else 0


def emit_slurm(sweep: Sweep) -> tuple[str, str]:
    """Writes dir/commands.txt (one command per point) and dir/sweep.sbatch (an array job whose
    task i runs point i). Returns their paths."""
    os.makedirs(sweep.dir, exist_ok=True)
    train_py = os.path.relpath(TRAIN_PY)
    commands = [command(sweep, p, python="python", train_py=train_py) for p in sweep.points]
    listing = os.path.join(sweep.dir, "commands.txt")
    with open(listing, "w") as f:
        f.writelines(shlex.join(c) + "\n" for c in commands)
    script = os.path.join(sweep.dir, "sweep.sbatch")
    stem = os.path.splitext(os.path.basename(sweep.path))[0]
    lines = [
        "#!/bin/bash",
        f"# The sweep {sweep.path}: array task i runs point i (line i+1 of commands.txt).",
        "# Each point resumes from its own checkpoints, so resubmitting continues the sweep.",
        f"#SBATCH --job-name=sweep-{stem}",
        f"#SBATCH --array=0-{len(commands) - 1}",
        f"#SBATCH --output={os.path.abspath(sweep.dir)}/slurm-%A_%a.out",
        *(f"#SBATCH {opt}" for opt in sweep.slurm),
        "set -euo pipefail",
        f"cd {shlex.quote(os.getcwd())}",
        'PYTHON="${PYTHON:-python}"',
        'case "$SLURM_ARRAY_TASK_ID" in',
        *(f'  {i}) exec "$PYTHON" {shlex.join(c[1:])} ;;' for i, c in enumerate(commands)),
        '  *) echo "no point $SLURM_ARRAY_TASK_ID in this sweep" >&2; exit 2 ;;',
        "esac",
    ]
    with open(script, "w") as f:
        f.write("\n".join(lines) + "\n")
    os.chmod(script, 0o755)
    return script, listing


def _fmt(value: float | None, spec: str) -> str:
    return "" if value is None else format(value, spec)


def _pct(value: float | None) -> str:
    return "" if value is None else f"{100 * value:.1f}%"


def _row(point: Point, failed: bool) -> dict[str, Any]:
    from ops.goodput import read_summary
    from ops.observe import last_value, read_metrics

    summary = read_summary(point.run_dir) or {}
    records = read_metrics(point.run_dir)
    loss, held_out = last_value(records, "loss"), last_value(records, "eval_loss")
    step = summary.get("final_step", loss[0] if loss else 0)
    if failed:
        status = "failed"
    elif summary and step == point.cfg.train.steps:
        status = "done"
    else:
        status = "partial" if records else "not run"
    last_speed = last_value(records, "tokens_per_s")
    last_mfu = last_value(records, "mfu")
    return {
        "point": point.name,
        **point.values,
        "status": status,
        "step": step,
        "loss": loss[1] if loss else None,
        "eval_loss": held_out[1] if held_out else None,
        "tokens_per_s": summary.get("tokens_per_s") or (last_speed[1] if last_speed else None),
        "mfu": summary.get("mfu") or (last_mfu[1] if last_mfu else None),
        "goodput": summary.get("goodput"),
    }


def summarize(sweep: Sweep, failed: list[Point] = ()) -> str:
    """Writes dir/summary.csv, dir/summary.md and dir/loss_curves.png; returns the Markdown."""
    storage.makedirs(sweep.dir)
    failed_names = {p.name for p in failed}
    rows = [_row(p, p.name in failed_names) for p in sweep.points]
    table_csv = io.StringIO(newline="")
    writer = csv.DictWriter(table_csv, fieldnames=list(rows[0]))
    writer.writeheader()
    writer.writerows({k: "" if v is None else v for k, v in r.items()} for r in rows)
    storage.write_text(storage.join(sweep.dir, "summary.csv"), table_csv.getvalue())
    with_eval = any(r["eval_loss"] is not None for r in rows)
    header = ["point", "status", "step", "final loss", *(["eval loss"] if with_eval else [])]
    header += ["tokens/s", "MFU", "goodput"]
    table = [f"| {' | '.join(header)} |", "|" + " --- |" * len(header)]
    for r in rows:
        cells = [f"`{r['point']}`", r["status"], str(r["step"]), _fmt(r["loss"], ".4f")]
        cells += [_fmt(r["eval_loss"], ".4f")] if with_eval else []
        cells += [_fmt(r["tokens_per_s"], ",.0f"), _pct(r["mfu"]), _pct(r["goodput"])]
        table.append(f"| {' | '.join(cells)} |")
    intro = f"# Sweep {sweep.path}\n\nbase `{sweep.base}`, run directories under `{sweep.dir}`\n\n"
    markdown = intro + "\n".join(table)
    storage.write_text(storage.join(sweep.dir, "summary.md"), markdown + "\n")
    from ops.plot import plot_runs

    plot_runs([p.run_dir for p in sweep.points], storage.join(sweep.dir, "loss_curves.png"),
              labels=[p.name for p in sweep.points], title=f"sweep {os.path.basename(sweep.path)}")
    return markdown


def main(path: str | None, config: str | None, overrides: list[str], emit: str | None, summarize_only: bool) -> int:
    """`train.py --sweep`: 2 for a bad sweep file or command line, before anything runs."""
    try:
        if not path:
            raise ConfigError("--emit and --summarize need --sweep FILE")
        if config:
            raise ConfigError("--sweep takes the config from the sweep file's base:, not --config")
        sweep = load_sweep(path, overrides)
        if storage.is_remote(sweep.dir):
            if emit:
                raise ConfigError(f"{path}: dir={sweep.dir}: --emit slurm writes a batch script and its logs for "
                                  "sbatch, which reads a shared filesystem; give the sweep a local dir")
            check_output(sweep.dir, f"{path}: dir")  # its bucket answers, before any point runs
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if emit:
        script, listing = emit_slurm(sweep)
        print(f"wrote {script} ({len(sweep.points)} array tasks) and {listing}; submit with: sbatch {script}")
        return 0
    if summarize_only:
        print(summarize(sweep))
        return 0
    return run_sweep(sweep)


def cli(argv: list[str] | None = None) -> int:
    """`python sweep.py FILE [--emit slurm | --summarize] [key=value ...]`, the same as `python train.py
    --sweep FILE ...`."""
    parser = argparse.ArgumentParser(prog="python sweep.py", description="Run every point of a sweep file "
                                     "(configs/sweeps/) in turn, each in its own train.py process.")
    parser.add_argument("file", help="the sweep file")
    parser.add_argument("--emit", choices=["slurm"], help="write a SLURM array job instead of running")
    parser.add_argument("--summarize", action="store_true", help="only rewrite the summary and plot")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides for every point")
    args = parser.parse_args(argv)
    return main(args.file, None, args.overrides, args.emit, args.summarize)


if __name__ == "__main__":
    sys.exit(guarded(cli, KEPT))

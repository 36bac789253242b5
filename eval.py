"""Run lm-evaluation-harness tasks on a run's checkpoint: `python eval.py --run-dir RUN --tasks T`.

    python eval.py --run-dir RUN --tasks TASK[,TASK...] [--step N] [--limit N] [--tasks-dir DIR]
                   [--output FILE]

Reads the run's `config.yaml` and the parameters of its newest (or `--step`) checkpoint, sharded
on the run's own mesh, and runs the tasks through the harness model of evaluation/harness.py: local
YAML tasks of `--tasks-dir` (default: the run's `eval.tasks_dir`, configs/eval/) or the harness's
own (their data from the Hugging Face Hub). Prints one line per score and the requests per
second; `--output` also writes them as JSON. Exit status 2 for bad input (an unknown task, a
missing data file, a run dir without checkpoints), one line, before anything is compiled.
An entry point above the packages, like train.py.
"""

from __future__ import annotations

from configs import handle_interrupts

# What a signal before the command finishes leaves.
KEPT = "no scores were written; run the same command again"

if __name__ == "__main__":  # before the imports below (pydantic, JAX): a signal while they load gets the line too
    handle_interrupts(KEPT)

import argparse
import os
import sys
import time
from typing import TYPE_CHECKING

from configs import ConfigError, check_output, guarded

if TYPE_CHECKING:  # the real imports wait until the arguments are checked: importing JAX takes a while
    import jax

    from data.tokenizer import Tokenizer
    from trainer import RunSpec
    from evaluation.tasks import Tasks


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python eval.py", description="Run harness tasks on a run's checkpoint.")
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--tasks", required=True, help="comma-separated task names")
    parser.add_argument("--step", type=int, help="the checkpoint step (default: the newest)")
    parser.add_argument("--limit", type=int, default=0, help="the first N examples of each task (0: all)")
    parser.add_argument("--tasks-dir", help="folder of local task YAMLs (default: the run's eval.tasks_dir)")
    parser.add_argument("--output", help="also write the scores to this JSON file")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # The harness's progress bars off; tqdm reads this when it is first imported.
    os.environ.setdefault("TQDM_DISABLE", "1")
    names = [t.strip() for t in args.tasks.split(",") if t.strip()]
    try:
        if not names:
            raise ConfigError("--tasks: name at least one task")
        if args.limit < 0:
            raise ConfigError(f"--limit: must be >= 0, got {args.limit}")
        from evaluation.task_names import check_run_tasks  # a misspelt task: refused before JAX and the harness

        check_run_tasks(names, args.run_dir, args.tasks_dir, "--tasks")
        from trainer.checkpoint import find_checkpoint  # after the arguments: importing JAX takes a while

        cfg, step = find_checkpoint(args.run_dir, args.step)
        check_output(args.output or "", "--output", file=True)  # a local file, or a bucket that answers
        import jax
        from data.tokenizer import load_tokenizer
        from trainer import check_devices, prepare
        from evaluation.tasks import resolve_tasks
        from ops.xla_env import set_cpu_device_count, set_default_flags

        set_default_flags()
        why_not = set_cpu_device_count(cfg)
        tasks = resolve_tasks(names, args.tasks_dir or cfg.eval.tasks_dir, key="--tasks")
        devices = jax.devices()
        check_devices(cfg, devices, why_not)
        spec = prepare(cfg, len(devices), with_data=False)
        tokenizer = load_tokenizer(cfg.data.tokenizer)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return evaluate(args, spec, devices, step, tasks, tokenizer)


def evaluate(args: argparse.Namespace, spec: RunSpec, devices: list[jax.Device], step: int, tasks: Tasks,
             tokenizer: Tokenizer) -> int:
    """Restores the checkpoint on the run's mesh, runs the tasks, prints and writes the scores."""
    from trainer.checkpoint import restore_params
    from evaluation.harness import MeshLM
    from trainer.scoring import evaluator_of
    from trainer.program import make_program
    from evaluation.tasks import run_tasks, write_scores

    program = make_program(spec, devices)
    _, _, params = restore_params(args.run_dir, step, shardings=program.state_sh.params)
    lm = MeshLM(evaluator_of(program, params), tokenizer, spec.cfg.model)
    t0 = time.perf_counter()
    scores = run_tasks(lm, tasks, args.limit)
    seconds = time.perf_counter() - t0
    for key, value in scores.items():
        print(f"{key.removeprefix('task/')} {value:.4f}")
    rate = lm.requests_done / max(seconds, 1e-9)
    print(f"step {step}: {lm.requests_done} requests in {seconds:.1f} s ({rate:.1f} requests/s)")
    if args.output:
        write_scores(args.output, {"step": step, "scores": scores, "requests": lm.requests_done, "seconds": seconds})
    return 0


if __name__ == "__main__":
    sys.exit(guarded(main, KEPT))

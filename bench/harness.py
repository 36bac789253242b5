"""Requests per second of the lm-evaluation-harness model (evaluation/harness.py) on a config's model.

    python -m bench.harness                                    # the tiny preset, the local tasks
    python -m bench.harness --config configs/tiny.yaml --tasks stdlib_words --repeats 3

Each task runs `--repeats` times through the harness on freshly initialized parameters (the rate
does not depend on their values) on the config's mesh: the first run includes the compiles of the
scoring step (one per padded length), the later ones only run it. Prints a Markdown table row per
task: requests, the first run's seconds, the median later run's seconds, the part of them spent
in the model (packing, the scoring step, reading its results) and the requests/s of a later run
(the harness's own work, building the requests from the documents, included).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from configs import ConfigError, load_config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.harness", description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="tiny")
    parser.add_argument("--tasks", default="stdlib_words,stdlib_docstrings")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--limit", type=int, default=0, help="examples per task (0: all)")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    args = parser.parse_args(argv)
    os.environ.setdefault("TQDM_DISABLE", "1")  # before tqdm is first imported
    import jax

    from data.tokenizer import load_tokenizer
    from evaluation.harness import MeshLM
    from trainer.scoring import evaluator_of
    from trainer.program import abstract_program
    from trainer.state import init_state
    from evaluation.tasks import each_task, resolve_tasks, run_tasks
    from ops.xla_env import set_cpu_device_count, set_default_flags

    try:
        cfg = load_config(args.config, args.overrides)
        set_default_flags()
        set_cpu_device_count(cfg)
        tasks = resolve_tasks([t for t in args.tasks.split(",") if t], cfg.eval.tasks_dir, key="--tasks")
        program = abstract_program(cfg)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    state = init_state(cfg.model, program.tx, cfg.run.seed, program.state_sh)
    lm = MeshLM(evaluator_of(program, state.params), load_tokenizer(cfg.data.tokenizer), cfg.model)
    print(f"{len(jax.devices())} {jax.devices()[0].platform} device(s); buckets {lm.ev.buckets}, "
          f"{lm.ev.rows} rows each")
    print("| task | requests | first run s (compiles) | later runs s | of which the model s | requests/s |")
    print("| --- | --- | --- | --- | --- | --- |")
    for one in each_task(tasks):
        seconds, model, requests = [], [], 0
        for _ in range(max(args.repeats, 2)):
            before, in_model = lm.requests_done, lm.model_seconds
            t0 = time.perf_counter()
            run_tasks(lm, one, args.limit)
            seconds.append(time.perf_counter() - t0)
            model.append(lm.model_seconds - in_model)
            requests = lm.requests_done - before
        later = statistics.median(seconds[1:])
        print(f"| {one.names[0]} | {requests} | {seconds[0]:.2f} | {later:.2f} | {statistics.median(model[1:]):.2f} | "
              f"{requests / later:.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

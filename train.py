"""Entry point: `python train.py [--config FILE] [dotted.key=value ...]`, or
`python train.py --sweep FILE [--emit slurm | --summarize] [dotted.key=value ...]` (sweep),
or `python train.py --help-config` (every key, its type, default and meaning).

Parses the command line, loads the config and hands it to the trainer. Exit status: 0 done;
2 bad input or a run.dir in use by a live run (one line naming the key, file or holder, before
anything is compiled or written);
`train.preempt_exit_code` (143) after SIGTERM, 130 after SIGINT, with the checkpoint committed (a
signal before the loop: one line, 143 or 130, nothing trained); 3 too
many non-finite steps; 4 a step past `train.step_timeout_s`; 5 a peer process lost; 6 this
run's run.dir lock taken over by another run; 7 a bucket run.dir's object store stopped answering
past its clients' retries (one line naming run.dir and the last committed step; the lock is left
for the next run, which resumes from that step).
"""

from __future__ import annotations

from configs import handle_interrupts

# What an interrupted start-up leaves: the loop's own stop says which step it committed.
KEPT = ("stopped before the training loop; checkpoints already in run.dir are intact (a save in flight is never "
        "read); run the same command to start or resume")

if __name__ == "__main__":  # before the imports below (pydantic, JAX): a signal while they load gets the line too
    handle_interrupts(KEPT)

import argparse
import gc
import os
import sys

from configs import ConfigError, guarded, load_config


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Train a decoder LM sharded over the mesh the config describes.",
        epilog="Overrides are dotted config keys, e.g. mesh.fsdp=2 train.steps=50 run.dir=runs/a",
    )
    parser.add_argument("--config", help="a YAML preset (a path, or a name in configs/ such as 'tiny')")
    parser.add_argument("--sweep", metavar="FILE", help="run every point of a sweep file (configs/sweeps/) in turn")
    parser.add_argument("--emit", choices=["slurm"], help="with --sweep: write a SLURM array job instead of running")
    parser.add_argument("--summarize", action="store_true", help="with --sweep: only rewrite the summary and plot")
    parser.add_argument("--help-config", action="store_true",
                        help="list every config key with its type, default and meaning, and exit")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.help_config:  # before anything imports JAX: the listing is the schema's alone
        from configs.doc import text

        print(text())
        return 0
    if args.sweep or args.emit or args.summarize:
        import sweep

        return sweep.main(args.sweep, args.config, args.overrides, args.emit, args.summarize)
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if cfg.eval.tasks:  # the harness's progress bars off; tqdm reads this when it is first imported
        os.environ.setdefault("TQDM_DISABLE", "1")
    import trainer  # after the config is known good: importing JAX takes a while

    try:
        trainer.set_default_flags()
        trainer.run(cfg)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except trainer.Preempted as e:
        return e.exit_code
    except trainer.RunStopped as e:
        if e.exit_at_once:
            trainer.exit_at_once(str(e), e.exit_code)
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    return 0


def exit_quickly(code: int) -> None:
    """Exits with `code`, sparing the interpreter's teardown its garbage collections: they walk
    every object JAX, Flax, Orbax and Grain hold (0.25-0.4 CPU s a process, for memory the OS
    takes back anyway). One collection first, so what is garbage by now is finalized as before;
    atexit handlers and the objects freed when modules are cleared run as always."""
    gc.collect()
    gc.freeze()
    sys.exit(code)


if __name__ == "__main__":
    exit_quickly(guarded(main, KEPT))

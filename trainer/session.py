"""From a checked `RunSpec` to the `Session` a loop drives, on the real mesh.

`reread` reads run.dir again once its lock is held (`trainer.checkpoint.RunDir`: a run alive at
`prepare`'s read may have saved since) and resolves what depends on it: the config must still fit
the checkpoints, and the learning-rate schedule's horizon (`resolve_schedule`). `make_session`
builds the program, the checkpointer (with the local tier, trainer.tiers), the objective's stage
(what the checkpoints hold of it), this process's data iterator and held-out rows, and the state
through `initial_state` (trainer/restore.py), the one place that decides where it comes from;
then writes the resolved config into run.dir.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import numpy as np

from configs import Config
from data import describe, eval_batches, make_iterator
from model import stack_layers
from ops.metrics import log
from trainer.checkpoint import Checkpointer, RunDir, check_resumable, read_run, write_config
from trainer.program import Program, make_program
from trainer.restore import checkpointer, initial_state
from trainer.spec import RunSpec
from trainer.startup import log_layout
from trainer.state import TrainState

# The optim keys that shape the learning-rate schedule.
SCHEDULE_KEYS = ("lr", "warmup_steps", "schedule", "min_lr_ratio", "decay_steps")


@dataclasses.dataclass
class Session:
    """What the loop drives, on the real mesh: the compiled-to-be program, the state it starts
    from (restored or new), that step, this process's data iterator, the checkpointer, the
    held-out rows and where the state came from (`Start.origin`)."""

    program: Program
    state: TrainState
    start: int
    iterator: Any  # the Grain iterator of this process's rows
    ckpt: Checkpointer
    eval_rows: list[dict[str, np.ndarray]]  # this process's rows of the held-out batches; [] = no eval
    origin: str = ""  # trainer.restore.Start.origin
    # The objective's maker of each step's batch on the host (trainer.objectives.registry.Stage;
    # None: the data's batches), given back what the checkpoint resumed carried for it.
    stage: Any = None


def resolve_schedule(cfg: Config, found: RunDir) -> tuple[Config, str]:
    """`cfg` with `optim.decay_steps` resolved: as set; else, resuming, the horizon of the
    checkpoints' config (`found.saved`: a longer train.steps continues the schedule the run was
    on); else train.steps. Also the line to print on resume when the schedule differs from the
    checkpoints' or its horizon from train.steps ("" otherwise)."""
    saved, note = found.saved, ""
    if saved is None:
        horizon = cfg.optim.decay_steps or cfg.train.steps
    else:
        kept = saved.optim.decay_steps or saved.train.steps  # 0: written before it was resolved
        horizon = cfg.optim.decay_steps or kept
        old = dataclasses.replace(saved.optim, decay_steps=kept)
        new = dataclasses.replace(cfg.optim, decay_steps=horizon)
        changed = [f"optim.{k} {getattr(old, k)} -> {getattr(new, k)}" for k in SCHEDULE_KEYS
                   if getattr(old, k) != getattr(new, k)]
        if changed:
            note = f"the learning-rate schedule changes on this resume: {', '.join(changed)}"
        elif horizon != cfg.train.steps:
            note = (f"the learning-rate schedule keeps its horizon optim.decay_steps={horizon} (train.steps="
                    f"{cfg.train.steps}): set optim.decay_steps to change it")
    return dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, decay_steps=horizon)), note


def reread(spec: RunSpec) -> tuple[RunSpec, str]:
    """`spec` with run.dir read again (call it holding run.dir's lock) and its config's schedule
    resolved from the checkpoints it resumes; and the schedule's resume note (resolve_schedule).
    Raises ConfigError if the config no longer fits the checkpoints found."""
    found = read_run(spec.cfg, spec.layout.sizes)
    check_resumable(spec.cfg, found)
    cfg, note = resolve_schedule(spec.cfg, found)
    return dataclasses.replace(spec, cfg=cfg, rundir=found), note


def _eval_rows(cfg: Config, source: Any, held_out: Callable) -> list[dict[str, np.ndarray]]:
    """This process's rows of the held-out batches, by `held_out` (data.eval_batches); [] = no eval."""
    if cfg.eval.every and source.eval is None:
        log(f"warning: eval.every={cfg.eval.every} but data.source={cfg.data.source} has no held-out split; no eval")
    elif cfg.eval.every:
        return held_out(source, cfg.train.global_batch, cfg.eval.batches, cfg.run.seed, jax.process_index(),
                        jax.process_count())
    return []


def make_session(spec: RunSpec, devices: list, schedule_note: str = "", held_out: Callable = eval_batches) -> Session:
    """Builds the program, restores the newest readable checkpoint or creates the state, sharded
    (initial_state); then writes the resolved config into run.dir. `spec.rundir` is run.dir as
    read last (`reread` under the lock); `held_out` reads the held-out rows (trainer.loop passes
    its own name for data.eval_batches, which tests record through)."""
    cfg, layout, source, found = spec.cfg, spec.layout, spec.source, spec.rundir
    if found is None:
        raise ValueError("make_session needs a RunSpec prepared with data (trainer.program.prepare)")
    program = make_program(spec, devices)
    ckpt = checkpointer(program)
    stage = spec.objective.stage(spec.model.graphdef, program.compute)
    if stage is not None:
        ckpt.attach_stage(stage, program.abstract_batch())
    iterator = make_iterator(cfg, source)
    log(describe(source, cfg, spec.objective.data_format))
    eval_rows = _eval_rows(cfg, source, held_out)
    log_layout(spec, devices)
    try:
        start = initial_state(program, ckpt, iterator, found)
        if start.resumed and schedule_note and start.step < cfg.train.steps:
            log(schedule_note)
        if start.step < cfg.train.steps:  # a run with nothing to do leaves run.dir as it was
            write_config(cfg, found, start.step)
        if layout.pipelined:
            log(
                f"pipeline: {layout.stages} stages x {layout.repeats} repeat(s), {layout.microbatches} microbatches, "
                f"{stack_layers(cfg.model) // (layout.stages * layout.repeats)} layers per stage and repeat; "
                f"bubble fraction {layout.bubble:.3f}"
            )
    except BaseException:
        ckpt.close()  # its library log too: the console gets its printers back for the error
        raise
    return Session(program, start.state, start.step, iterator, ckpt, eval_rows, start.origin, stage)

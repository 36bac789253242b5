"""A config checked against a device count and the files it names: `prepare` does every check
bad input can fail (the objective's rules, mesh, divisibility, batch, pipeline, resume, Hugging
Face checkpoint, data path, eval tasks) before anything is compiled or written, and returns the
`RunSpec`: the config, its layout, what it trains, the abstract model, the data source.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

import pipeline
from configs import Config, ConfigError
from data import open_source
from sharding import Rules
from trainer import objectives
from trainer.checkpoint import RunDir, read_run
from trainer.checks import check_divisible
from trainer.files import check_files, check_storage, check_tasks
from trainer.layout import Layout, plan_layout
from trainer.objectives import Objective
from trainer.state import AbstractModel, abstract_model


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """A config checked against a device count: its layout, the model's abstract parameters and
    the data source (None when checked without data). `prepare` makes one; everything built from
    it (the program, the run) reads these fields here and keeps no copy."""

    cfg: Config
    layout: Layout
    model: AbstractModel
    objective: Objective  # what it trains (trainer/objectives/)
    source: Any = None
    tasks: Any = None  # eval.tasks checked (evaluation.tasks.Tasks); None: none
    frozen: AbstractModel | None = None  # the objective's frozen weights (`objective.frozen`), if any
    rundir: RunDir | None = None  # run.dir as the checks read it (trainer.checkpoint); None: checked without data


def frozen_rules(layout: Layout) -> Rules:
    """How a frozen network of its own (a teacher) is stored: by the parameters' rules, but with
    its layer stack whole on every pipeline stage. It runs outside the pipeline, with the model's
    own scan, and its depth need not divide the stages."""
    return tuple((name, None if name == "layers" else axes) for name, axes in layout.param_rules)


def frozen_model(objective: Objective, model: AbstractModel, layout: Layout) -> AbstractModel | None:
    """The abstract network of the objective's frozen weights: the model's own for a copy of the
    starting weights, else their own (a teacher), checked to shard by the run's rules."""
    frozen = objective.frozen
    if frozen is None or frozen.load is None:
        return None if frozen is None else model
    ref = abstract_model(frozen.model)
    try:
        check_divisible(ref.shapes, ref.axes, frozen_rules(layout), layout.sizes)
    except ConfigError as e:
        raise ConfigError(f"{frozen.key}: its {e}") from None
    return ref


def prepare(cfg: Config, num_devices: int, with_data: bool = True, found: RunDir | None = None) -> RunSpec:
    """All checks that need devices or files. Raises ConfigError; creates and compiles nothing.
    With data, run.dir is read once here (`found`, if the caller has read it already) and kept in
    the spec; the run reads it again under its lock (trainer.session.reread)."""
    objective = objectives.build(cfg)
    layout = plan_layout(cfg, num_devices, jax.process_count())
    objective.check_schedule(layout.pipelined and pipeline.get(layout.schedule).computes_grads)
    model = abstract_model(cfg.model)
    check_divisible(model.shapes, model.axes, layout.param_rules, layout.sizes)
    frozen = frozen_model(objective, model, layout)
    if not with_data:
        return RunSpec(cfg, layout, model, objective, frozen=frozen)
    if found is None:
        check_storage(cfg)  # a missing bucket is one line, not a traceback from the first read
        found = read_run(cfg, layout.sizes)
    check_files(cfg, found)
    return RunSpec(cfg, layout, model, objective, open_source(cfg, objective.data_format), check_tasks(cfg), frozen,
                   found)

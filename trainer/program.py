"""A config's train step as a program, built in two stages.

`prepare` does every check that bad input can fail (mesh, divisibility, batch, pipeline, resume,
Hugging Face checkpoint, data path) before anything is compiled or written, and returns the
`RunSpec`: the config, its layout on the device count, the abstract model, the data source.
`make_program` puts a `RunSpec` on devices: the `Program` holds it with the mesh, shardings, the
jitted step and its ahead-of-time compile (on real devices, or abstractly for planning).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
import optax
from jax.sharding import AbstractMesh, Mesh, NamedSharding

import pipeline
from configs import Config, ConfigError
from data import batch_fields, batch_shape, open_source
from sharding import (
    activation_rules,
    axes_size,
    batch_sharding,
    make_mesh,
    mesh_axes,
    resolve_mesh_shape,
    shardings,
    to_rules,
)
from sharding.cast import cast_for_compute
from model import hf
from model.lora import trainable
from trainer import objectives
from trainer.checkpoint import RunDir, check_resumable, read_run_dir
from trainer.checks import check_divisible
from trainer.compute import Compute, build_compute
from trainer.layout import Layout, plan_layout
from trainer.objectives import Objective
from trainer.optimizer import make_optimizer
from trainer.state import AbstractModel, TrainState, abstract_model, abstract_state, state_shardings
from trainer.step import make_train_step
from trainer.tiers import check_local_dir
from ops.trackers import check_trackers


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


def frozen_model(objective: Objective, model: AbstractModel, layout: Layout) -> AbstractModel | None:
    """The abstract network of the objective's frozen weights: the model's own for a copy of the
    starting weights, else their own (a teacher), checked to shard by the run's rules."""
    frozen = objective.frozen
    if frozen is None or frozen.load is None:
        return None if frozen is None else model
    ref = abstract_model(frozen.model)
    try:
        check_divisible(ref.shapes, ref.axes, layout.param_rules, layout.sizes)
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
    found = read_run_dir(cfg.run.dir) if found is None else found
    check_resumable(cfg, found)
    check_local_dir(cfg)
    check_trackers(cfg)
    # Once the run has checkpoints it resumes from them; a LoRA run's hold no base, read from init.from_hf again.
    if cfg.init.from_hf and (not found.checkpoints or cfg.model.lora.enabled):
        hf.check_compatible(cfg.model, cfg.init.from_hf)
    return RunSpec(cfg, layout, model, objective, open_source(cfg, objective.data_format), check_tasks(cfg), frozen,
                   found)


def check_tasks(cfg: Config) -> Any:
    """eval.tasks found, with their data files (evaluation.tasks.Tasks), or None without any.
    Raises ConfigError; lm-evaluation-harness is imported only for a run that names tasks."""
    if not cfg.eval.tasks:
        return None
    try:
        from evaluation.tasks import resolve_tasks
    except ImportError as e:
        raise ConfigError(f"eval.tasks: needs lm-evaluation-harness ({e}): pip install 'meshlm[eval]'") from None
    return resolve_tasks(cfg.eval.tasks, cfg.eval.tasks_dir)


def sharded_optimizer(spec: RunSpec, mesh: Mesh | AbstractMesh) -> tuple[optax.GradientTransformation, Callable,
                                                                           TrainState]:
    """The optimizer, its learning-rate schedule, and the state's shardings on `mesh` (a real one,
    or an abstract one for counting bytes without devices)."""
    tx, schedule = make_optimizer(spec.cfg.optim, spec.cfg.train.steps, trainable(spec.model.axes),
                                  spec.cfg.model.moe.router_bias_update_rate)
    params = shardings(spec.model.axes, spec.layout.param_rules, mesh)
    ref = None if spec.frozen is None else shardings(spec.frozen.axes, spec.layout.param_rules, mesh)
    return tx, schedule, state_shardings(tx, spec.model.shapes, params, mesh, ref)


@dataclasses.dataclass
class Program:
    """The train step of a `RunSpec` on a mesh: its shardings, the jitted step and eval loss."""

    spec: RunSpec
    mesh: Mesh
    tx: optax.GradientTransformation
    state_sh: TrainState  # of NamedShardings
    batch_sh: NamedSharding
    compute: Compute  # how the step computes (trainer/compute.py)
    step: Callable  # jitted, state donated
    eval_loss: Callable  # jitted (params, ref_params, batch) -> the objective's eval sums, no update

    def abstract_state(self) -> TrainState:
        return abstract_state(self.tx, self.spec.model.shapes, self.state_sh,
                              None if self.spec.frozen is None else self.spec.frozen.shapes)

    @property
    def init_sh(self) -> TrainState:
        """The shardings a new state is created with (init_state, state_from_params): loaded
        frozen weights (a teacher) are left out, to join by `with_frozen`."""
        frozen = self.spec.objective.frozen
        return self.state_sh if frozen is None or frozen.load is None else self.state_sh.replace(ref_params=None)

    def with_frozen(self, state: TrainState) -> TrainState:
        """A new state with the objective's loaded frozen weights, placed (as it is without any)."""
        frozen = self.spec.objective.frozen
        if frozen is None or frozen.load is None:
            return state
        return state.replace(ref_params=frozen.load(self.state_sh.ref_params))

    def abstract_batch(self) -> dict[str, jax.ShapeDtypeStruct]:
        cfg = self.spec.cfg
        fmt = self.spec.objective.data_format
        shape = batch_shape(cfg, fmt)
        return {f: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=self.batch_sh) for f in batch_fields(cfg, fmt)}

    @contextlib.contextmanager
    def tracing(self) -> Iterator[None]:
        """What binds while the step and eval loss trace: the model's activation constraints."""
        with activation_rules(self.mesh, self.spec.layout.act_rules):
            yield

    def lower(self, state: Any = None) -> jax.stages.Lowered:
        with self.tracing():
            return self.step.lower(self.abstract_state() if state is None else state, self.abstract_batch())

    def compile(self, state: Any = None) -> tuple[jax.stages.Compiled, float]:
        """The compiled step and the seconds it took (tracing and lowering included)."""
        t0 = time.perf_counter()
        compiled = self.lower(state).compile()
        return compiled, time.perf_counter() - t0

    def compile_eval(self) -> jax.stages.Compiled:
        with self.tracing():
            state = self.abstract_state()
            return self.eval_loss.lower(state.params, state.ref_params, self.abstract_batch()).compile()


def make_program(spec: RunSpec, devices: list) -> Program:
    cfg, layout, model = spec.cfg, spec.layout, spec.model
    mesh = make_mesh(layout.sizes, devices, cfg.mesh.nodes, cfg.mesh.across)
    tx, schedule, state_sh = sharded_optimizer(spec, mesh)
    batch_sh = batch_sharding(mesh, layout.act_rules, len(batch_shape(cfg, spec.objective.data_format)))
    cast = functools.partial(cast_for_compute, axes=model.axes, dtype=cfg.model.dtype, shardings=state_sh.params)
    compute = build_compute(cfg, layout, model.graphdef, devices[0].platform, cast)
    step = jax.jit(make_train_step(model.graphdef, tx, schedule, compute=compute, objective=spec.objective),
                   in_shardings=(state_sh, batch_sh), out_shardings=(state_sh, None), donate_argnums=(0,))
    eval_loss = jax.jit(spec.objective.eval_fn(model.graphdef, compute),
                        in_shardings=(state_sh.params, state_sh.ref_params, batch_sh))
    return Program(spec, mesh, tx, state_sh, batch_sh, compute, step, eval_loss)


def abstract_program(cfg: Config, devices: list | None = None) -> Program:
    """The program for `cfg` without data, state or run directory: for inspecting compiles."""
    devices = jax.devices() if devices is None else devices
    return make_program(prepare(cfg, len(devices), with_data=False), devices)


def fill_microbatches(cfg: Config, num_devices: int) -> Config:
    """A pipelined config that names no `pipeline.microbatches` gets as many as the per-replica
    batch allows (the smallest bubble); any other config comes back as it is."""
    sizes = resolve_mesh_shape(cfg.mesh, num_devices)
    if sizes["pipeline"] == 1 or cfg.pipeline.microbatches:
        return cfg
    shards = axes_size(mesh_axes("batch", to_rules(cfg.sharding.activations)), sizes)
    per_replica = max(cfg.train.global_batch // (shards * cfg.train.grad_accum), 1)
    return dataclasses.replace(cfg, pipeline=dataclasses.replace(cfg.pipeline, microbatches=per_replica))

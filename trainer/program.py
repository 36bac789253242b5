"""A config's train step as a program: checked layout, shardings, the jitted step, and its
ahead-of-time compile (on real devices, or abstractly for benchmarks and planning).

`prepare` does every check that bad input can fail (mesh, divisibility, batch, pipeline, resume,
Hugging Face checkpoint, data path) before anything is compiled or written.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from configs import Config, ConfigError
from data import batch_fields, open_source
from sharding import (
    activation_rules,
    axes_size,
    batch_sharding,
    check_divisible,
    make_mesh,
    mesh_axes,
    resolve_mesh_shape,
    shardings,
    to_rules,
)
from sharding.cast import cast_for_compute
from sharding.context import SequenceSplit
from sharding.hlo import COLLECTIVES, static_counts  # noqa: F401  (COLLECTIVES: re-exported)
from model import hf
from trainer.checkpoint import check_resumable, has_checkpoints
from trainer.layout import Layout, expert_dispatcher, layer_runner, plan_layout, scheduled_grads, sequence_split
from trainer.optimizer import make_optimizer
from trainer.state import TrainState, abstract_model, abstract_state, state_shardings
from trainer.step import make_loss_fn, make_train_step
from trainer.trackers import check_trackers


@dataclasses.dataclass
class Prepared:
    """What `prepare` found valid: enough to build the run without checking again."""

    cfg: Config
    layout: Layout
    graphdef: nnx.GraphDef
    shapes: dict
    axes: dict
    source: Any  # the data source; None when prepared without data


def prepare(cfg: Config, num_devices: int, with_data: bool = True) -> Prepared:
    """All checks that need devices or files. Raises ConfigError; creates and compiles nothing."""
    layout = plan_layout(cfg, num_devices)
    if cfg.train.global_batch % jax.process_count():
        raise ConfigError(
            f"train.global_batch={cfg.train.global_batch} is not divisible by the {jax.process_count()} processes"
        )
    graphdef, shapes, axes = abstract_model(cfg.model)
    check_divisible(shapes, axes, layout.param_rules, layout.sizes)
    if not with_data:
        return Prepared(cfg, layout, graphdef, shapes, axes, None)
    check_resumable(cfg)
    check_trackers(cfg)
    if cfg.init.from_hf and not has_checkpoints(cfg.run.dir):  # once the run has checkpoints it resumes from them
        hf.check_compatible(cfg.model, cfg.init.from_hf)
    return Prepared(cfg, layout, graphdef, shapes, axes, open_source(cfg))


@dataclasses.dataclass
class Program:
    cfg: Config
    layout: Layout
    mesh: Mesh
    tx: optax.GradientTransformation
    state_sh: TrainState  # of NamedShardings
    batch_sh: NamedSharding
    shapes: dict
    graphdef: nnx.GraphDef
    runner: Callable | None  # the layer runner (None: the model's scan)
    step: Callable  # jitted, state donated
    eval_loss: Callable  # jitted (params, batch) -> (loss sum, target tokens), no update
    split: SequenceSplit | None = None  # load-balanced order and sharded attention (None: neither)
    grad_fn: Callable | None = None  # the pipeline schedule's (loss, gradients) (None: autodiff)

    def abstract_state(self) -> TrainState:
        return abstract_state(self.tx, self.shapes, self.state_sh)

    def abstract_batch(self) -> dict[str, jax.ShapeDtypeStruct]:
        shape = (self.cfg.train.global_batch, self.cfg.model.seq_len + 1)
        return {f: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=self.batch_sh) for f in batch_fields(self.cfg)}

    def lower(self, state: Any = None) -> jax.stages.Lowered:
        with activation_rules(self.mesh, self.layout.act_rules):  # the model's constraints bind while tracing
            return self.step.lower(self.abstract_state() if state is None else state, self.abstract_batch())

    def compile(self, state: Any = None) -> tuple[jax.stages.Compiled, float]:
        """The compiled step and the seconds it took (tracing and lowering included)."""
        t0 = time.perf_counter()
        compiled = self.lower(state).compile()
        return compiled, time.perf_counter() - t0

    def compile_eval(self) -> jax.stages.Compiled:
        with activation_rules(self.mesh, self.layout.act_rules):
            return self.eval_loss.lower(self.abstract_state().params, self.abstract_batch()).compile()


def make_program(p: Prepared, devices: list) -> Program:
    cfg, layout = p.cfg, p.layout
    mesh = make_mesh(layout.sizes, devices, cfg.mesh.nodes, cfg.mesh.across)
    tx, schedule = make_optimizer(cfg.optim, cfg.train.steps, p.axes)
    state_sh = state_shardings(tx, p.shapes, shardings(p.axes, layout.param_rules, mesh), mesh)
    batch_sh = batch_sharding(mesh, layout.act_rules)
    runner = layer_runner(layout, cfg.model.remat)
    split = sequence_split(cfg, layout, devices[0].platform)
    cast = functools.partial(cast_for_compute, axes=p.axes, dtype=cfg.model.dtype, shardings=state_sh.params)
    grad_fn = scheduled_grads(layout, p.graphdef, cfg.model.remat, cfg.model.loss_chunk, cast)
    dispatch = expert_dispatcher(layout)
    step = jax.jit(
        make_train_step(p.graphdef, tx, schedule, cfg.train.grad_accum, runner, cfg.model.loss_chunk, cast,
                        split, grad_fn, cfg.model.moe, dispatch),
        in_shardings=(state_sh, batch_sh),
        out_shardings=(state_sh, None),
        donate_argnums=(0,),
    )
    eval_loss = jax.jit(make_loss_fn(p.graphdef, runner, cfg.model.loss_chunk, cast, split, dispatch=dispatch),
                        in_shardings=(state_sh.params, batch_sh))
    return Program(cfg, layout, mesh, tx, state_sh, batch_sh, p.shapes, p.graphdef, runner, step, eval_loss, split,
                   grad_fn)


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


def compiled_stats(compiled: jax.stages.Compiled) -> dict[str, float]:
    """Per-device bytes from `memory_analysis()` and FLOPs from `cost_analysis()`, which counts
    the body of a loop (the layer scan, pipeline ticks) once, not once per trip.

    `total_bytes`, the one memory figure of a compile everywhere (planner, benchmarks): arguments,
    temporaries and outputs, less the outputs that reuse a donated argument's buffer."""
    mem = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = (cost[0] if isinstance(cost, list) else cost) or {}  # a deviceless GPU compile has none
    return {
        "argument_bytes": mem.argument_size_in_bytes,
        "output_bytes": mem.output_size_in_bytes,
        "alias_bytes": mem.alias_size_in_bytes,
        "temp_bytes": mem.temp_size_in_bytes,
        "total_bytes": (mem.argument_size_in_bytes + mem.temp_size_in_bytes + mem.output_size_in_bytes
                        - mem.alias_size_in_bytes),
        "xla_flops": cost.get("flops", float("nan")),
    }


def collective_counts(hlo_text: str) -> dict[str, int]:
    """How many collective ops of each kind the compiled HLO holds (async start/done pairs once)."""
    return static_counts(hlo_text)

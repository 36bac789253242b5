"""A config's train step as a program: `make_program` puts a checked `RunSpec` (trainer/spec.py,
`prepare`) on devices, and the `Program` holds it with the mesh, shardings, the jitted step and
eval loss, and its ahead-of-time compile (on real devices, or abstractly for planning).
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

from configs import Config
from data import batch_fields, batch_shape
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
from model.lora import trainable
from trainer.compute import Compute, build_compute
from trainer.optimizer import make_optimizer
from trainer.spec import RunSpec, frozen_rules, prepare
from trainer.state import TrainState, abstract_state, state_shardings
from trainer.step import make_train_step


def sharded_optimizer(spec: RunSpec, mesh: Mesh | AbstractMesh) -> tuple[optax.GradientTransformation, Callable,
                                                                           TrainState]:
    """The optimizer, its learning-rate schedule, and the state's shardings on `mesh` (a real one,
    or an abstract one for counting bytes without devices)."""
    tx, schedule = make_optimizer(spec.cfg.optim, spec.cfg.train.steps, trainable(spec.model.axes),
                                  spec.cfg.model.moe.router_bias_update_rate)
    params = shardings(spec.model.axes, spec.layout.param_rules, mesh)
    # A copy of the starting weights shards as the parameters; a network of its own by frozen_rules.
    own = spec.frozen is not None and spec.objective.frozen.load is not None
    rules = frozen_rules(spec.layout) if own else spec.layout.param_rules
    ref = None if spec.frozen is None else shardings(spec.frozen.axes, rules, mesh)
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

    def abstract_data_batch(self) -> dict[str, jax.ShapeDtypeStruct]:
        """A batch of the data (and of the eval): the objective's corpus format's fields."""
        cfg = self.spec.cfg
        fmt = self.spec.objective.data_format
        shape = batch_shape(cfg, fmt)
        return {f: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=self.batch_sh) for f in batch_fields(cfg, fmt)}

    def abstract_batch(self) -> dict[str, jax.ShapeDtypeStruct]:
        """The batch the step trains on: the data's, or what the objective's stage makes of it."""
        return self.spec.objective.step_batch(self.abstract_data_batch())

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

    def compile_side(self) -> jax.stages.Compiled | None:
        """The objective's program besides the step (GRPO's rollout decoding), compiled on this
        mesh with the parameters' shardings: for the planner. None: the objective has none."""
        made = self.spec.objective.side_program(self.spec.model.graphdef, self.compute)
        if made is None:
            return None
        fn, args = made
        # Arrays of the batch's rows shard as the batch does; scalars and [rows] vectors replicate.
        replicated = NamedSharding(self.mesh, jax.sharding.PartitionSpec())
        shardings = tuple(self.batch_sh if len(a.shape) == 2 else replicated for a in args)
        with self.tracing():
            jitted = jax.jit(fn, in_shardings=(self.state_sh.params, *shardings))
            return jitted.lower(self.abstract_state().params, *args).compile()

    def compile_eval(self) -> jax.stages.Compiled:
        with self.tracing():
            state = self.abstract_state()
            return self.eval_loss.lower(state.params, state.ref_params, self.abstract_data_batch()).compile()


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

"""A config's train step as a program: checked layout, shardings, the jitted step, and its
ahead-of-time compile (on real devices, or abstractly for benchmarks and planning).

`prepare` does every check that bad input can fail (mesh, divisibility, batch, pipeline, resume,
data path) before anything is compiled or written.
"""

from __future__ import annotations

import dataclasses
import re
import time
from collections import Counter
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from configs import Config, ConfigError
from data import batch_fields, open_source
from sharding import activation_rules, batch_sharding, check_divisible, make_mesh, shardings
from trainer.checkpoint import check_resumable
from trainer.layout import Layout, layer_runner, plan_layout
from trainer.optimizer import make_optimizer
from trainer.state import TrainState, abstract_model, abstract_state, state_shardings
from trainer.step import make_loss_fn, make_train_step


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
    eval_loss: Callable  # jitted (params, batch) -> mean loss, no update

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
    mesh = make_mesh(layout.sizes, devices)
    tx, schedule = make_optimizer(cfg.optim, cfg.train.steps, p.axes)
    state_sh = state_shardings(tx, p.shapes, shardings(p.axes, layout.param_rules, mesh), mesh)
    batch_sh = batch_sharding(mesh, layout.act_rules)
    runner = layer_runner(layout, cfg.model.remat)
    step = jax.jit(
        make_train_step(p.graphdef, tx, schedule, cfg.train.grad_accum, runner),
        in_shardings=(state_sh, batch_sh),
        out_shardings=(state_sh, None),
        donate_argnums=(0,),
    )
    eval_loss = jax.jit(make_loss_fn(p.graphdef, runner), in_shardings=(state_sh.params, batch_sh))
    return Program(cfg, layout, mesh, tx, state_sh, batch_sh, p.shapes, p.graphdef, runner, step, eval_loss)


def abstract_program(cfg: Config, devices: list | None = None) -> Program:
    """The program for `cfg` without data, state or run directory: for inspecting compiles."""
    devices = jax.devices() if devices is None else devices
    return make_program(prepare(cfg, len(devices), with_data=False), devices)


COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


def collective_counts(hlo_text: str) -> dict[str, int]:
    """How many collective ops of each kind the compiled HLO holds (async start/done pairs once)."""
    found = Counter()
    for kind in COLLECTIVES:
        # `%name = TYPE kind(operands)`; TYPE may be a tuple with spaces, the name has a `%`.
        found[kind] = len(re.findall(rf" {kind}(?:-start)?\(", hlo_text))
    return dict(found)

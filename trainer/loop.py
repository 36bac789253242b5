"""The training run: check everything, build the sharded state, then loop with hooks.

`prepare` does every check that bad input can fail (mesh, divisibility, batch, data path)
before anything is compiled or written; `run` then creates `run.dir`, restores or creates the
state, compiles the step once ahead of time, and drives it. Logging and checkpointing are
hooks outside `jit`; metrics are read one step late so the device never waits on the host.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from configs import Config, ConfigError, dump_config
from data import global_batches, make_iterator, open_source
from model import flops_per_token
from sharding import (
    activation_rules,
    batch_sharding,
    check_divisible,
    logical_to_spec,
    make_mesh,
    resolve_mesh_shape,
    shardings,
    to_rules,
)
from trainer.checkpoint import Checkpointer, check_resumable
from trainer.metrics import MetricsLogger, log
from trainer.optimizer import make_optimizer
from trainer.state import TrainState, abstract_model, abstract_state, init_state, param_count, state_shardings
from trainer.step import make_train_step


@dataclasses.dataclass
class Prepared:
    """What `prepare` found valid: enough to build the run without checking again."""

    cfg: Config
    mesh_sizes: dict[str, int]
    graphdef: nnx.GraphDef
    shapes: dict
    axes: dict
    source: Any


def prepare(cfg: Config, num_devices: int) -> Prepared:
    """All checks that need devices or files. Raises ConfigError; creates and compiles nothing."""
    sizes = resolve_mesh_shape(cfg.mesh, num_devices)
    act_rules, param_rules = to_rules(cfg.sharding.activations), to_rules(cfg.sharding.params)
    batch_axes = logical_to_spec(("batch",), act_rules)[0] or ()
    batch_axes = batch_axes if isinstance(batch_axes, tuple) else (batch_axes,)
    shards = math.prod(sizes[a] for a in batch_axes)
    need = shards * cfg.train.grad_accum
    if cfg.train.global_batch % need:
        raise ConfigError(
            f"train.global_batch={cfg.train.global_batch} is not divisible by {need} = batch shards "
            f"({' x '.join(f'{a}={sizes[a]}' for a in batch_axes) or '1'}) x train.grad_accum={cfg.train.grad_accum}"
        )
    if cfg.train.global_batch % jax.process_count():
        raise ConfigError(
            f"train.global_batch={cfg.train.global_batch} is not divisible by the {jax.process_count()} processes"
        )
    graphdef, shapes, axes = abstract_model(cfg.model)
    check_divisible(shapes, axes, param_rules, sizes)
    check_resumable(cfg)
    source = open_source(cfg)
    return Prepared(cfg, sizes, graphdef, shapes, axes, source)


def _write_config(run_dir: str, cfg: Config, resume_step: int | None) -> None:
    """Writes the resolved config; a different one already there is kept as config.step<N>.yaml
    (the config that produced the checkpoints up to step N)."""
    if jax.process_index() != 0:
        return
    os.makedirs(run_dir, exist_ok=True)
    path, text = os.path.join(run_dir, "config.yaml"), dump_config(cfg)
    if os.path.exists(path):
        with open(path) as f:
            old = f.read()
        if old != text:
            os.replace(path, os.path.join(run_dir, f"config.step{resume_step or 0}.yaml"))
    with open(path, "w") as f:
        f.write(text)


@dataclasses.dataclass
class Built:
    """Everything the loop drives, on the real mesh."""

    mesh: Mesh
    state: TrainState
    start: int
    compile_step: Callable[[], Callable]  # ahead of time: returns the compiled train step
    batches: Iterator[dict[str, jax.Array]]
    iterator: Any
    ckpt: Checkpointer


def build(p: Prepared, devices: list) -> Built:
    """Creates run.dir, then restores the latest checkpoint or creates the state, sharded."""
    cfg = p.cfg
    mesh = make_mesh(p.mesh_sizes, devices)
    act_rules, param_rules = to_rules(cfg.sharding.activations), to_rules(cfg.sharding.params)
    tx, schedule = make_optimizer(cfg.optim, cfg.train.steps, p.axes)
    state_sh = state_shardings(tx, p.shapes, shardings(p.axes, param_rules, mesh), mesh)
    batch_sh = batch_sharding(mesh, act_rules)
    ckpt = Checkpointer(os.path.join(cfg.run.dir, "checkpoints"), cfg.checkpoint)
    iterator = make_iterator(cfg, p.source)
    start = ckpt.latest_step()
    _write_config(cfg.run.dir, cfg, start)
    log(
        f"mesh {' x '.join(f'{a}={s}' for a, s in p.mesh_sizes.items())} on {len(devices)} "
        f"{devices[0].platform} devices, {jax.process_count()} process(es); "
        f"{param_count(p.shapes) / 1e6:.2f}M parameters"
    )
    if start is None:
        start, state = 0, init_state(cfg.model, tx, cfg.run.seed, state_sh)
    else:
        state = ckpt.restore(start, abstract_state(tx, p.shapes, state_sh), iterator)
        log(f"resumed from step {start}")
    step = jax.jit(
        make_train_step(p.graphdef, tx, schedule, cfg.train.grad_accum),
        in_shardings=(state_sh, batch_sh),
        out_shardings=(state_sh, None),
        donate_argnums=(0,),
    )

    def compile_step() -> Callable:
        t0 = time.perf_counter()
        batch = jax.ShapeDtypeStruct((cfg.train.global_batch, cfg.model.seq_len + 1), jnp.int32, sharding=batch_sh)
        with activation_rules(mesh, act_rules):  # the model's logical constraints bind while tracing
            compiled = step.lower(state, {"tokens": batch}).compile()
        log(f"compiled the train step in {time.perf_counter() - t0:.1f} s")
        return compiled

    batches = global_batches(iterator, batch_sh, cfg.train.global_batch)
    return Built(mesh, state, start, compile_step, batches, iterator, ckpt)


def run(cfg: Config, devices: list | None = None) -> list[dict[str, Any]]:
    """Trains `cfg.train.steps` steps in total (resuming if `run.dir` has checkpoints) on
    `devices` (default: all). Returns the logged metrics of this invocation."""
    devices = jax.devices() if devices is None else devices
    b = build(prepare(cfg, len(devices)), devices)
    logger = MetricsLogger(
        cfg.run.dir, cfg.train.steps, cfg.train.global_batch * cfg.model.seq_len, flops_per_token(cfg.model), devices
    )
    state, start, ckpt = b.state, b.start, b.ckpt
    if start >= cfg.train.steps:
        log(f"nothing to do: the checkpoint at step {start} has reached train.steps={cfg.train.steps}")
        ckpt.close()
        return logger.history

    step_fn = b.compile_step()
    logger.start(start)
    pending: tuple[int, dict] | None = None
    for done in range(start + 1, cfg.train.steps + 1):
        state, metrics = step_fn(state, next(b.batches))
        if pending is not None:  # the previous step's metrics: ready by now, fetched without a stall
            logger.write(*pending)
        log_now = done % cfg.train.log_every == 0 or done in (start + 1, cfg.train.steps)
        pending = (done, metrics) if log_now else None
        if ckpt.due(done) or done == cfg.train.steps:
            if pending is not None:
                logger.write(*pending)
                pending = None
            ckpt.save(done, state, b.iterator)
            logger.start(done)  # the save's blocking part is not step time
    if pending is not None:
        logger.write(*pending)
    ckpt.wait()
    ckpt.close()
    log(f"done: step {cfg.train.steps}, checkpoints at {ckpt.directory} (steps {ckpt.all_steps()})")
    return logger.history

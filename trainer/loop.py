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
from typing import Any

import jax
from flax import nnx

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
from trainer.checkpoint import Checkpointer
from trainer.metrics import MetricsLogger, log
from trainer.optimizer import make_optimizer
from trainer.state import abstract_model, abstract_state, init_state, param_count, state_shardings
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
    source = open_source(cfg)
    return Prepared(cfg, sizes, graphdef, shapes, axes, source)


def _write_config(run_dir: str, cfg: Config) -> None:
    if jax.process_index() != 0:
        return
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, "config.yaml"), "w") as f:
        f.write(dump_config(cfg))


def run(cfg: Config, devices: list | None = None) -> list[dict[str, Any]]:
    """Trains `cfg.train.steps` steps in total (resuming if `run.dir` has checkpoints) on
    `devices` (default: all). Returns the logged metrics of this invocation."""
    devices = jax.devices() if devices is None else devices
    p = prepare(cfg, len(devices))
    mesh = make_mesh(p.mesh_sizes, devices)
    act_rules, param_rules = to_rules(cfg.sharding.activations), to_rules(cfg.sharding.params)
    _write_config(cfg.run.dir, cfg)
    log(
        f"mesh {' x '.join(f'{a}={s}' for a, s in p.mesh_sizes.items())} on {len(devices)} "
        f"{devices[0].platform} devices, {jax.process_count()} process(es); "
        f"{param_count(p.shapes) / 1e6:.2f}M parameters"
    )

    tx, schedule = make_optimizer(cfg.optim, cfg.train.steps, p.axes)
    state_sh = state_shardings(tx, p.shapes, shardings(p.axes, param_rules, mesh), mesh)
    batch_sh = batch_sharding(mesh, act_rules)
    ckpt = Checkpointer(os.path.join(cfg.run.dir, "checkpoints"), cfg.checkpoint)
    iterator = make_iterator(cfg, p.source)

    start = ckpt.latest_step()
    if start is None:
        start = 0
        state = init_state(cfg.model, tx, cfg.run.seed, state_sh)
    else:
        state = ckpt.restore(start, abstract_state(tx, p.shapes, state_sh), iterator)
        log(f"resumed from step {start}")

    batches = global_batches(iterator, batch_sh, cfg.train.global_batch)
    logger = MetricsLogger(
        cfg.run.dir, cfg.train.steps, cfg.train.global_batch * cfg.model.seq_len, flops_per_token(cfg.model), devices
    )
    if start >= cfg.train.steps:
        log(f"nothing to do: the checkpoint at step {start} has reached train.steps={cfg.train.steps}")
        ckpt.close()
        return logger.history

    step_fn = jax.jit(
        make_train_step(p.graphdef, tx, schedule, cfg.train.grad_accum),
        in_shardings=(state_sh, batch_sh),
        out_shardings=(state_sh, None),
        donate_argnums=(0,),
    )
    batch = next(batches)
    t0 = time.perf_counter()
    with activation_rules(mesh, act_rules):
        compiled = step_fn.lower(state, batch).compile()
    log(f"compiled the train step in {time.perf_counter() - t0:.1f} s")

    pending: tuple[int, dict] | None = None
    logger.start(start)
    for step in range(start, cfg.train.steps):
        if step > start:
            batch = next(batches)
        state, metrics = compiled(state, batch)
        done = step + 1
        if pending is not None:  # the previous step's metrics: ready by now, fetched without a stall
            logger.write(pending[0], jax.device_get(pending[1]))
            pending = None
        if done % cfg.train.log_every == 0 or done in (start + 1, cfg.train.steps):
            pending = (done, metrics)
        if ckpt.due(done) or done == cfg.train.steps:
            if pending is not None:
                logger.write(pending[0], jax.device_get(pending[1]))
                pending = None
            ckpt.save(done, state, iterator)
            logger.start(done)  # the save's blocking part is not step time
    if pending is not None:
        logger.write(pending[0], jax.device_get(pending[1]))
    ckpt.wait()
    ckpt.close()
    log(f"done: step {cfg.train.steps}, checkpoints at {ckpt.directory} (steps {ckpt.all_steps()})")
    return logger.history

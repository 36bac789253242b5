"""The training run: check everything, build the sharded state, then loop with hooks.

`prepare` (trainer.program) does every check that bad input can fail before anything is
compiled or written; `run` then creates `run.dir`, restores or creates the state, compiles the
step once ahead of time, and drives it. Logging and checkpointing are
hooks outside `jit`; metrics are read one step late so the device never waits on the host.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Iterator

import jax

from configs import Config, dump_config
from data import global_batches, make_iterator
from model import flops_per_token
from trainer.checkpoint import Checkpointer
from trainer.metrics import MetricsLogger, log
from trainer.program import Prepared, Program, make_program, prepare
from trainer.state import TrainState, init_state, param_count


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

    program: Program
    state: TrainState
    start: int
    batches: Iterator[dict[str, jax.Array]]
    iterator: Any
    ckpt: Checkpointer


def build(p: Prepared, devices: list) -> Built:
    """Creates run.dir, then restores the latest checkpoint or creates the state, sharded."""
    cfg, layout = p.cfg, p.layout
    program = make_program(p, devices)
    ckpt = Checkpointer(os.path.join(cfg.run.dir, "checkpoints"), cfg.checkpoint)
    iterator = make_iterator(cfg, p.source)
    start = ckpt.latest_step()
    _write_config(cfg.run.dir, cfg, start)
    log(
        f"mesh {' x '.join(f'{a}={s}' for a, s in layout.sizes.items())} on {len(devices)} "
        f"{devices[0].platform} devices, {jax.process_count()} process(es); "
        f"{param_count(p.shapes) / 1e6:.2f}M parameters"
    )
    if start is None:
        start, state = 0, init_state(cfg.model, program.tx, cfg.run.seed, program.state_sh)
    else:
        state = ckpt.restore(start, program.abstract_state(), iterator)
        log(f"resumed from step {start}")
    if layout.pipelined:
        log(
            f"pipeline: {layout.stages} stages x {layout.repeats} repeat(s), {layout.microbatches} microbatches, "
            f"{cfg.model.num_layers // (layout.stages * layout.repeats)} layers per stage and repeat; "
            f"bubble fraction {layout.bubble:.3f}"
        )
    batches = global_batches(iterator, program.batch_sh, cfg.train.global_batch)
    return Built(program, state, start, batches, iterator, ckpt)


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

    step_fn, seconds = b.program.compile(state)
    log(f"compiled the train step in {seconds:.1f} s")
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

"""The training run: check everything, build the sharded state, then loop with hooks.

`prepare` (trainer.program) does every check that bad input can fail before anything is
compiled or written; `run` then takes run.dir's lock (ops.rundir_lock: one writer per run
directory), makes the `Session` (the program, the state restored or created, the data
iterator, the checkpointer), compiles the step once ahead of time, and drives it. What happens
between steps (metrics and bad-step bookkeeping, checkpoints, eval, profiling) are hooks outside
`jit`, each owning its interval (trainer.hooks); metrics are read one step late so the device
never waits on the host.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
import time
from typing import Any, Iterator

import jax
import numpy as np

from configs import Config, dump_config
from configs.schema import nan_steps
from data import describe, eval_batches, global_batches, make_iterator
from model import flops_per_token, hf, stack_layers
from model.lora import join, trainable
from sharding.hardware import peak_flops_of_kind
from sharding import distributed
from ops import rundir_lock
from trainer.checkpoint import Checkpointer, check_resumable, checkpoint_dir, has_checkpoints, saved_config
from trainer.checks import check_devices
from ops.faults import Preempted, StopSignal, Watchdog, fingerprint
from ops.goodput import Goodput, invocation_outcome
from trainer.hooks import Hook, StepLog, make_hooks
from trainer.kernels import attention_notes
from ops.metrics import MetricsLogger, log
from ops.observe import instrument
from trainer.program import Program, RunSpec, make_program, prepare
from trainer.state import TrainState, frozen_base, init_state, param_count, random_params, state_from_params
from ops.stragglers import StepClock, injected_sleep
from trainer.tiers import LocalTier
from ops.xla_env import set_cpu_device_count, use_compile_cache


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
class Session:
    """What the loop drives, on the real mesh: the compiled-to-be program, the state it starts
    from (restored or new), that step, this process's data iterator, the checkpointer and the
    held-out rows."""

    program: Program
    state: TrainState
    start: int
    iterator: Any  # the Grain iterator of this process's rows
    ckpt: Checkpointer
    eval_rows: list[dict[str, np.ndarray]]  # this process's rows of the held-out batches; [] = no eval


# The optim keys that shape the learning-rate schedule.
SCHEDULE_KEYS = ("lr", "warmup_steps", "schedule", "min_lr_ratio", "decay_steps")


def resolve_schedule(cfg: Config) -> tuple[Config, str]:
    """`cfg` with `optim.decay_steps` resolved: as set; else, resuming, the horizon of the
    checkpoints' config (a longer train.steps continues the schedule the run was on); else
    train.steps. Also the line to print on resume when the schedule differs from the checkpoints'
    or its horizon from train.steps ("" otherwise)."""
    saved, note = saved_config(cfg.run.dir), ""
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


def make_session(spec: RunSpec, devices: list, schedule_note: str = "") -> Session:
    """Builds the program, restores the newest readable checkpoint or creates the state, sharded;
    then writes the resolved config into run.dir."""
    cfg, layout, source = spec.cfg, spec.layout, spec.source
    from_hf = bool(cfg.init.from_hf) and not has_checkpoints(cfg.run.dir)  # checked by `prepare`
    program = make_program(spec, devices)
    ckpt = Checkpointer(checkpoint_dir(cfg.run.dir), cfg.checkpoint)
    if cfg.checkpoint.local_dir:
        ckpt.attach_local(LocalTier(cfg, program.mesh, program.abstract_state()))
        if jax.process_count() > 1 and not ckpt.local.peers:
            log("warning: no other process holds a copy of this process's shards (mesh.data does not span "
                "processes): a lost host's local checkpoints are lost, the persistent tier remains")
    iterator = make_iterator(cfg, source)
    log(describe(source, cfg, spec.objective.data_format))
    eval_rows: list = []
    if cfg.eval.every and source.eval is None:
        log(f"warning: eval.every={cfg.eval.every} but data.source={cfg.data.source} has no held-out split; no eval")
    elif cfg.eval.every:
        args = (cfg.train.global_batch, cfg.eval.batches, cfg.run.seed, jax.process_index(), jax.process_count())
        eval_rows = eval_batches(source, *args)
    log(
        f"mesh {' x '.join(f'{a}={s}' for a, s in layout.sizes.items())} on {len(devices)} "
        f"{devices[0].platform} devices, {jax.process_count()} process(es); "
        f"{param_count(spec.model.shapes) / 1e6:.2f}M parameters"
        + (f", {param_count(trainable(spec.model.shapes)) / 1e6:.3f}M of them trained (LoRA adapters; the rest frozen)"
           if cfg.model.lora.enabled else "")
    )
    for note in attention_notes(cfg):
        log(note)
    if cfg.model.quant != "none":
        log(f"model.quant={cfg.model.quant}: the block matmuls run in 8 bits"
            + ("; MFU is against the bf16 peak" if peak_flops_of_kind(getattr(devices[0], "device_kind", "")) else
               " (emulated on this device)"))
    try:
        restored = ckpt.restore_latest(program.abstract_state(), iterator, warn=log)
        if restored is None and from_hf:
            params = hf.load_params(cfg.init.from_hf, cfg.model, program.state_sh.params)
            if cfg.model.mtp_depth:  # no Hugging Face checkpoint holds them: they start from the random init
                params["mtp"] = random_params(cfg.model, cfg.run.seed, program.state_sh.params, "mtp")
            start, state = 0, state_from_params(params, program.tx, program.init_sh, cfg.model, cfg.run.seed)
            log(f"initialized the parameters from {cfg.init.from_hf} (init.from_hf)")
        elif restored is None:
            start, state = 0, init_state(cfg.model, program.tx, cfg.run.seed, program.init_sh)
        else:
            start, state = restored
            if ckpt.local is not None and ckpt.restored_tier == "persistent":
                log(f"restoring from the persistent tier: step {start}")
            if cfg.model.lora.enabled:  # the checkpoint holds the adapters alone
                base = frozen_base(cfg.model, cfg.init.from_hf, cfg.run.seed, program.state_sh.params)
                state = state.replace(params=join(state.params, base))
            log(f"resumed from step {start}")
            if schedule_note and start < cfg.train.steps:
                log(schedule_note)
        if restored is None:  # a new state: the objective's frozen weights loaded (a teacher), if any
            state = program.with_frozen(state)
        if start < cfg.train.steps:  # a run with nothing to do leaves run.dir as it was
            _write_config(cfg.run.dir, cfg, start)
        if layout.pipelined:
            log(
                f"pipeline: {layout.stages} stages x {layout.repeats} repeat(s), {layout.microbatches} microbatches, "
                f"{stack_layers(cfg.model) // (layout.stages * layout.repeats)} layers per stage and repeat; "
                f"bubble fraction {layout.bubble:.3f}"
            )
    except BaseException:
        ckpt.close()  # its library log too: the console gets its printers back for the error
        raise
    return Session(program, state, start, iterator, ckpt, eval_rows)


def _poisoned(batches: Iterator[dict[str, np.ndarray]], steps: set[int], start: int, vocab: int) -> Iterator:
    """Fault injection (`debug.nan_steps`): token ids past the vocabulary at the given steps make
    the embedding lookup return NaN, as a corrupt data file would."""
    for step, batch in enumerate(batches, start=start + 1):
        if step in steps:
            batch = {**batch, "tokens": np.full_like(batch["tokens"], vocab)}
        yield batch


def run(cfg: Config, devices: list | None = None) -> list[dict[str, Any]]:
    """Trains `cfg.train.steps` steps in total (resuming if `run.dir` has checkpoints) on
    `devices` (default: all). Returns the logged metrics of this invocation.

    Raises ConfigError for bad input or a run.dir in use by a live run, Preempted after a signal
    (checkpoint committed) and TooManyBadSteps after `train.max_bad_steps` non-finite steps in a row."""
    goodput = Goodput()
    notices: list[str] = []
    why_not = set_cpu_device_count(cfg, notices=notices) if devices is None else "the caller chose the devices"
    use_compile_cache(cfg.run.compile_cache)
    distributed.initialize(cfg.dist)
    distributed.check_same_everywhere(fingerprint(cfg), cfg.dist.init_timeout_s)
    devices = jax.devices() if devices is None else devices
    check_devices(cfg, devices, why_not)
    spec = prepare(cfg, len(devices))
    for line in notices:  # after the checks: a bad command gets its error line alone
        print(line, flush=True)
    # Bad input has been refused with run.dir untouched; from here on this run writes there, alone.
    with rundir_lock.hold(cfg.run.dir, cfg.run.lock_timeout_s, cfg.dist.init_timeout_s, log):
        check_resumable(cfg)  # again: a holder alive at the first check may have saved since
        # Resolved under the lock: the horizon comes from the checkpoints this run resumes.
        cfg, schedule_note = resolve_schedule(cfg)
        return _run_holding_the_lock(dataclasses.replace(spec, cfg=cfg), devices, goodput, schedule_note)


def _run_holding_the_lock(spec: RunSpec, devices: list, goodput: Goodput, schedule_note: str) -> list[dict[str, Any]]:
    session = make_session(spec, devices, schedule_note)
    goodput.tier = session.ckpt.restored_tier if session.start > 0 else ""
    try:
        return _train(spec.cfg, session, devices, goodput)
    finally:
        session.ckpt.close()  # also when compiling fails: it gives the console its printers back (LibraryLog)


def _train(cfg: Config, session: Session, devices: list, goodput: Goodput) -> list[dict[str, Any]]:
    objective = session.program.spec.objective
    tokens_per_step = cfg.train.global_batch * objective.rows_per_example * cfg.model.seq_len
    logger = MetricsLogger(cfg, tokens_per_step, flops_per_token(cfg.model), devices, objective.console)
    if session.start >= cfg.train.steps:
        log(f"nothing to do: the checkpoint at step {session.start} has reached train.steps={cfg.train.steps}; "
            f"{cfg.run.dir} is left as it was")
        return logger.history
    goodput.begin(cfg.run.dir, session.start)
    logger.trackers.open(session.start)
    step_fn, seconds = session.program.compile(session.state)
    log(f"compiled the train step in {seconds:.1f} s")
    saved = session.start if session.start in session.ckpt.all_steps() else None
    book = StepLog(cfg, session.start, logger, saved, goodput)
    hooks = make_hooks(cfg, session.program, session.ckpt, session.iterator, session.eval_rows, book, logger, goodput)
    goodput.lap("compile")
    step_fn = instrument(step_fn, session.start, goodput)
    # More steps than compared: processes publish them at different moments (ops.stragglers).
    clock = StepClock(2 * cfg.straggler.steps + 8)
    stop = StopSignal()
    watchdog = Watchdog(cfg.train.step_timeout_s, cfg.dist.heartbeat_timeout_s, clock=clock,
                        straggler_factor=cfg.straggler.factor, straggler_steps=cfg.straggler.steps)
    if jax.process_count() > 1:
        book.process_times = watchdog.own_times
    try:
        _loop(cfg, session, step_fn, book, hooks, logger, stop, watchdog, goodput, clock)
    finally:
        watchdog.close()
        stop.restore()
        session.ckpt.close()
        summary = goodput.finish(cfg, logger)  # summary.json and its lines, also when preempted or stopped
        logger.trackers.finish(summary, invocation_outcome(sys.exc_info()[1]))
    return logger.history


def _timed(batches: Iterator, logger: MetricsLogger) -> Iterator:
    """The batches, with the time spent waiting for each reported to the logger."""
    while True:
        t0 = time.perf_counter()
        batch = next(batches, None)
        logger.waited(time.perf_counter() - t0)
        if batch is None:
            return
        yield batch


def _loop(cfg: Config, session: Session, step_fn: Any, book: StepLog, hooks: list[Hook], logger: MetricsLogger,
          stop: StopSignal, watchdog: Watchdog, goodput: Goodput, clock: StepClock) -> None:
    """Runs the steps; after each, the previous step's metrics are settled (one step late) and
    the hooks that are due act, in order, on the step just dispatched. `clock` times this
    process's own part of each step (ops.stragglers)."""
    state, last, ckpt = session.state, cfg.train.steps, session.ckpt
    local = session.iterator
    if cfg.debug.nan_steps:
        local = _poisoned(local, nan_steps(cfg), session.start, cfg.model.vocab_size)
    batches = _timed(global_batches(local, session.program.batch_sh, cfg.train.global_batch), logger)
    logger.start(session.start)
    watchdog.beat(session.start)
    previous: tuple[int, dict] | None = None  # the step before, whose flag we read one step late
    for hook in hooks:
        hook.begin(session.start)
    sleep_s = injected_sleep()
    clock.restart()
    for done in range(session.start + 1, last + 1):
        batch = next(batches)
        if sleep_s:
            time.sleep(sleep_s)
        watchdog.arrive(done)
        with clock.waiting():
            if done == session.start + 1:  # run to its end: its one-time set-up is counted apart (goodput)
                t0 = time.perf_counter()
                state, metrics = jax.block_until_ready(step_fn(state, batch))
                goodput.first_step_s = time.perf_counter() - t0
            else:
                state, metrics = step_fn(state, batch)
            if previous is not None:
                book.settle(*previous)
        if previous is not None:
            watchdog.beat(previous[0])
        previous = (done, metrics)
        stopping = stop.requested(done)
        due = [hook for hook in hooks if hook.due(done, stopping)]
        clock.lap(done)
        if due:
            with clock.waiting():
                book.settle(done, metrics, force_log=stopping)  # a hook acts on a settled step
            previous = None
            for hook in due:
                hook.run(done, state, stopping)
            logger.start(done)  # the save's blocking part and eval are not step time
            watchdog.beat(done)
            clock.restart()
        if stopping:
            watchdog.pause()
            with goodput.phase("checkpoint"):
                ckpt.wait()
            watchdog.finished()
            signame = signal.Signals(stop.signum).name if stop.signum else "SIGTERM"
            log(f"preempted by {signame}: checkpoint at step {done} committed in {ckpt.directory}; "
                "run the same command to resume")
            raise Preempted(cfg.train.preempt_exit_code)
    if previous is not None:
        book.settle(*previous)
    watchdog.pause()
    with goodput.phase("checkpoint"):
        ckpt.wait()
    watchdog.finished()
    log(f"done: step {last}, checkpoints at {ckpt.directory} (steps {ckpt.all_steps()})")

"""The training run: check everything, build the sharded state, then loop with hooks.

`bring_up` (trainer.startup, with trainer.program's `prepare`) does every check that bad input
can fail before anything is compiled or written; `run` then takes run.dir's lock
(ops.rundir_lock: one writer per run directory), reads run.dir again under it (trainer.session's
`reread`), makes the `Session` (the program, the state restored or created, the data iterator,
the checkpointer), builds the `RunContext` the loop and its hooks share (trainer.context),
compiles the step once ahead of time, and drives it. What happens between steps (metrics and
bad-step bookkeeping, checkpoints, eval, profiling) are hooks outside `jit`, each owning its
interval (trainer.hooks); metrics are read one step late so the device never waits on the host.
"""

from __future__ import annotations

import signal
import time
from typing import Any, Callable, Iterator

import jax

from configs import Config
from data import eval_batches, global_batches
from ops import rundir_lock
from ops.faults import Preempted, poisoned, stops_on_outage
from ops.goodput import Goodput
from ops.metrics import MetricsLogger, log
from ops.observe import instrument
from trainer.context import Hook, RunContext, make_hooks, open_context
from trainer.session import Session, make_session, reread
from trainer.startup import bring_up


def run(cfg: Config, devices: list | None = None) -> list[dict[str, Any]]:
    """Trains `cfg.train.steps` steps in total (resuming if `run.dir` has checkpoints) on
    `devices` (default: all). Returns the logged metrics of this invocation.

    Raises ConfigError for bad input or a run.dir in use by a live run, Preempted after a signal
    (checkpoint committed), TooManyBadSteps after `train.max_bad_steps` non-finite steps in a row
    and StoreDown when a bucket run.dir's store stops answering past its clients' retries."""
    goodput = Goodput()
    session: Session | None = None
    # An error that says the store of a bucket run.dir stopped answering, from the first read of
    # run.dir on (bad input stays a ConfigError): one line (StoreDown), once the saves in flight
    # are joined, so that the last committed step it names is known. The lock is then left, not
    # released (ops.rundir_lock): the release would wait out the store's retries.
    with stops_on_outage(cfg.run.dir, lambda: _committed(session)):
        spec, devices = bring_up(cfg, devices)
        # Bad input has been refused with run.dir untouched; from here on this run writes there, alone.
        with rundir_lock.hold(cfg.run.dir, cfg.run.lock_timeout_s, cfg.dist.init_timeout_s, log):
            # Read again under the lock: a holder alive at the first read may have saved since, and
            # the schedule's horizon comes from the checkpoints this run resumes.
            spec, schedule_note = reread(spec)
            session = make_session(spec, devices, schedule_note, held_out=eval_batches)
            goodput.tier = session.origin if session.start > 0 else ""
            try:
                return _train(session, devices, goodput)
            finally:
                session.ckpt.close()  # also when compiling fails: it gives the console its printers back (LibraryLog)


def _committed(session: Session | None) -> str:
    """The last checkpoint known committed, in words, for StoreDown's line."""
    if session is None:
        return "whichever run.dir held before this command (it stopped while starting)"
    return "none yet" if session.ckpt.committed is None else f"step {session.ckpt.committed}"


def _train(session: Session, devices: list, goodput: Goodput) -> list[dict[str, Any]]:
    """Builds the run's context, compiles the step, builds the hooks and runs the loop; the
    context's `close` writes the summary however the loop ends. A session already at train.steps
    compiles nothing and leaves run.dir as it was."""
    ctx = open_context(session, devices, goodput)
    cfg = ctx.cfg
    if session.start >= cfg.train.steps:
        log(f"nothing to do: the checkpoint at step {session.start} has reached train.steps={cfg.train.steps}; "
            f"{cfg.run.dir} is left as it was")
        return ctx.logger.history
    goodput.begin(cfg.run.dir, session.start)
    ctx.logger.trackers.open(session.start)
    step_fn, seconds = session.program.compile(session.state)
    log(f"compiled the train step in {seconds:.1f} s")
    hooks = make_hooks(ctx)
    goodput.lap("compile")
    step_fn = instrument(step_fn, session.start, goodput)
    ctx.watch()
    try:
        _loop(ctx, step_fn, hooks, session.stage)
    finally:
        ctx.close()
    return ctx.logger.history


def _timed(batches: Iterator, logger: MetricsLogger) -> Iterator:
    """The batches, with the time spent waiting for each reported to the logger."""
    while True:
        t0 = time.perf_counter()
        batch = next(batches, None)
        logger.waited(time.perf_counter() - t0)
        if batch is None:
            return
        yield batch


# An objective's maker of each step's batch (trainer.objectives.registry.Stage).
Stage = Callable[[Any, Callable[[], dict], int], tuple[dict, dict[str, float]]]


def _next_batch(ctx: RunContext, stage: Stage | None, batches: Iterator, state: Any,
                step: int) -> tuple[dict, dict[str, float]]:
    """The batch step `step` trains on, with the host's metrics of making it: the data's next, or
    what the objective's stage makes of the data (GRPO's rollouts), placed as the step takes it."""
    if stage is None:
        return next(batches), {}
    program = ctx.session.program
    if stage.makes_batch(step):  # a rollout, from `state`
        # The update still computing `state` (dispatched asynchronously) is waited for here, so
        # that its time stays the steps' and the rollout's phase holds only the rollout's.
        jax.block_until_ready(state)
    # Goodput counts it apart from the update; the model's activation rules bind as in the step.
    with ctx.goodput.phase("rollout"), program.tracing():
        batch, extra = stage(state, lambda: next(batches), step)
    return jax.device_put(batch, program.batch_sh), extra


def _loop(ctx: RunContext, step_fn: Any, hooks: list[Hook], stage: Stage | None = None) -> None:
    """Runs the steps; after each, the previous step's metrics are settled (one step late) and
    the hooks that are due act, in order, on the step just dispatched. `ctx.clock` times this
    process's own part of each step (ops.stragglers). `stage`: the objective's maker of each
    step's batch from the data (None: the data's batches)."""
    cfg, session, book, clock, watchdog = ctx.cfg, ctx.session, ctx.book, ctx.clock, ctx.watchdog
    state, last, start = session.state, cfg.train.steps, session.start
    local = poisoned(session.iterator, cfg, start) if cfg.debug.nan_steps else session.iterator
    batches = _timed(global_batches(local, session.program.batch_sh, cfg.train.global_batch), ctx.logger)
    ctx.logger.start(start)
    watchdog.beat(start)
    previous: tuple[int, dict] | None = None  # the step before, whose flag we read one step late
    for hook in hooks:
        hook.begin(start, state)
    clock.restart()
    for done in range(start + 1, last + 1):
        batch, extra = _next_batch(ctx, stage, batches, state, done)
        if ctx.sleep_s:
            time.sleep(ctx.sleep_s)
        watchdog.arrive(done)
        with clock.waiting():
            if done == start + 1:  # run to its end: its one-time set-up is counted apart (goodput)
                t0 = time.perf_counter()
                state, metrics = jax.block_until_ready(step_fn(state, batch))
                ctx.goodput.first_step_s = time.perf_counter() - t0
            else:
                state, metrics = step_fn(state, batch)
            metrics = {**metrics, **extra}
            if previous is not None:
                book.settle(*previous)
        if previous is not None:
            watchdog.beat(previous[0])
        previous = (done, metrics)
        stopping = ctx.stop.requested(done)
        due = [hook for hook in hooks if hook.due(done, stopping)]
        clock.lap(done)
        if due:
            with clock.waiting():
                book.settle(done, metrics, force_log=stopping)  # a hook acts on a settled step
            previous = None
            for hook in due:
                hook.run(done, state, stopping)
            ctx.logger.start(done)  # the save's blocking part and eval are not step time
            watchdog.beat(done)
            clock.restart()
        if stopping:
            ctx.wait_for_saves()
            signame = signal.Signals(ctx.stop.signum).name if ctx.stop.signum else "SIGTERM"
            log(f"preempted by {signame}: checkpoint at step {done} committed in {session.ckpt.directory}; "
                "run the same command to resume")
            # Ctrl-C is the user's (130, as a shell reports it); SIGTERM the scheduler's preemption.
            raise Preempted(128 + signal.SIGINT if ctx.stop.signum == signal.SIGINT else cfg.train.preempt_exit_code)
    if previous is not None:
        book.settle(*previous)
    ctx.wait_for_saves()
    log(f"done: step {last}, checkpoints at {session.ckpt.directory} (steps {session.ckpt.all_steps()})")

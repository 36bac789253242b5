"""What one invocation's loop and its hooks share, built in one place: `RunContext`.

The session (trainer.session), the goodput books (ops.goodput), the metrics logger (ops.metrics),
the step log (trainer.hooks.StepLog), this process's step clock (ops.stragglers), the stop
signal and the watchdog (ops.faults). `open_context` builds it once the session exists;
`RunContext.watch` starts the stop signal and the watchdog after the compile; `make_hooks`
builds the hooks from it; `RunContext.close` closes the books when the loop ends, however it ends.
"""

from __future__ import annotations

import dataclasses
import functools
import sys

import jax

from configs import Config
from model import flops_per_token
from ops.faults import StopSignal, Watchdog, store_down
from ops.goodput import Goodput, invocation_outcome
from ops.metrics import MetricsLogger
from ops.stragglers import StepClock, injected_sleep
from trainer.hooks import CheckpointHook, EvalHook, Hook, ProfileHook, StepLog
from trainer.session import Session


@dataclasses.dataclass
class RunContext:
    """One invocation's shared parts. `stop` and `watchdog` exist once `watch` has run."""

    session: Session
    goodput: Goodput
    logger: MetricsLogger
    book: StepLog
    clock: StepClock  # this process's own time per step, which the watchdog publishes
    sleep_s: float  # slept before each step: an injected straggler (ops.stragglers.injected_sleep)
    stop: StopSignal = dataclasses.field(init=False)
    watchdog: Watchdog = dataclasses.field(init=False)

    @property
    def cfg(self) -> Config:
        """The run's resolved config (the session's RunSpec holds it; no copy is kept)."""
        return self.session.program.spec.cfg

    def watch(self) -> None:
        """Starts the stop signal's handlers and the watchdog's thread. After the compile, as they
        always were: a signal while compiling ends the process, and processes start their
        watchdogs once compiled (ops.faults.Watchdog)."""
        cfg = self.cfg
        self.stop = StopSignal()
        self.watchdog = Watchdog(cfg.train.step_timeout_s, cfg.dist.heartbeat_timeout_s, clock=self.clock,
                                 straggler_factor=cfg.straggler.factor, straggler_steps=cfg.straggler.steps)
        if jax.process_count() > 1:
            self.book.process_times = self.watchdog.own_times

    def wait_for_saves(self) -> None:
        """The run ends here (its last step, or an agreed stop): the saves in flight are committed,
        in goodput's checkpoint bucket, and the peers are told it was no crash."""
        self.watchdog.pause()
        with self.goodput.phase("checkpoint"):
            self.session.ckpt.wait()
        self.watchdog.finished()

    def close(self) -> None:
        """Stops the watchdog and the signal handlers, closes the checkpointer, writes summary.json
        and ends the trackers' run. Call it from a `finally` after `watch`: the exception on its way
        out, if any, is the invocation's outcome."""
        self.watchdog.close()
        self.stop.restore()
        self.session.ckpt.close()
        if store_down(sys.exc_info()[1], self.cfg.run.dir):
            return  # the store stopped answering: each write would wait out its client's retries again
        self.logger.flush()  # metrics.jsonl whole before summary.json reads it (an object store's is buffered)
        summary = self.goodput.finish(self.cfg, self.logger)  # summary.json and its lines, also when stopped
        self.logger.trackers.finish(summary, invocation_outcome(sys.exc_info()[1]))


def open_context(session: Session, devices: list, goodput: Goodput) -> RunContext:
    """The context of a run on `devices` from `session`, with `goodput` timing it since its start."""
    cfg, objective = session.program.spec.cfg, session.program.spec.objective
    tokens_per_step = cfg.train.global_batch * objective.rows_per_example * cfg.model.seq_len
    logger = MetricsLogger(cfg, tokens_per_step, flops_per_token(cfg.model), devices, objective.console)
    saved = session.start if session.start in session.ckpt.all_steps() else None
    book = StepLog(cfg, session.start, logger, saved, goodput)
    # More steps than compared: processes publish them at different moments (ops.stragglers).
    clock = StepClock(2 * cfg.straggler.steps + 8)
    return RunContext(session, goodput, logger, book, clock, injected_sleep())


def make_hooks(ctx: RunContext) -> list[Hook]:
    """The hooks of this run, in the order they act on a step they share: close a trace (so it
    holds steps, not the save after them), save, then evaluate."""
    cfg, session, goodput = ctx.cfg, ctx.session, ctx.goodput
    program = session.program
    hooks: list[Hook] = []
    if cfg.profile.steps and jax.process_index() == 0 and session.start < cfg.profile.steps[1]:
        hooks.append(ProfileHook(cfg, goodput))
    hooks.append(CheckpointHook(cfg, session.ckpt, session.iterator, ctx.book, goodput))
    if session.eval_rows:
        hooks.append(EvalHook(cfg, program, session.eval_rows, ctx.logger, goodput))
    if program.spec.tasks is not None:
        # lm-evaluation-harness only for a run with eval.tasks
        from evaluation.tasks import TaskHook
        from trainer.scoring import evaluator_of

        hooks.append(TaskHook(cfg, program.spec.tasks, functools.partial(evaluator_of, program), ctx.logger,
                              goodput))
    return hooks

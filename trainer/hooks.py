"""What the training loop does between steps, outside jit: one hook per concern, each owning its
interval (docs/design.md, "From config to checkpoint").

- `StepLog` reads each step's `finite` flag one step late (so the device never waits on the
  host), counts non-finite steps and stops after `train.max_bad_steps` in a row, and writes the
  metrics of the steps due (`train.log_every`, the first and last, and any step another hook acts on).
- `CheckpointHook` saves at `checkpoint.every`, at the last step and on a stop signal, and into
  the local tier at `checkpoint.local_every` (trainer.tiers), never a state reached only through
  bad steps.
- `EvalHook` runs the held-out loss at `eval.every` and the last step (and at step 0, before any
  update, for an objective that asks: GRPO's held-out accuracy).
- `evaluation.tasks.TaskHook` runs the lm-evaluation-harness tasks of `eval.tasks` at
  `eval.tasks_every` and the last step; a failing task is one warning line, never the run's end.
- `ProfileHook` traces `profile.steps=[a, b]` with `jax.profiler` into `run.dir/profile/`
  (TensorBoard's profile plugin or XProf read it); `ops.observe.instrument` marks each step
  for the trace viewer.

`trainer.context.make_hooks` builds a run's hooks, in order, from its `RunContext`.
"""

from __future__ import annotations

import os
from typing import Callable

import grain
import jax
import numpy as np

from configs import Config
from data import to_global
from trainer.checkpoint import Checkpointer
from ops.faults import TooManyBadSteps
from ops.goodput import Goodput
from ops.metrics import MetricsLogger, log
from ops.observe import PROFILE_DIR
from trainer.program import Program
from trainer.state import TrainState


class Hook:
    """An action between steps. `begin` runs once before an invocation's first step; `due` is
    asked after every step; `run` only when it is due, after the step's metrics are settled."""

    def begin(self, start: int, state: TrainState) -> None:
        """Most hooks have nothing to do before the first step."""

    def due(self, step: int, stopping: bool) -> bool:
        raise NotImplementedError

    def run(self, step: int, state: TrainState, stopping: bool) -> None:
        raise NotImplementedError


class StepLog:
    """Per-step bookkeeping: reads each step's `finite` flag (which waits for that step), counts
    bad steps, and logs the steps that are due."""

    def __init__(self, cfg: Config, start: int, logger: MetricsLogger, saved: int | None, goodput: Goodput):
        self.cfg, self.start, self.logger, self.goodput = cfg, start, logger, goodput
        self.streak = self.skipped = 0
        self.saved = saved  # the newest checkpointed step; None: there is none
        self.process_times: Callable[[], dict[str, float]] | None = None  # several processes: own_s/p<i>

    def settle(self, step: int, metrics: dict, force_log: bool = False) -> None:
        cfg = self.cfg
        if bool(jax.device_get(metrics["finite"])):
            self.streak = 0
        else:
            self.streak, self.skipped = self.streak + 1, self.skipped + 1
            loss = float(jax.device_get(metrics["loss"]))
            log(f"warning: step {step} has a non-finite loss ({loss}) or gradient norm; update skipped "
                f"({self.streak} in a row)")
        stopping = self.streak >= cfg.train.max_bad_steps
        if stopping or force_log or step % cfg.train.log_every == 0 or step in (self.start + 1, cfg.train.steps):
            times = self.process_times() if self.process_times is not None else {}
            self.logger.write(step, {**metrics, "skipped_steps": self.skipped, **times})
        if stopping:
            # The step after this one has been dispatched, but the run ends here: the summary
            # counts up to this step, as the error does.
            self.goodput.last_step = step
            last = ("there is no checkpoint (rerunning starts over)" if self.saved is None
                    else f"the last good checkpoint is step {self.saved}")
            raise TooManyBadSteps(
                f"{self.streak} non-finite steps in a row (train.max_bad_steps={cfg.train.max_bad_steps}), the "
                f"last at step {step}; {last}"
            )


class CheckpointHook(Hook):
    def __init__(self, cfg: Config, ckpt: Checkpointer, iterator: grain.DatasetIterator, book: StepLog,
                 goodput: Goodput):
        self.last, self.ckpt, self.iterator, self.book, self.goodput = cfg.train.steps, ckpt, iterator, book, goodput

    def due(self, step: int, stopping: bool) -> bool:
        return self._persistent(step, stopping) or (self.ckpt.local is not None and self.ckpt.local.due(step))

    def _persistent(self, step: int, stopping: bool) -> bool:
        return stopping or step == self.last or self.ckpt.due(step)

    def run(self, step: int, state: TrainState, stopping: bool) -> None:
        if self.book.streak and not stopping:  # never save a state reached only through bad steps
            return
        # On an object store metrics.jsonl is buffered: its lines up to this step go there before the
        # step can commit, so a resume from it never leaves a gap in the run's history.
        self.book.logger.flush()
        # A step the persistent tier saves is not saved locally too: one copy off the devices per step.
        if self._persistent(step, stopping):
            with self.goodput.save("persistent"):
                self.ckpt.save(step, state, self.iterator)
        else:
            with self.goodput.save("local"):
                self.ckpt.local.save(step, state, self.iterator)
        self.book.saved = step


class EvalHook(Hook):
    """The objective's held-out means over all the held-out batches (their sums over their counts
    of tokens or pairs, not a mean of batch means), logged with the objective's other means
    (the perplexity, or DPO's rewards)."""

    def __init__(self, cfg: Config, program: Program, eval_rows: list[dict[str, np.ndarray]], logger: MetricsLogger,
                 goodput: Goodput):
        self.every, self.last, self.logger, self.goodput = cfg.eval.every, cfg.train.steps, logger, goodput
        self.objective = program.spec.objective
        self.loss_fn = program.compile_eval()
        self.batches = [to_global(rows, program.batch_sh, cfg.train.global_batch) for rows in eval_rows]

    def begin(self, start: int, state: TrainState) -> None:
        """An objective that asks for it (GRPO's accuracy) is measured once before a run's first update."""
        if start == 0 and self.objective.eval_before_training:
            self.run(0, state, False)

    def due(self, step: int, stopping: bool) -> bool:
        return not stopping and (step % self.every == 0 or step == self.last)

    def run(self, step: int, state: TrainState, stopping: bool) -> None:
        with self.goodput.phase("eval"):
            loss, extra, shown = self.metrics(state)
            self.logger.write_eval(step, loss, extra, shown)

    def metrics(self, state: TrainState) -> tuple[float, dict[str, float], str]:
        """(the mean loss, the objective's other means by name, their console text) over the
        held-out batches."""
        outs = jax.device_get([self.loss_fn(state.params, state.ref_params, batch) for batch in self.batches])
        flat = [np.concatenate([np.ravel(a) for a in jax.tree.leaves(o)]) for o in outs]
        return self.objective.eval_metrics(np.sum(flat, axis=0, dtype=np.float64))


class ProfileHook(Hook):
    """Traces steps first..last of `profile.steps` on process 0. The trace opens once step first-1
    is settled (before the invocation's first step when that one is in the range, as after a
    resume inside it) and closes once step last has finished; a run stopped inside the range
    still writes its trace (`Goodput.cleanup`)."""

    def __init__(self, cfg: Config, goodput: Goodput):
        self.first, self.last = cfg.profile.steps
        self.dir, self.goodput = os.path.join(cfg.run.dir, PROFILE_DIR), goodput
        self.opened = 0  # the first step traced; 0: no trace open

    def begin(self, start: int, state: TrainState) -> None:
        if self.first <= start + 1:
            self._open(start + 1)

    def due(self, step: int, stopping: bool) -> bool:
        return (step == self.first - 1 and not stopping) or (step == self.last and self.opened > 0)

    def run(self, step: int, state: TrainState, stopping: bool) -> None:
        if step < self.last:
            self._open(step + 1)
            return
        with self.goodput.phase("profile"):
            jax.block_until_ready(state)  # the trace holds all of the last step's device work
            self.goodput.cleanup.remove(self._close)
            self._close()

    def _open(self, first: int) -> None:
        with self.goodput.phase("profile"):
            jax.profiler.start_trace(self.dir)
        self.opened = first
        self.goodput.cleanup.append(self._close)

    def _close(self) -> None:
        jax.profiler.stop_trace()
        last = min(self.goodput.last_step or self.opened, self.last)
        print(f"profile of steps {self.opened}..{last} written to {self.dir}", flush=True)

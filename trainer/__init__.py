"""The loop's parts: train state, step, optimizer, checkpointing, metrics, and the run itself.

Importing it sets the stack's XLA flags (trainer.xla_env) before any backend starts.
"""

from trainer.xla_env import set_default_flags

set_default_flags()

from trainer.faults import Preempted, RunStopped, TooManyBadSteps
from trainer.loop import run
from trainer.program import abstract_program, collective_counts, prepare

__all__ = ["Preempted", "RunStopped", "TooManyBadSteps", "abstract_program", "collective_counts", "prepare", "run"]

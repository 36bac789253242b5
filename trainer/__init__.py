"""The loop's parts: train state, step, optimizer, checkpointing, metrics, and the run itself.

Importing it changes no environment variable: entry points call `set_default_flags` (the stack's
XLA flags, trainer/xla_env.py) before JAX starts its backend.
"""

from trainer.faults import Preempted, RunStopped, TooManyBadSteps
from trainer.loop import run
from trainer.program import abstract_program, collective_counts, prepare
from trainer.xla_env import set_default_flags

__all__ = ["Preempted", "RunStopped", "TooManyBadSteps", "abstract_program", "collective_counts", "prepare", "run",
           "set_default_flags"]

"""The loop's parts: train state, step, optimizer, checkpointing, metrics, and the run itself.

Importing it changes no environment variable: entry points call `set_default_flags` (the stack's
XLA flags, ops/xla_env.py) before JAX starts its backend.
"""

from ops.faults import Preempted, RunStopped, TooManyBadSteps
from trainer.loop import run
from trainer.program import abstract_program
from trainer.spec import prepare
from ops.xla_env import set_default_flags

__all__ = ["Preempted", "RunStopped", "TooManyBadSteps", "abstract_program", "prepare", "run",
           "set_default_flags"]

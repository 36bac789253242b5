"""The loop's parts: train state, step, optimizer, checkpointing, metrics, and the run itself.

Importing it changes no environment variable: entry points call `set_default_flags` (the stack's
XLA flags, ops/xla_env.py) before JAX starts its backend.
"""

from ops.faults import Preempted, RunStopped, TooManyBadSteps, exit_at_once
from ops.xla_env import set_default_flags
from trainer.checks import check_devices
from trainer.kernels import attention_notes
from trainer.loop import run
from trainer.program import abstract_program, fill_microbatches, sharded_optimizer
from trainer.spec import RunSpec, prepare
from trainer.state import abstract_state

__all__ = ["Preempted", "RunSpec", "RunStopped", "TooManyBadSteps", "abstract_program", "abstract_state",
           "attention_notes", "check_devices", "exit_at_once", "fill_microbatches", "prepare", "run",
           "set_default_flags", "sharded_optimizer"]

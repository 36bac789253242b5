"""The loop's parts: train state, step, optimizer, checkpointing, metrics, and the run itself."""

from trainer.faults import Preempted, RunStopped, TooManyBadSteps
from trainer.loop import run
from trainer.program import abstract_program, collective_counts, prepare

__all__ = ["Preempted", "RunStopped", "TooManyBadSteps", "abstract_program", "collective_counts", "prepare", "run"]

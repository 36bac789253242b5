"""The loop's parts: train state, step, optimizer, checkpointing, metrics, and the run itself."""

from trainer.loop import run
from trainer.program import abstract_program, collective_counts, prepare

__all__ = ["abstract_program", "collective_counts", "prepare", "run"]

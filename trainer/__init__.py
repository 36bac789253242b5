"""The loop's parts: train state, step, optimizer, checkpointing, metrics, and the run itself."""

from trainer.loop import prepare, run

__all__ = ["prepare", "run"]

"""Orbax checkpoints of the train state and the Grain iterator, saved together.

Saves are asynchronous: the arrays are copied off the device before `save` returns (so the
next step may donate them) and written to disk in the background. A step directory becomes
visible only once complete, so a crash mid-save leaves the previous checkpoints intact.
"""

from __future__ import annotations

import os

import grain
import orbax.checkpoint as ocp

from configs.schema import CheckpointConfig
from trainer.state import TrainState


class Checkpointer:
    def __init__(self, directory: str, cfg: CheckpointConfig):
        self.directory = os.path.abspath(directory)
        self.every = cfg.every
        options = ocp.CheckpointManagerOptions(max_to_keep=cfg.keep, enable_async_checkpointing=cfg.async_save)
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=("state", "data"))

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self.manager.all_steps())

    def due(self, step: int) -> bool:
        return step % self.every == 0

    def save(self, step: int, state: TrainState, iterator: grain.DatasetIterator) -> None:
        args = ocp.args.Composite(state=ocp.args.StandardSave(state), data=grain.checkpoint.CheckpointSave(iterator))
        self.manager.save(step, args=args, force=True)

    def restore(self, step: int, target: TrainState, iterator: grain.DatasetIterator) -> TrainState:
        """Restores into `target`'s shapes and shardings (any mesh) and rewinds `iterator`."""
        args = ocp.args.Composite(
            state=ocp.args.StandardRestore(target), data=grain.checkpoint.CheckpointRestore(iterator)
        )
        return self.manager.restore(step, args=args).state

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.close()

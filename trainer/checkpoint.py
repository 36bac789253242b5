"""Orbax checkpoints of the train state and the Grain iterator, saved together.

Saves are asynchronous: the arrays are copied off the device before `save` returns (so the
next step may donate them) and written to disk in the background. A step directory becomes
visible only once complete, so a crash mid-save leaves the previous checkpoints intact.
"""

from __future__ import annotations

import os

import grain
import orbax.checkpoint as ocp

from configs import Config, ConfigError, load_config
from configs.schema import CheckpointConfig
from trainer.state import TrainState

# Keys a resumed run must share with the run that wrote the checkpoints: they fix the shapes
# of the state, or which example comes at which step (exact data continuation).
RESUME_KEYS = (
    "model.num_layers", "model.d_model", "model.num_heads", "model.num_kv_heads", "model.resolved_head_dim",
    "model.d_ff", "model.vocab_size", "model.tie_embeddings", "model.seq_len",
    "train.global_batch", "run.seed", "data.source", "data.path",
)


def _get(cfg: Config, key: str) -> object:
    section, name = key.split(".")
    return getattr(getattr(cfg, section), name)


def check_resumable(cfg: Config) -> None:
    """If run.dir holds checkpoints, the new config must fit them. Raises ConfigError naming
    the first key that differs, before anything in run.dir is touched."""
    saved = os.path.join(cfg.run.dir, "config.yaml")
    ckpt_dir = os.path.join(cfg.run.dir, "checkpoints")
    if not (os.path.exists(saved) and os.path.isdir(ckpt_dir) and os.listdir(ckpt_dir)):
        return
    old = load_config(saved)
    for key in RESUME_KEYS:
        if _get(old, key) != _get(cfg, key):
            name = key.replace("resolved_", "")
            raise ConfigError(
                f"{name}={_get(cfg, key)!r} differs from {_get(old, key)!r} in the checkpoints of run.dir={cfg.run.dir}; "
                "resume with the same value or use a new run.dir"
            )
    if (old.optim.clip > 0) != (cfg.optim.clip > 0):
        raise ConfigError(
            f"optim.clip={cfg.optim.clip} turns clipping {'on' if cfg.optim.clip else 'off'}, which changes the "
            f"optimizer state saved in run.dir={cfg.run.dir}; use a new run.dir"
        )


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

"""Orbax checkpoints of the train state and the data position, saved together.

Saves are asynchronous: the arrays are copied off the device before `save` returns (so the
next step may donate them) and written to disk in the background, into a temporary directory
that is renamed to the step only once complete: a crash mid-save leaves the previous
checkpoints intact and the half-written one is ignored (and cleaned up) on restart. A
checkpoint that exists but cannot be read is skipped with a warning for the one before it.
"""

from __future__ import annotations

import os
import time
from typing import Callable

import grain
import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from configs import Config, ConfigError, load_config
from configs.schema import CheckpointConfig
from trainer.state import TrainState

# Keys a resumed run must share with the run that wrote the checkpoints: they fix the shapes
# of the state, or which example comes at which step (exact data continuation).
RESUME_KEYS = (
    "model.num_layers", "model.d_model", "model.num_heads", "model.num_kv_heads", "model.resolved_head_dim",
    "model.d_ff", "model.vocab_size", "model.tie_embeddings", "model.seq_len",
    "train.global_batch", "run.seed", "data.source", "data.path", "data.mixture", "data.tokenizer",
    "data.packing", "data.eval_fraction",
)


def _get(cfg: Config, key: str) -> object:
    section, name = key.split(".")
    return getattr(getattr(cfg, section), name)


def checkpoint_dir(run_dir: str) -> str:
    return os.path.join(run_dir, "checkpoints")


def has_checkpoints(run_dir: str) -> bool:
    """Whether run_dir/checkpoints holds anything: a run that will resume rather than start."""
    ckpt_dir = checkpoint_dir(run_dir)
    return os.path.isdir(ckpt_dir) and bool(os.listdir(ckpt_dir))


def saved_config(run_dir: str) -> Config | None:
    """The config of the run whose checkpoints run_dir holds (its config.yaml), or None when
    there are no checkpoints to resume."""
    saved = os.path.join(run_dir, "config.yaml")
    if not (os.path.exists(saved) and has_checkpoints(run_dir)):
        return None
    return load_config(saved)


def check_resumable(cfg: Config) -> None:
    """If run.dir holds checkpoints, the new config must fit them. Raises ConfigError naming
    the first key that differs, before anything in run.dir is touched."""
    old = saved_config(cfg.run.dir)
    if old is None:
        return
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


def _everywhere(ok: bool) -> bool:
    """True only if `ok` holds on every process."""
    if jax.process_count() == 1:
        return ok
    return bool(np.all(multihost_utils.process_allgather(np.array(ok))))


class NoReadableCheckpoint(ConfigError):
    """run.dir has checkpoints and none of them can be read."""


class Checkpointer:
    """The run's CheckpointManager: state and data position saved together, restored with
    fallback past damaged checkpoints."""

    def __init__(self, directory: str, cfg: CheckpointConfig):
        self.directory = os.path.abspath(directory)
        self.every = cfg.every
        self.fresh_if_unreadable = cfg.fresh_if_unreadable
        options = ocp.CheckpointManagerOptions(
            max_to_keep=cfg.keep, enable_async_checkpointing=cfg.async_save, cleanup_tmp_directories=True
        )
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=("state", "data"))

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def due(self, step: int) -> bool:
        return step % self.every == 0

    def save(self, step: int, state: TrainState, iterator: grain.DatasetIterator) -> None:
        """Starts an asynchronous save. The data position is the iterator's state, which our
        pipeline makes the same on every process (see data.pipeline), so process 0's is saved
        and any process count can restore it."""
        args = ocp.args.Composite(state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(iterator.get_state()))
        self.manager.save(step, args=args, force=True)

    def restore(self, step: int, target: TrainState, iterator: grain.DatasetIterator) -> TrainState:
        """Restores into `target`'s shapes and shardings (any mesh) and rewinds `iterator`."""
        args = ocp.args.Composite(state=ocp.args.StandardRestore(target), data=ocp.args.JsonRestore())
        restored = self.manager.restore(step, args=args)
        iterator.set_state(restored.data)
        return restored.state

    def restore_latest(
        self, target: TrainState, iterator: grain.DatasetIterator, warn: Callable[[str], None]
    ) -> tuple[int, TrainState] | None:
        """The newest readable checkpoint, falling back past damaged ones (moved aside to
        `checkpoints.damaged/` so new saves can take their step). None when there are none, or
        none readable and `checkpoint.fresh_if_unreadable`; otherwise NoReadableCheckpoint."""
        steps = sorted(self.manager.all_steps(), reverse=True)
        damaged = []
        for step in steps:
            state, reason = None, ""
            try:
                state = self.restore(step, target, iterator)
            except Exception as e:  # truncated or missing files, bad metadata: all unreadable
                reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
            if not _everywhere(state is not None):  # one process's shards may be the damaged ones
                warn(f"warning: checkpoint {os.path.join(self.directory, str(step))} cannot be read ({reason or 'on another process'})")
                damaged.append(step)
                continue
            self._move_aside(damaged)
            return step, state
        if not steps:
            return None
        if self.fresh_if_unreadable:
            warn(f"warning: no checkpoint in {self.directory} can be read; starting over (checkpoint.fresh_if_unreadable)")
            self._move_aside(damaged)
            return None
        raise NoReadableCheckpoint(
            f"no checkpoint in {self.directory} can be read (tried steps {', '.join(map(str, steps))}); "
            "set checkpoint.fresh_if_unreadable=true to start over"
        )

    def _move_aside(self, steps: list[int]) -> None:
        if not steps:
            return
        if jax.process_index() == 0:
            aside = self.directory + ".damaged"
            os.makedirs(aside, exist_ok=True)
            for step in steps:
                os.replace(os.path.join(self.directory, str(step)), os.path.join(aside, f"{step}-{int(time.time())}"))
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices("checkpoints moved aside")
        self.manager.reload()

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.close()

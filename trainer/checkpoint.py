"""Orbax checkpoints of the train state and the data position, saved together.

Saves are asynchronous: the arrays are copied off the device before `save` returns (so the
next step may donate them) and written to disk in the background, into a temporary directory
that is renamed to the step only once complete: a crash mid-save leaves the previous
checkpoints intact and the half-written one is ignored (and cleaned up) on restart. A
checkpoint that exists but cannot be read is moved aside, with one warning line, for the one
before it. A failed read leaves the checkpoint library's background tasks failing after it
(tracebacks by the hundred: "Event loop is closed", "Exception ignored in: <coroutine ...>",
"Task exception was never retrieved"); from the first failed read to the end of the run those go
to `run.dir/library.log` (`LibraryLog`), not the console.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
import sys
import threading
import time
from typing import TYPE_CHECKING, Callable, NoReturn

import grain
import jax
import orbax.checkpoint as ocp
from absl import flags
from jax.experimental import multihost_utils

import storage
from configs import Config, ConfigError, dump_config, load_config, resume_keys
from configs.schema import CheckpointConfig
from model import lora
from model.transformer import param_shapes
from trainer.state import TrainState, frozen_base
from ops.library_log import LibraryLog, library_log_path
from trainer.object_store import manager_options
from trainer.tiers import LocalTier, everywhere, local_steps, this_process_dir

if TYPE_CHECKING:  # the objectives import this module (a teacher's checkpoint)
    from trainer.objectives.registry import Stage

# A checkpoint's items: the train state and data position, and what an objective's stage carries
# past the step (its batch and that batch's fields and metrics), where it carries anything.
ITEMS = ("state", "data", "stage", "stage_info")


def _get(cfg: Config, key: str) -> object:
    for name in key.split("."):
        cfg = getattr(cfg, name)
    return cfg


def checkpoint_dir(run_dir: str) -> str:
    return storage.join(run_dir, "checkpoints")


def has_checkpoints(run_dir: str) -> bool:
    """Whether run_dir/checkpoints holds anything: a run that will resume rather than start."""
    ckpt_dir = checkpoint_dir(run_dir)
    return storage.isdir(ckpt_dir) and bool(storage.listdir(ckpt_dir))


@dataclasses.dataclass(frozen=True)
class RunDir:
    """What run.dir holds before a run writes there, read once (`read_run_dir`): every later
    question (does the config fit the checkpoints, which schedule horizon, import init.from_hf or
    resume, keep the old config.yaml aside) reads this value instead of the disk.

    A training run reads it twice, each in one place: `trainer.program.prepare`, before the lock,
    to refuse bad input with nothing written; then `trainer.session.reread`, under run.dir's lock,
    because a run alive at the first read may have saved since."""

    path: str
    checkpoints: bool  # checkpoints/ holds anything: the persistent tier has something to resume
    config_text: str | None  # config.yaml as found; None: there is none
    saved: Config | None  # the config of the checkpoints of either tier (config.yaml); None without any
    local_steps: tuple[int, ...] = ()  # this process's steps in the local tier, for this layout
    local: bool = False  # some process's local tier holds a step of this layout

    @property
    def resumes(self) -> bool:
        """Whether the run finds checkpoints in either tier: it resumes rather than starts (unless
        none of them can be read)."""
        return self.checkpoints or self.local


def read_run_dir(run_dir: str, local_dir: str | None = None) -> RunDir:
    """run_dir as it is now, and the local tier's steps in `local_dir` (this process's folder of
    the run's local tier for its layout, trainer.tiers.this_process_dir; None: no tier). config.yaml
    is parsed only beside checkpoints of either tier: it is then the config of the run they resume.
    With a local tier every process must call this: whether any holds a step is agreed on by all,
    so that they take the same decisions (a replaced host's empty disk resumes as its peers do)."""
    path = storage.join(run_dir, "config.yaml")
    checkpoints, text = has_checkpoints(run_dir), None
    if storage.exists(path):
        text = storage.read_text(path)
    steps = local_steps(local_dir)
    local = local_dir is not None and not everywhere(not steps)
    saved = load_config(path) if (checkpoints or local) and text is not None else None
    return RunDir(run_dir, checkpoints, text, saved, steps, local)


def read_run(cfg: Config, sizes: dict[str, int]) -> RunDir:
    """run.dir and this process's local tier for a mesh of `sizes` (Layout.sizes), as a run of
    `cfg` finds them (read_run_dir)."""
    return read_run_dir(cfg.run.dir, this_process_dir(cfg, sizes))


def write_config(cfg: Config, found: RunDir, resume_step: int) -> None:
    """Writes the resolved config; a different one found there is kept as config.step<N>.yaml
    (the config that produced the checkpoints up to step N)."""
    if jax.process_index() != 0:
        return
    storage.makedirs(cfg.run.dir)
    path, text = storage.join(cfg.run.dir, "config.yaml"), dump_config(cfg)
    if found.config_text is not None and found.config_text != text:
        storage.rename(path, storage.join(cfg.run.dir, f"config.step{resume_step}.yaml"))
    storage.write_text(path, text)


def find_checkpoint(run_dir: str, step: int | None = None) -> tuple[Config, int]:
    """(the run's config, the newest or the asked-for checkpoint step). Raises ConfigError naming
    --run-dir or --step; reads nothing but config.yaml and the checkpoint folder's names."""
    cfg_path = storage.join(run_dir, "config.yaml")
    if not storage.exists(cfg_path):
        raise ConfigError(f"--run-dir: no config.yaml in {run_dir}")
    cfg = load_config(cfg_path)
    ckpt_dir = storage.absolute(checkpoint_dir(run_dir))
    steps = sorted(int(s) for s in storage.listdir(ckpt_dir) if s.isdigit())
    if not steps:
        raise ConfigError(f"--run-dir: no checkpoints in {ckpt_dir}")
    step = steps[-1] if step is None else step
    if step not in steps:
        raise ConfigError(f"--step: no checkpoint for step {step} in {ckpt_dir} (steps: {', '.join(map(str, steps))})")
    return cfg, step


def restore_params(run_dir: str, step: int | None = None, device: jax.Device | None = None,
                   shardings: dict | None = None) -> tuple[Config, int, dict]:
    """(the run's config, the step, its parameters on `device`, or sharded as `shardings` says)
    of the newest (or `step`) checkpoint, whatever mesh it was saved from (Orbax reassembles the
    shards): nothing but the parameters is read; the optimizer state and data position stay on disk.
    A LoRA run's frozen base comes from where it started (`saved`)."""
    cfg, step = find_checkpoint(run_dir, step)
    ckpt_dir = storage.absolute(checkpoint_dir(run_dir))
    shapes = param_shapes(cfg.model)
    if shardings is None:
        shardings = jax.tree.map(lambda _: jax.sharding.SingleDeviceSharding(device or jax.devices()[0]), shapes)
    target = {"params": jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                                     saved(shapes), saved(shardings))}
    restore_args = jax.tree.map(
        lambda s: ocp.ArrayRestoreArgs(sharding=s.sharding, global_shape=s.shape, dtype=s.dtype), target
    )
    options = ocp.CheckpointManagerOptions(**manager_options(ckpt_dir))
    with ocp.CheckpointManager(ckpt_dir, options=options, item_names=("state", "data")) as manager:
        state_args = ocp.args.PyTreeRestore(item=target, restore_args=restore_args, partial_restore=True)
        restored = manager.restore(step, args=ocp.args.Composite(state=state_args))
    params = restored.state["params"]
    if cfg.model.lora.enabled:
        params = lora.join(params, frozen_base(cfg.model, cfg.init.from_hf, cfg.run.seed, shardings))
    return cfg, step, params


def saved(params: dict) -> dict:
    """What a checkpoint holds of the parameters: all of them, or a LoRA run's adapters alone
    (its frozen base is read again from init.from_hf, or drawn again from run.seed:
    `trainer.state.frozen_base`)."""
    adapters = lora.split(params)[0]
    return adapters or params


def check_resumable(cfg: Config, found: RunDir | None = None) -> None:
    """If run.dir holds checkpoints, the new config must fit them. Raises ConfigError naming
    the first key that differs, before anything in run.dir is touched. `found`: run.dir as the
    caller read it (read now when not given)."""
    found = read_run_dir(cfg.run.dir) if found is None else found
    old = found.saved
    if old is None:
        return
    # The keys marked Resume in the schema fix the shapes of the state, or which example comes at
    # which step; a resolved one (model.head_dim) is compared through its property, named by its key.
    for key, read in resume_keys().items():
        if _get(old, read) != _get(cfg, read):
            raise ConfigError(
                f"{key}={_get(cfg, read)!r} differs from {_get(old, read)!r} in the checkpoints of run.dir={cfg.run.dir}"
                f"{_tier_note(found)}; resume with the same value or use a new run.dir"
            )
    if old.model.lora.enabled and old.init.from_hf != cfg.init.from_hf:
        raise ConfigError(
            f"init.from_hf={cfg.init.from_hf!r} differs from {old.init.from_hf!r}, the frozen base of the LoRA "
            f"checkpoints in run.dir={cfg.run.dir} (they hold the adapters alone); resume with the same base"
        )
    if old.model.moe.router_bias != cfg.model.moe.router_bias:
        raise ConfigError(
            f"model.moe.router={cfg.model.moe.router} {'adds' if cfg.model.moe.router_bias else 'drops'} the sigmoid "
            f"router's bias, a parameter the checkpoints of run.dir={cfg.run.dir} do not match; use a new run.dir"
        )
    if (old.optim.clip > 0) != (cfg.optim.clip > 0):
        raise ConfigError(
            f"optim.clip={cfg.optim.clip} turns clipping {'on' if cfg.optim.clip else 'off'}, which changes the "
            f"optimizer state saved in run.dir={cfg.run.dir}; use a new run.dir"
        )
    _check_reference(cfg, old)


def _check_reference(cfg: Config, old: Config) -> None:
    """The frozen copy of the starting weights (DPO's and GRPO's reference) is in the saved state
    or not: a resumed run must agree, or its checkpoints read as unreadable."""
    # Here: the objectives import the step code that imports this module. Importing the registry
    # runs trainer/objectives/__init__ first, which registers every objective.
    from trainer.objectives.registry import get

    was, now = (get(c.train.objective)(c) for c in (old, cfg))
    if was.holds_reference == now.holds_reference:
        return
    changed = [k for k in ("train.objective", *now.reference_keys, *was.reference_keys) if _get(old, k) != _get(cfg, k)]
    key = changed[0] if changed else "train.objective"
    raise ConfigError(
        f"{key}={_get(cfg, key)!r} {'adds' if now.holds_reference else 'drops'} the frozen copy of the starting "
        f"weights, which the checkpoints of run.dir={cfg.run.dir} {'lack' if now.holds_reference else 'hold'}; "
        f"resume with {key}={_get(old, key)!r} or use a new run.dir"
    )


def _fields(batch: dict) -> dict[str, list]:
    """Each array's [shape, dtype] (arrays or their abstract shapes), as a checkpoint's stage_info
    records them: a resumed run takes a held batch back only into the same."""
    return {k: [list(v.shape), str(v.dtype)] for k, v in batch.items()}


def _tier_note(found: RunDir) -> str:
    """Where the checkpoints are when only the local tier holds any (a user sees run.dir/checkpoints empty)."""
    if found.checkpoints or not found.local:
        return ""
    held = f"step(s) {', '.join(map(str, found.local_steps))}" if found.local_steps else "steps on other processes"
    return f" (the local tier's {held}, checkpoint.local_dir)"


class NoReadableCheckpoint(ConfigError):
    """run.dir has checkpoints and none of them can be read."""


def _why(error: Exception) -> str:
    """The root cause of a failed read, on one line: the innermost exception of the chain, whose
    message names the file or array (the outer ones repeat a whole TensorStore spec)."""
    while (inner := error.__cause__ or error.__context__) is not None:
        error = inner
    text = error.args[0] if isinstance(error, KeyError) and error.args else str(error)
    first = " ".join(text.split("\n", 1)[0].split())
    return f"{type(error).__name__}: {first}" if first else type(error).__name__


def save_replicas_whole() -> None:
    """With one process, each replicated array is saved from one replica. Orbax's default
    (replica-parallel saving) has every replica write a slice of it, which spreads the writing
    over the hosts holding replicas; with one host there is nothing to spread, and each slice is
    a jit-compiled device slice per device and array shape, which dominates a small run's first
    save. Orbax offers no public switch on the registered jax.Array handler, so a copy of it with
    the option off replaces it (process-wide: a process runs one training)."""
    handler = copy.copy(ocp.type_handlers.get_type_handler(jax.Array))
    if getattr(handler, "_use_replica_parallel", False):
        handler._use_replica_parallel = False
        absl_log = logging.getLogger("absl")
        absl_log.addFilter(_not_the_override_notice)
        try:
            ocp.type_handlers.register_type_handler(jax.Array, handler, override=True)
        finally:
            absl_log.removeFilter(_not_the_override_notice)


def coordination_barriers() -> None:
    """With several processes, Orbax's barriers (eight in a local save, on the loop's thread) wait at
    the coordination service that jax.distributed started, instead of each running an all-gather
    compiled for the devices: one round trip to the coordinator, no program on the devices. Orbax's
    switch is an absl flag, read only once absl flags count as parsed; nothing here parses them, so
    they are marked parsed with their defaults, as data.pipeline does for Grain's workers
    (process-wide: a process runs one training)."""
    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()
    flags.FLAGS.experimental_orbax_use_distributed_barrier = True


def _not_the_override_notice(record: logging.LogRecord) -> bool:
    """Drops Orbax's warning that a type's handler was replaced (`Type handler registry type
    ... overriding ...`): here the replacement is the point, and the line is not about the run."""
    return not str(record.msg).startswith("Type handler registry type")


class Checkpointer:
    """The run's CheckpointManager: state and data position saved together, restored with
    fallback past damaged checkpoints."""

    def __init__(self, directory: str, cfg: CheckpointConfig):
        if jax.process_count() == 1:
            save_replicas_whole()
        else:
            coordination_barriers()
        self.directory = storage.absolute(directory)
        self.every = cfg.every
        self.fresh_if_unreadable = cfg.fresh_if_unreadable
        options = ocp.CheckpointManagerOptions(
            max_to_keep=cfg.keep, enable_async_checkpointing=cfg.async_save, cleanup_tmp_directories=True,
            **manager_options(self.directory),
        )
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=ITEMS)
        self.library_log = LibraryLog(library_log_path(storage.parent(self.directory)))
        self.library_log.divert_outages(storage.is_remote(self.directory))
        self.local: LocalTier | None = None  # the local tier, when checkpoint.local_dir is set (attach_local)
        self.restored_tier = ""  # "local" or "persistent" once restore_latest has found a step
        # An objective's stage whose batches outlive a step (GRPO's rollouts), and their abstract
        # shapes with the batch sharding: what a checkpoint holds of it (attach_stage).
        self.stage: Stage | None = None
        self.stage_target: dict = {}
        self._closed = False
        # The newest step in `directory` known committed, kept here so that it can be told without
        # asking the store (StoreDown's line), and the save in flight that may commit next.
        self.committed: int | None = self.manager.latest_step()
        self._async, self._saving = cfg.async_save, None

    def attach_stage(self, stage: Stage, target: dict) -> None:
        """Saves hold what `stage` carries past their step, restored into `target`'s shapes and
        shardings (a step's batch, Program.abstract_batch) and handed back to it."""
        self.stage, self.stage_target = stage, target

    def attach_local(self, local: LocalTier) -> None:
        self.local = local

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
        state = state.replace(params=saved(state.params))
        items = {"state": ocp.args.StandardSave(state), "data": ocp.args.JsonSave(iterator.get_state())}
        carried = None if self.stage is None else self.stage.carried(step)
        if carried is not None:
            batch, metrics = carried
            items.update(stage=ocp.args.StandardSave(batch),
                         stage_info=ocp.args.JsonSave({"fields": _fields(batch), "metrics": metrics}))
        self.manager.save(step, args=ocp.args.Composite(**items), force=True)  # raises if the previous save failed
        self._finished()
        self._saving = step
        if not self._async:
            self._finished()

    @property
    def cut_short(self) -> bool:
        """Whether the object store cut a save short (Orbax logged it: `LibraryLog.outage`)."""
        return self.library_log.outage is not None

    def _finished(self) -> None:
        """The save in flight committed (Orbax has joined it without an error); one the object
        store cut short, which Orbax only logs (`LibraryLog.outage`), is raised here instead, as
        storage.LeftRunning over the outage."""
        if self._saving is None:
            return
        if self.library_log.outage is not None:
            self._cut_short(self.library_log.outage)
        self.committed, self._saving = self._saving, None

    def _cut_short(self, outage: BaseException) -> NoReturn:
        """Raises storage.LeftRunning over `outage`, the error that cut the save in flight short:
        its threads wait for good, and the run exits without joining them (ops.faults.StoreDown)."""
        step, self._saving = self._saving, None
        raise storage.LeftRunning(f"saving {self.directory if step is None else self._path(step)}") from outage

    def restore(self, step: int, target: TrainState, iterator: grain.DatasetIterator) -> TrainState:
        """Restores into `target`'s shapes and shardings (any mesh) and rewinds `iterator`. A LoRA
        state comes back with its adapters alone (`saved`): the caller joins the frozen base."""
        target = target.replace(params=saved(target.params))
        args = ocp.args.Composite(state=ocp.args.StandardRestore(target), data=ocp.args.JsonRestore())
        restored = self.manager.restore(step, args=args)
        iterator.set_state(restored.data)
        return restored.state

    def restore_latest(
        self, target: TrainState, iterator: grain.DatasetIterator, warn: Callable[[str], None]
    ) -> tuple[int, TrainState] | None:
        """The newest readable checkpoint, falling back past damaged ones (moved aside to
        `checkpoints.damaged/` so new saves can take their step), each named in one warning line.
        None when there are none, or none readable and `checkpoint.fresh_if_unreadable`; otherwise
        NoReadableCheckpoint."""
        steps = sorted(self.manager.all_steps(), reverse=True)
        if self.local is not None:
            found = self.local.restore_newer_than(steps[0] if steps else None, target, iterator, warn)
            if found is not None:
                self.restored_tier = "local"
                return found
        self.restored_tier = "persistent"
        found = self._restore_persistent(steps, target, iterator, warn)
        if self.local is not None:
            self.local.drop_newer_than(found[0] if found else 0, warn)
        if found is not None and self.stage is not None:
            self.stage.resume(self._carried(found[0], warn))
        return found

    def _carried(self, step: int, warn: Callable[[str], None]) -> tuple[dict, dict] | None:
        """What the persistent checkpoint of `step` holds of the stage (None: nothing, as at a
        local step). A batch made for other shapes (an rl key changed on resume) or one that
        cannot be read is left, with one warning line: the next step makes a new one (the state
        itself was read)."""
        if not storage.exists(storage.join(self._path(step), "stage_info")):
            return None
        then = f"step {step + 1} makes a new one"
        try:
            info = self.manager.restore(step, args=ocp.args.Composite(stage_info=ocp.args.JsonRestore())).stage_info
            fields = _fields(self.stage_target)
            differ = [k for k in sorted(set(info["fields"]) | set(fields)) if info["fields"].get(k) != fields.get(k)]
            if differ:
                k = differ[0]
                warn(f"warning: checkpoint {self._path(step)} holds a batch made for another config ({k}: "
                     f"{info['fields'].get(k)}, this run's {fields.get(k)}); {then}")
                return None
            target = ocp.args.StandardRestore(self.stage_target)
            return self.manager.restore(step, args=ocp.args.Composite(stage=target)).stage, info["metrics"]
        except Exception as e:  # a damaged batch costs its resampling, not the checkpoint
            warn(f"warning: the batch checkpoint {self._path(step)} holds cannot be read ({_why(e)}); {then}")
            return None

    def _restore_persistent(
        self, steps: list[int], target: TrainState, iterator: grain.DatasetIterator, warn: Callable[[str], None]
    ) -> tuple[int, TrainState] | None:
        """restore_latest's persistent tier, `steps` newest first."""
        damaged: dict[int, str] = {}  # step -> why it cannot be read
        for step in steps:
            state, reason = None, ""
            # Started before the read: a failing read's background tasks may report before the
            # read itself raises. Stopped again after a clean first read.
            self.library_log.start()
            try:
                state = self.restore(step, target, iterator)
            except Exception as e:  # truncated or missing files, bad metadata: all unreadable
                if storage.unreachable(e) is not None:  # the store is down, not the checkpoint damaged:
                    # the run stops (ops.faults.StoreDown), without joining the read's threads
                    raise storage.LeftRunning(f"restoring {self._path(step)}") from e
                self.library_log.note(f"checkpoint {self._path(step)} cannot be read:", e)
                reason = _why(e)
            if state is not None and not damaged and reason == "":
                self.library_log.stop(collect=False)  # the first read was clean: nothing failed to collect
            if not everywhere(state is not None):  # one process's shards may be the damaged ones
                damaged[step] = reason or "on another process"
                continue
            self._warn_moved(damaged, f"resuming from step {step} instead", warn)
            return step, state
        if not steps:
            return None
        if self.fresh_if_unreadable:
            self._warn_moved(damaged, "no readable checkpoint is left: starting over (checkpoint.fresh_if_unreadable)", warn)
            return None
        for step, reason in damaged.items():
            warn(f"warning: checkpoint {self._path(step)} cannot be read ({reason}){self._see_log()}")
        raise NoReadableCheckpoint(
            f"no checkpoint in {self.directory} can be read (tried steps {', '.join(map(str, steps))}); "
            "set checkpoint.fresh_if_unreadable=true to start over"
        )

    def _path(self, step: int) -> str:
        return storage.join(self.directory, str(step))

    def _see_log(self) -> str:
        return f" (library messages: {self.library_log.path})" if os.path.exists(self.library_log.path) else ""

    def _warn_moved(self, damaged: dict[int, str], then: str, warn: Callable[[str], None]) -> None:
        """Moves the damaged checkpoints aside and says, one line each, what is wrong, where it
        went and what the run does instead."""
        moved = self._move_aside(list(damaged))
        for step, reason in damaged.items():
            warn(f"warning: checkpoint {self._path(step)} cannot be read ({reason}); moved to {moved[step]}; "
                 f"{then}{self._see_log()}")

    def _move_aside(self, steps: list[int]) -> dict[int, str]:
        """Moves `steps` to checkpoints.damaged/<step>-<time>; returns where each went."""
        if not steps:
            return {}
        aside = self.directory + ".damaged"
        stamp = int(time.time())
        moved = {step: storage.join(aside, f"{step}-{stamp}") for step in steps}
        if jax.process_index() == 0:
            storage.makedirs(aside)
            for step, path in moved.items():
                storage.rename(self._path(step), path)
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices("checkpoints moved aside")
        self.manager.reload()
        self.committed = self.manager.latest_step()
        return moved

    def _join(self, wait: Callable[[], None]) -> None:
        """Orbax's blocking `wait` for the save in flight, unless the object store cuts that save
        short first: Orbax logs it (LibraryLog.outage), and with several processes each one's
        save threads then wait on the others' signals for good; the caller's `_finished` then
        raises the outage instead of waiting on. A `wait` that raises the outage is a save cut
        short alike (storage.LeftRunning)."""
        if not storage.is_remote(self.directory):
            return wait()
        failed: list[BaseException] = []

        def run() -> None:
            try:
                wait()
            except BaseException as e:  # raised below, in the caller's thread
                failed.append(e)

        waiter = threading.Thread(target=run, daemon=True, name="checkpoint-wait")
        waiter.start()
        while waiter.is_alive() and self.library_log.outage is None:
            waiter.join(0.2)
        if failed:
            # Orbax may re-raise the outage from `wait` before its save thread has logged it.
            if storage.unreachable(failed[0]) is not None:
                self._cut_short(failed[0])
            raise failed[0]

    def wait(self) -> None:
        self._join(self.manager.wait_until_finished)
        self._finished()
        if self.local is not None:
            self.local.wait()

    def close(self) -> None:
        """Waits for saves in flight and stops the library log (left on after an outage); a second
        call does nothing."""
        if self._closed:
            return
        self._closed = True
        try:
            if self.local is not None:
                self.local.close()
            self._join(self.manager.close)
            self._finished()
        finally:
            # After an outage (a save it cut short, or the error ending the run: close runs in the
            # loop's `finally`) Orbax's save threads are left running and go on logging it until
            # the process exits: they stay diverted from the console.
            if not (self.cut_short or storage.unreachable(sys.exc_info()[1])):
                self.library_log.stop()
                self.library_log.divert_outages(False)

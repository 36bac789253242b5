"""The local checkpoint tier: frequent checkpoints on each host's own disk, held by a peer too.

Orbax's emergency peer-to-peer manager (`orbax.checkpoint.experimental.emergency.p2p`) does the
work: every process writes its own shards of the state and the Grain iterator's position into its
node-local directory every `checkpoint.local_every` steps, in the background after a blocking copy
off the devices, and on restore a process that lacks a
step (a replaced host starts with an empty disk) fetches its shards over TCP from the process
holding the same shards in another data-parallel replica (the mesh's `data` axis). A step counts
as complete when every shard is held by some process. The persistent tier stays the run's
`Checkpointer` (run.dir/checkpoints); `Checkpointer.restore_latest` asks this tier first and takes
its step when it is newer than the persistent tier's newest.

Each process has its own folder, `checkpoint.local_dir/<run>/<layout>/process<i>` (several
processes may share a host's disk), where <run> names run.dir so that another run's local steps
are never read, and <layout> the mesh and process count (`layout_tag`).

The data position is saved as a replicated array beside the state (`position_array`), inside the
one asynchronous item, not as the manager's Grain item: that item is written synchronously on the
loop's thread and gathers every process's position over the devices at each save, while our
pipeline's position is the same on every process (data.pipeline) and needs no gathering.
"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
import pathlib
import shutil
from typing import Callable

import grain
import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from orbax.checkpoint._src.multihost import multislice
from orbax.checkpoint.experimental.emergency.p2p import args as p2p_args
from orbax.checkpoint.experimental.emergency.p2p import checkpoint_manager as p2p
from orbax.checkpoint.experimental.emergency.p2p import options as p2p_options
from orbax.checkpoint.experimental.emergency.p2p import utils as p2p_utils

import storage
from configs import Config
from configs.writable import check_writable
from configs.schema import MESH_AXES
from trainer.state import TrainState

# Parameters and optimizer state are replicated over `data`: its replicas hold the same shards.
REPLICA_AXIS = "data"
# Room for the Grain iterator's state as JSON: a few dozen bytes without workers, about 35 more per worker.
POSITION_BYTES = 16384


def local_root(cfg: Config) -> str:
    """checkpoint.local_dir/<run.dir's name>-<a hash of its absolute path, or of its URL on a bucket>:
    the run's local tier (on this host's disk whatever run.dir is)."""
    run_dir = storage.absolute(cfg.run.dir)
    digest = hashlib.sha256(run_dir.encode()).hexdigest()[:10]
    return os.path.join(os.path.abspath(cfg.checkpoint.local_dir), f"{storage.basename(run_dir)}-{digest}")


def layout_tag(sizes: dict[str, int], processes: int) -> str:
    """'data8-2p': the mesh's axes above 1 and the process count. A local step holds one layout's
    shards, each process only its own: another layout would find chunks missing, which a read may
    fill with zeros, so each layout has its own folder and another layout resumes from the
    persistent tier."""
    return "-".join([f"{a}{n}" for a, n in sizes.items() if n > 1] or ["one"]) + f"-{processes}p"


def process_dir(cfg: Config, layout: str, index: int) -> str:
    """The folder of process `index` of a `layout` (layout_tag) in the run's local tier."""
    return os.path.join(local_root(cfg), layout, f"process{index}")


def this_process_dir(cfg: Config, sizes: dict[str, int]) -> str | None:
    """This process's folder of the run's local tier for a mesh of `sizes` (Layout.sizes, the
    mesh's shape); None when the run has no local tier."""
    if not cfg.checkpoint.local_dir:
        return None
    return process_dir(cfg, layout_tag(sizes, jax.process_count()), jax.process_index())


def local_steps(directory: str | None) -> tuple[int, ...]:
    """The steps in a process's local folder (this_process_dir), ascending; () before its first
    or without a tier."""
    if directory is None or not os.path.isdir(directory):
        return ()
    return tuple(sorted(int(d) for d in os.listdir(directory) if d.isdigit()))


def check_local_dir(cfg: Config) -> None:
    """checkpoint.local_dir must be a directory this process can write, or creatable (its nearest
    existing ancestor writable). Raises ConfigError; writes nothing."""
    check_writable(cfg.checkpoint.local_dir, "checkpoint.local_dir")


def everywhere(ok: bool) -> bool:
    """True only if `ok` holds on every process (trainer.checkpoint agrees on its reads with it too)."""
    if jax.process_count() == 1:
        return ok
    return bool(np.all(multihost_utils.process_allgather(np.array(ok))))


def _gathered(value: int) -> list[int]:
    """`value` of every process, by process index."""
    if jax.process_count() == 1:
        return [value]
    return [int(v) for v in multihost_utils.process_allgather(np.array(value))]


def position_array(position: dict, mesh: Mesh) -> jax.Array:
    """The Grain iterator's state as JSON bytes, zero-padded to POSITION_BYTES, replicated on `mesh`."""
    text = json.dumps(position).encode()
    if len(text) > POSITION_BYTES:
        raise ValueError(f"the data iterator's state takes {len(text)} bytes, more than the local tier's {POSITION_BYTES}")
    row = np.zeros(POSITION_BYTES, np.uint8)
    row[: len(text)] = np.frombuffer(text, np.uint8)
    return jax.make_array_from_callback(row.shape, NamedSharding(mesh, PartitionSpec()), lambda index: row[index])


def read_position(array: jax.Array) -> dict:
    """position_array's inverse, from this process's copy."""
    return json.loads(np.asarray(array.addressable_data(0)).tobytes().rstrip(b"\0"))


class LocalTier:
    """The run's local checkpoints, through Orbax's P2P emergency checkpoint manager."""

    def __init__(self, cfg: Config, mesh: Mesh, abstract: TrainState):
        self.every = cfg.checkpoint.local_every
        self.directory = this_process_dir(cfg, dict(mesh.shape))
        _drop_unusable(self.directory)
        os.makedirs(self.directory, exist_ok=True)
        options = p2p_options.CheckpointManagerOptions(
            local=p2p_options.LocalCheckpointOptions(save_interval_steps=self.every, max_to_keep=cfg.checkpoint.local_keep),
            replica_axis_index=MESH_AXES.index(REPLICA_AXIS),
        )
        self._log = _OrbaxLog()
        logging.getLogger("absl").addFilter(self._log)
        self.mesh = mesh
        self.manager = p2p.CheckpointManager(mesh, self._item(abstract), self.directory, None, options=options)
        self.peers = _peers_hold_copies(mesh)
        self._closed = False

    def _item(self, state: TrainState) -> dict:
        """The tree a local step holds, for `state` (arrays or their shapes): the state and the data
        position's shape (position_array)."""
        data = jax.ShapeDtypeStruct((POSITION_BYTES,), np.uint8, sharding=NamedSharding(self.mesh, PartitionSpec()))
        return {"train": state, "data": data}

    def due(self, step: int) -> bool:
        return step % self.every == 0

    def save(self, step: int, state: TrainState, iterator: grain.DatasetIterator) -> None:
        """Starts an asynchronous save of this process's shards and data position."""
        item = {"train": state, "data": position_array(iterator.get_state(), self.mesh)}
        self.manager.save(step, args=p2p_args.Composite(state=ocp.args.PyTreeSave(item)), force=True)

    def latest_step(self) -> int | None:
        """The newest step whose every shard some process holds (the same on every process)."""
        return self.manager.latest_step()

    def restore_newer_than(
        self, persistent: int | None, target: TrainState, iterator: grain.DatasetIterator, log: Callable[[str], None]
    ) -> tuple[int, TrainState] | None:
        """The newest complete local step if it is newer than `persistent` (the persistent tier's
        newest step) and every process restores it (from its own disk or a peer's); else None,
        with one warning line when a newer local step could not be restored."""
        step = self.latest_step()
        if step is None or (persistent is not None and step <= persistent):
            return None
        had = _gathered(int(os.path.isdir(os.path.join(self.directory, str(step)))))
        state, reason = None, ""
        try:
            item = self._item(target)
            restored = self.manager.restore(step, args=p2p_args.Composite(state=ocp.args.PyTreeRestore(item))).state
            iterator.set_state(read_position(restored["data"]))
            state = restored["train"]
        except Exception as e:  # a peer gone, a fetch cut short, unreadable files: the persistent tier remains
            reason = self._log.failure or f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        if not everywhere(state is not None):
            log(f"warning: local checkpoint step {step} cannot be restored on every process ({reason or 'on another process'}); "
                f"using the persistent tier")
            return None
        fetched = [i for i, h in enumerate(had) if not h]
        source = f"process(es) {fetched} fetched their shards from peers" if fetched else "every process from its own disk"
        older = "none" if persistent is None else f"step {persistent}"
        log(f"restoring from the local tier: step {step} ({source}); the persistent tier's newest is {older}")
        return step, state

    def drop_newer_than(self, step: int, log: Callable[[str], None]) -> None:
        """Removes this process's local steps after `step`, the one the run resumes from when the
        local tier could not serve it: the run computes those steps again, and a save of one must
        not find it taken. One warning line where some are removed."""
        newer = [s for s in local_steps(self.directory) if s > step]
        for s in newer:
            shutil.rmtree(os.path.join(self.directory, str(s)))
        if newer:
            log(f"warning: removed local checkpoint step(s) {', '.join(map(str, newer))} of {self.directory}: "
                f"the run resumes from step {step} and computes them again")
        self.manager.reload()

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            try:
                self.manager.close()
            finally:
                logging.getLogger("absl").removeFilter(self._log)


# Warnings the P2P manager logs on every save or start that say nothing is wrong.
ROUTINE = ("Global object size logging disabled", "Local scan: No steps found", "Local scan: Directory not found")


class _OrbaxLog(logging.Filter):
    """Drops the P2P manager's routine warnings, and its traceback of a failed local restore, whose
    first line it keeps as `failure` for the tier's own one-line warning."""

    def __init__(self) -> None:
        super().__init__()
        self.failure = ""

    def filter(self, record: logging.LogRecord) -> bool:
        message = str(record.msg)
        if message.startswith("Local/P2P restore for step"):
            cause = str(record.args[-1]) if isinstance(record.args, tuple) and record.args else ""
            self.failure = cause.splitlines()[0][:200] if cause else ""
            return False
        return not message.startswith(ROUTINE)


def _peers_hold_copies(mesh: Mesh) -> bool:
    """Whether every process's shards are also held by another process (a replica of `data` on
    other processes): only then does a lost host lose no local step."""
    axis = MESH_AXES.index(REPLICA_AXIS)
    owners: dict[int, set[int]] = {}  # process -> the processes of the other replicas, by position
    for r in range(multislice.replica_count(mesh, replica_axis_index=axis)):
        devices = multislice.replica_devices(mesh, replica_axis_index=axis, replica_id=r).flatten()
        for position, d in enumerate(devices):
            owners.setdefault(position, set()).add(d.process_index)
    return all(len(procs) > 1 for procs in owners.values())


def _drop_unusable(directory: str) -> None:
    """A save cut short leaves Orbax's temporary folder, never a step; a step whose state holds no
    process's data (Orbax's own test of whose it is) would stop the P2P manager's start on this
    process alone while the others wait for it. Both are removed, one line each (from the process
    whose disk held them)."""
    for path in sorted(glob.glob(os.path.join(directory, "*.orbax-checkpoint-tmp*"))):
        print(f"warning: skipped a half-written local checkpoint {path} (removed)", flush=True)
        shutil.rmtree(path, ignore_errors=True)
    for step in local_steps(directory):
        if p2p_utils.detect_process_index(pathlib.Path(directory), step) is None:
            path = os.path.join(directory, str(step))
            print(f"warning: skipped an unreadable local checkpoint {path} (no process's state in it; removed)",
                  flush=True)
            shutil.rmtree(path, ignore_errors=True)

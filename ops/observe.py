"""Watching a run: TensorBoard scalars, profiler traces, and the metrics read back.

- `TensorBoard`: every numeric value of every metrics.jsonl record also goes to an event file
  in `run.dir/tb/` (process 0). Events are written and flushed synchronously, one record at a
  time (records come every `train.log_every` steps), so a killed run keeps what it logged.
- `instrument`: wraps the compiled step to count the steps this invocation ran (for the
  goodput summary) and mark each one for a trace viewer; `profile.steps` traces go to
  `PROFILE_DIR` (the hook that takes them: trainer.hooks.ProfileHook).
- `read_metrics`, `read_scalars`: metrics.jsonl and event files back as Python values.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import shutil
import struct
import sys
import tempfile
import time
from typing import TYPE_CHECKING, Any, Callable, Iterator

import jax

import storage

if TYPE_CHECKING:
    from tensorboardX.event_file_writer import EventsWriter

TB_DIR = "tb"
PROFILE_DIR = "profile"


# What tensorboardX imports only for what this stack never asks of it: torch (to accept torch
# tensors; without it, numpy arrays) and the S3 and GCS clients of its own bucket support (run.dir's
# event files go to a bucket through `storage`). Most of the import's CPU time, in every run.
_UNUSED_BY_TENSORBOARD = ("torch", "boto3", "google.cloud.storage")


@contextlib.contextmanager
def _without_unused() -> Iterator[None]:
    """Imports inside it see the modules of _UNUSED_BY_TENSORBOARD as absent, those already loaded
    aside; afterwards they import as ever."""
    blocked = [name for name in _UNUSED_BY_TENSORBOARD if name not in sys.modules]
    for name in blocked:
        sys.modules[name] = None  # type: ignore[assignment]  # `import name` raises ImportError
    try:
        yield
    finally:
        for name in blocked:
            if sys.modules.get(name, 0) is None:
                del sys.modules[name]


class TensorBoard:
    """One event file per invocation under `run_dir/tb/`, created at the first record. With
    run.dir on an object store the file is written on this host's temporary directory (TensorBoard's
    writer appends) and copied to run.dir/tb/ every storage.REMOTE_FLUSH_S seconds and at `upload`."""

    def __init__(self, run_dir: str):
        # Imported here, not at the top: a machine without tensorboardX (the GPU box has no
        # network) can still import the trainer and time steps with bench.step. And here, not at
        # the first record: the import takes a while, which would be timed as the step it falls in.
        with _without_unused():
            from tensorboardX.event_file_writer import EventsWriter
            from tensorboardX.proto.event_pb2 import Event
            from tensorboardX.proto.summary_pb2 import Summary

        self._classes = EventsWriter, Event, Summary
        self.remote = storage.join(run_dir, TB_DIR) if storage.is_remote(run_dir) else None
        self.dir = tempfile.mkdtemp(prefix="meshlm-tb-") if self.remote else os.path.join(run_dir, TB_DIR)
        self._writer: EventsWriter | None = None
        self._uploaded = time.monotonic()

    def write(self, record: dict[str, Any]) -> None:
        """Every number in `record` but `step` becomes a scalar of that name at that step."""
        EventsWriter, Event, Summary = self._classes
        values = [
            Summary.Value(tag=k, simple_value=float(v))
            for k, v in record.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)
        ]
        if not values:
            return
        if self._writer is None:
            os.makedirs(self.dir, exist_ok=True)
            # The pid keeps two invocations within the same second from sharing a file name.
            self._writer = EventsWriter(os.path.join(self.dir, "events"), filename_suffix=f".{os.getpid()}")
        self._writer.write_event(Event(wall_time=time.time(), step=int(record["step"]), summary=Summary(value=values)))
        self._writer.flush()
        if self.remote and time.monotonic() - self._uploaded >= storage.REMOTE_FLUSH_S:
            self.upload()

    def upload(self) -> None:
        """Copies the event files to run.dir/tb/ on its object store (nothing to do locally)."""
        if self.remote:
            for name in os.listdir(self.dir):
                with open(os.path.join(self.dir, name), "rb") as f:
                    storage.write_bytes(storage.join(self.remote, name), f.read())
            self._uploaded = time.monotonic()

    def close(self) -> None:
        """The event file closed and, for a remote run.dir, uploaded whole; then this host's copy
        goes. An upload that fails raises and leaves the copy where it was written."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        self.upload()
        if self.remote:
            shutil.rmtree(self.dir, ignore_errors=True)


def _records(path: str) -> list[bytes]:
    """The payloads of a TFRecord file: [u64 length][u32 crc][payload][u32 crc] each; a record
    cut short by a killed writer ends the list."""
    with open(path, "rb") as f:
        data = f.read()
    out, pos = [], 0
    while pos + 12 <= len(data):
        (length,) = struct.unpack("<Q", data[pos : pos + 8])
        end = pos + 12 + length + 4
        if end > len(data):
            break
        out.append(data[pos + 12 : pos + 12 + length])
        pos = end
    return out


def read_scalars(tb_dir: str) -> dict[str, list[tuple[int, float]]]:
    """tag -> [(step, value), ...] from every event file in `tb_dir`, oldest file first."""
    with _without_unused():
        from tensorboardX.proto.event_pb2 import Event

    scalars: dict[str, list[tuple[int, float]]] = {}
    for path in sorted(glob.glob(os.path.join(tb_dir, "events.out.tfevents.*")), key=os.path.getmtime):
        for payload in _records(path):
            event = Event.FromString(payload)
            for value in event.summary.value:
                scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
    return scalars


def read_metrics(run_dir: str) -> list[dict[str, Any]]:
    """metrics.jsonl as one merged record per step, in step order. Records for the same step
    are merged with the later line winning each key: a resumed run's re-run steps replace the
    old values, and an eval record joins the train record of its step."""
    path = storage.join(run_dir, "metrics.jsonl")
    by_step: dict[int, dict[str, Any]] = {}
    if not storage.exists(path):
        return []
    for line in storage.read_text(path).splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # the last line of a killed run may be cut short
            continue
        if isinstance(record, dict) and "step" in record:
            by_step.setdefault(int(record["step"]), {}).update(record)
    return [by_step[s] for s in sorted(by_step)]


def last_value(records: list[dict[str, Any]], key: str) -> tuple[int, float] | None:
    """(step, value) of the last record that has a number for `key` (metrics.jsonl writes a
    non-finite value as null)."""
    for record in reversed(records):
        if record.get(key) is not None:
            return int(record["step"]), float(record[key])
    return None


def instrument(step_fn: Callable, start: int, goodput: Any) -> Callable:
    """`step_fn` that tells `goodput` the step it ran and marks it as a step for whatever trace
    is being taken (`profile.steps`, or a profiler attached from outside)."""
    step = start

    def run_step(state: Any, batch: Any) -> Any:
        nonlocal step
        step += 1
        goodput.last_step = step
        with jax.profiler.StepTraceAnnotation("train", step_num=step):
            return step_fn(state, batch)

    return run_step

"""Metrics out of the loop: `metrics.jsonl` (appended, never truncated; on an object store
rewritten whole every storage.REMOTE_FLUSH_S seconds and at the end, storage.AppendLog), the same scalars to the
trackers of `run.trackers` (TensorBoard events in `run.dir/tb/` by default), a console line, MFU.

Only process 0 writes. Throughput is measured between two logged steps (the loop fetches
metrics one step late, so the time covers finished device work, not dispatch).

metrics.jsonl is strict JSON: a value that is not a finite number (the loss and gradient norm of
a skipped step) is written as `null`, and such a step has `finite` 0 (1 otherwise). The records
returned to Python (`history`) keep the float NaN or inf.
"""

from __future__ import annotations

import json
import math
import sys
import time
from typing import Any, Callable

import jax

import storage
from configs import Config
from sharding.hardware import peak_flops_of_kind
from ops.trackers import Trackers

def peak_flops(device: Any) -> float | None:
    """Dense bf16 peak FLOP/s of `device` from the one hardware table (sharding.hardware)."""
    return peak_flops_of_kind(getattr(device, "device_kind", ""))


def log(message: str) -> None:
    """A line on stdout from process 0 only."""
    if jax.process_index() == 0:
        print(message, flush=True)


def _strict(value: Any) -> Any:
    """`value`, or None for a non-finite float (JSON has no NaN or Infinity)."""
    return None if isinstance(value, float) and not math.isfinite(value) else value


def _duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


class MetricsLogger:
    def __init__(self, cfg: Config, tokens_per_step: int, flops_per_token: float, devices: list,
                 console: Callable[[dict[str, Any]], list[str]] = lambda record: []):
        """`console`: the objective's parts of a step's console line (trainer/objectives/)."""
        self.path = storage.join(cfg.run.dir, "metrics.jsonl")
        self._file = storage.AppendLog(self.path, storage.REMOTE_FLUSH_S) if jax.process_index() == 0 else None
        total_steps = cfg.train.steps
        self.total_steps = total_steps
        self.tokens_per_step = tokens_per_step
        self.flops_per_token = flops_per_token
        self.peak = peak_flops(devices[0])
        self.num_devices = len(devices)
        self.is_main = jax.process_index() == 0
        self.history: list[dict[str, Any]] = []
        self._mark: tuple[int, float] | None = None
        self._waited = 0.0  # seconds the loop waited for data since the last record
        self.data_wait_total = 0.0  # ... and in all of this invocation (for the goodput summary)
        self.console = console
        self.trackers = Trackers(cfg, self.is_main)  # run.trackers: TensorBoard by default

    def waited(self, seconds: float) -> None:
        """Adds time the loop spent waiting for the next batch."""
        self._waited += seconds
        self.data_wait_total += seconds

    def start(self, step: int) -> None:
        """Sets the point throughput is measured from (after compile, at the first step)."""
        self._mark = (step, time.perf_counter())

    def write(self, step: int, values: dict[str, Any]) -> dict[str, Any]:
        """Records the metrics of `step` (the number of updates done); fetching them waits for
        that step to finish on the device."""
        values = jax.device_get(values)
        now = time.perf_counter()
        record: dict[str, Any] = {"step": step, **{k: float(v) for k, v in values.items()}}
        if self._mark is not None and step > self._mark[0]:
            step_s = (now - self._mark[1]) / (step - self._mark[0])
            tokens_per_s = self.tokens_per_step / step_s
            record.update(step_s=step_s, tokens_per_s=tokens_per_s, data_wait_s=self._waited / (step - self._mark[0]))
            if self.peak:
                record["mfu"] = tokens_per_s * self.flops_per_token / (self.num_devices * self.peak)
        self._mark, self._waited = (step, now), 0.0
        self._append(record)
        if self.is_main:
            self._print(record)
        return record

    def write_eval(self, step: int, loss: float, extra: dict[str, float], shown: str) -> dict[str, Any]:
        """Records a held-out loss and the objective's other held-out means (`extra`: the
        perplexity, DPO's rewards), shown on the console as `shown`."""
        record = {"step": step, "eval_loss": loss, **{f"eval_{k}": v for k, v in extra.items()}}
        self._append(record)
        log(f"eval at step {step}: loss {loss:.4f} | {shown}")
        return record

    def write_tasks(self, step: int, scores: dict[str, float]) -> dict[str, Any]:
        """Records the scores of eval.tasks ("task/NAME/METRIC")."""
        record = {"step": step, **scores}
        self._append(record)
        log(f"tasks at step {step}: " + " | ".join(f"{k.removeprefix('task/')} {v:.4f}" for k, v in scores.items()))
        return record

    def _append(self, record: dict[str, Any]) -> None:
        self.history.append(record)
        if self.is_main:
            strict = {k: _strict(v) for k, v in record.items()}
            self._file.append(json.dumps(strict, allow_nan=False))
            self.trackers.scalars(strict)  # the same values: a null is no scalar there either

    def flush(self) -> None:
        """Puts every line logged so far into metrics.jsonl (on an object store; locally each
        line is there already)."""
        if self._file is not None:
            self._file.flush()

    def _print(self, r: dict[str, Any]) -> None:
        width = len(str(self.total_steps))
        parts = [f"step {r['step']:>{width}}/{self.total_steps}", f"loss {r['loss']:.4f}"]
        parts.append(f"grad_norm {r['grad_norm']:.3f}")
        parts.append(f"lr {r['lr']:.2e}")
        parts += self.console(r)
        if "tokens_per_s" in r:
            eta = (self.total_steps - r["step"]) * r["step_s"]
            parts += [f"{r['tokens_per_s']:,.0f} tok/s", f"{r['step_s']:.3f} s/step", f"data wait {r['data_wait_s']:.3f} s"]
            if "mfu" in r:
                parts.append(f"MFU {100 * r['mfu']:.1f}%")
            parts.append(f"ETA {_duration(eta)}")
        print(" | ".join(parts), file=sys.stdout, flush=True)

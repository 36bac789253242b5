"""Where the time of a run went: goodput bookkeeping and `run.dir/summary.json`.

Goodput is productive step time over the wall time of an invocation (from `trainer.run`'s
start to its end; interpreter start-up and imports are not counted). The rest is split into:
init (distributed start-up, checks, building or restoring the state), compile, first
execution (the first step's time beyond a steady step: the compiler's one-time set-up of a
program's first run, worth several steps of a small model), checkpoint (the blocking part of
saves and the final wait; each tier's saves are also counted apart, with their blocking
seconds), eval, rollout (an objective's batches made on the host between steps: GRPO's sampling
and rewards), data wait (the loop waiting for a batch), profile (finishing a trace), and
recompute: steps this invocation ran again because an earlier one had reached them before it
stopped (the highest step in metrics.jsonl beyond the checkpoint resumed from), estimated at this
invocation's mean step time.

The loop marks boundaries with `lap` (the time since the previous lap, less the phases inside
it, goes to one bucket) and times nested parts with `phase`. `finish` writes summary.json,
which keeps every invocation of the run directory, and prints a few lines.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import sys
import time
from collections import defaultdict
from typing import Any, Callable, Iterator

import jax

import storage
from configs import Config
from ops.faults import Preempted
from ops.metrics import MetricsLogger, log
from ops.observe import last_value, read_metrics

SUMMARY = "summary.json"
BUCKETS = ("init", "compile", "first_execution", "checkpoint", "eval", "rollout", "data_wait", "profile", "recompute")
RESTART = ("init", "compile", "first_execution", "recompute")
TIERS = ("local", "persistent")


def invocation_outcome(error: BaseException | None) -> str:
    """How an invocation ended: done, preempted, or stopped (with the exception's type)."""
    if error is None:
        return "done"
    return "preempted" if isinstance(error, Preempted) else f"stopped: {type(error).__name__}"


class Goodput:
    """Timers for one invocation of `trainer.run`."""

    def __init__(self) -> None:
        self.t0 = self._mark = time.perf_counter()
        self.started = datetime.datetime.now().isoformat(timespec="seconds")
        self.seconds: dict[str, float] = defaultdict(float)
        self._inner = 0.0  # seconds of phases since the last lap
        self.start = 0
        self.last_step: int | None = None  # the last step run (set by observe.instrument)
        self.high_water = 0  # the highest step logged before this invocation
        self.first_step_s: float | None = None  # the invocation's first step, dispatch to completion (the loop)
        self.cleanup: list[Callable[[], None]] = []  # run by `finish` first (e.g. stop an open trace)
        self.tier = ""  # the checkpoint tier this invocation resumed from ("local", "persistent"; "": none)
        self.saves: dict[str, dict[str, float]] = {}  # tier -> {"count", "blocking_s"} of this invocation's saves

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.seconds[name] += now - self._mark - self._inner
        self._mark, self._inner = now, 0.0

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            elapsed = time.perf_counter() - t0
            self.seconds[name] += elapsed
            self._inner += elapsed

    @contextlib.contextmanager
    def save(self, tier: str) -> Iterator[None]:
        """The blocking part of one save to `tier`: in the checkpoint bucket, and counted per tier."""
        t0 = time.perf_counter()
        with self.phase("checkpoint"):
            yield
        row = self.saves.setdefault(tier, {"count": 0, "blocking_s": 0.0})
        row["count"] += 1
        row["blocking_s"] += time.perf_counter() - t0

    def begin(self, run_dir: str, start: int) -> None:
        """After the state is built (init ends here), before metrics of this invocation exist."""
        self.lap("init")
        self.start = start
        if jax.process_index() == 0:
            records = read_metrics(run_dir)
            self.high_water = int(records[-1]["step"]) if records else 0

    def finish(self, cfg: Config, logger: MetricsLogger) -> dict[str, Any] | None:
        """Closes the books of this invocation (also when an exception is on its way out),
        updates summary.json and prints the summary. Never raises: it must not hide the
        exception that ended the run. Returns the summary (process 0) or None."""
        for fn in self.cleanup:
            fn()
        self.lap("loop")
        if jax.process_index() != 0:
            return None
        try:
            invocation = self._invocation(cfg, logger, sys.exc_info()[1])
            summary = _update(cfg, invocation)
            lines = describe(summary)
        except Exception as e:  # a full disk or a hand-edited summary.json must not hide the run's own end
            log(f"warning: could not write {storage.join(cfg.run.dir, SUMMARY)}: {type(e).__name__}: {e}")
            return None
        for line in lines:
            log(line)
        return summary

    def _first_execution(self, steps_s: float, ran: int) -> float:
        """The first step's seconds beyond the mean of the others (0 with one step, or when the
        loop did not time it): a cost of the program's first run, not of training, which would
        otherwise make a short run's tokens/s understate its speed."""
        if self.first_step_s is None or ran < 2:
            return 0.0
        return max(0.0, self.first_step_s - (steps_s - self.first_step_s) / (ran - 1))

    def _invocation(self, cfg: Config, logger: MetricsLogger, error: BaseException | None) -> dict[str, Any]:
        wall = time.perf_counter() - self.t0
        end = self.start if self.last_step is None else self.last_step
        seconds = {k: self.seconds.get(k, 0.0) for k in BUCKETS}
        seconds["data_wait"] = logger.data_wait_total
        ran, again = end - self.start, max(0, min(self.high_water, end) - self.start)
        steps_s = max(self.seconds.get("loop", 0.0) - seconds["data_wait"], 0.0)
        seconds["first_execution"] = self._first_execution(steps_s, ran)
        steps_s -= seconds["first_execution"]  # productive + recompute, every step at its steady cost
        seconds["recompute"] = steps_s * again / ran if ran else 0.0
        seconds["productive"] = steps_s - seconds["recompute"]
        outcome = invocation_outcome(error)  # a run with nothing to do writes no summary (trainer.loop)
        tokens = ran * logger.tokens_per_step
        tokens_per_s = tokens / steps_s if steps_s > 0 else None
        return {
            "started": self.started,
            "outcome": outcome,
            "start_step": self.start,
            "end_step": end,
            "recomputed_steps": again,
            "restored_from": self.tier or None,
            # What resuming cost this invocation: start-up and restore, compile, the first run of the
            # program, and the steps run again since the restored step.
            "restart_s": sum(seconds[k] for k in RESTART) if self.tier else 0.0,
            "saves": {t: dict(self.saves[t]) for t in TIERS if t in self.saves},
            "devices": logger.num_devices,
            "wall_s": wall,
            "seconds": seconds,
            "goodput": seconds["productive"] / wall if wall > 0 else None,
            "tokens": tokens,
            "tokens_per_s": tokens_per_s,
            "mfu": _mfu(tokens_per_s, logger),
        }


def _mfu(tokens_per_s: float | None, logger: MetricsLogger) -> float | None:
    if tokens_per_s is None or not logger.peak:
        return None
    return tokens_per_s * logger.flops_per_token / (logger.num_devices * logger.peak)


def read_summary(run_dir: str) -> dict[str, Any] | None:
    """run.dir/summary.json, or None if missing or unreadable."""
    try:
        summary = json.loads(storage.read_text(storage.join(run_dir, SUMMARY)))
    except (OSError, ValueError):
        return None
    return summary if isinstance(summary, dict) else None


def _update(cfg: Config, invocation: dict[str, Any]) -> dict[str, Any]:
    """summary.json with this invocation appended and the totals over all of them."""
    previous = read_summary(cfg.run.dir) or {}
    invocations = [*previous.get("invocations", []), invocation]
    seconds: dict[str, float] = defaultdict(float)
    for inv in invocations:
        for k, v in inv["seconds"].items():
            seconds[k] += v
    wall = sum(inv["wall_s"] for inv in invocations)
    step_s = seconds["productive"] + seconds["recompute"]
    timed = [inv for inv in invocations if inv["mfu"] is not None]
    records = read_metrics(cfg.run.dir)
    loss, eval_loss = last_value(records, "loss"), last_value(records, "eval_loss")
    summary = {
        "run_dir": cfg.run.dir,
        "final_step": invocation["end_step"],
        "train_steps": cfg.train.steps,
        "final_loss": loss[1] if loss else None,
        "eval_loss": eval_loss[1] if eval_loss else None,
        "tokens_per_s": sum(inv["tokens"] for inv in invocations) / step_s if step_s > 0 else None,
        "mfu": (
            sum(inv["mfu"] * (inv["tokens"] / inv["tokens_per_s"]) for inv in timed)
            / sum(inv["tokens"] / inv["tokens_per_s"] for inv in timed)
            if timed else None
        ),
        "goodput": seconds["productive"] / wall if wall > 0 else None,
        "wall_s": wall,
        "seconds": dict(seconds),
        "recomputed_steps": sum(inv["recomputed_steps"] for inv in invocations),
        "restarts_by_tier": _restarts_by_tier(invocations),
        "invocations": invocations,
    }
    # A reader never sees half a file: a local one is renamed over, an object replaced in one request.
    storage.write_text(storage.join(cfg.run.dir, SUMMARY), json.dumps(summary, indent=1), atomic=True)
    return summary


def _restarts_by_tier(invocations: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per checkpoint tier resumed from: how many restarts, the seconds they cost and the steps
    they ran again (invocations written before tiers existed count as none)."""
    out: dict[str, dict[str, float]] = {}
    for inv in invocations:
        tier = inv.get("restored_from")
        if tier:
            row = out.setdefault(tier, {"restarts": 0, "restart_s": 0.0, "recomputed_steps": 0})
            row["restarts"] += 1
            row["restart_s"] += inv.get("restart_s", 0.0)
            row["recomputed_steps"] += inv["recomputed_steps"]
    return out


def _pct(x: float | None) -> str:
    return "?" if x is None else f"{100 * x:.1f}%"


def describe(summary: dict[str, Any]) -> list[str]:
    """The printed summary: results, then where this invocation's time went, then the totals."""
    inv = summary["invocations"][-1]
    head = [f"summary: step {summary['final_step']}/{summary['train_steps']} ({inv['outcome']})"]
    if summary["final_loss"] is not None:
        head.append(f"loss {summary['final_loss']:.4f}")
    if summary["eval_loss"] is not None:
        head.append(f"eval loss {summary['eval_loss']:.4f}")
    if inv["tokens_per_s"] is not None:
        head.append(f"{inv['tokens_per_s']:,.0f} tok/s")
    if inv["mfu"] is not None:
        head.append(f"MFU {_pct(inv['mfu'])}")
    s = inv["seconds"]
    rest = ", ".join(f"{k.replace('_', ' ')} {s[k]:.1f} s" for k in BUCKETS if s.get(k, 0.0) >= 0.05)
    lines = [
        " | ".join(head),
        f"goodput {_pct(inv['goodput'])} of {inv['wall_s']:.1f} s wall: steps {s['productive']:.1f} s"
        + (f"; {rest}" if rest else "")
        + (f" ({inv['recomputed_steps']} steps recomputed)" if inv["recomputed_steps"] else ""),
    ]
    n = len(summary["invocations"])
    if n > 1:
        lines.append(
            f"over {n} invocations of this run.dir: goodput {_pct(summary['goodput'])} of "
            f"{summary['wall_s']:.1f} s wall, {summary['recomputed_steps']} steps recomputed"
        )
    saves = inv.get("saves") or {}
    if "local" in saves:  # what the local tier's frequent saves cost the loop, beside the rare persistent ones
        lines.append("saves: " + "; ".join(
            f"{t} {r['count']}x, {1000 * r['blocking_s'] / r['count']:.0f} ms blocking each"
            for t in TIERS if (r := saves.get(t))))
    tiers = summary.get("restarts_by_tier") or {}
    if tiers:
        lines.append("restarts: " + "; ".join(
            f"from the {t} tier {r['restarts']}x, {r['restart_s']:.1f} s lost ({r['recomputed_steps']} steps recomputed)"
            for t in TIERS if (r := tiers.get(t))))
    return lines

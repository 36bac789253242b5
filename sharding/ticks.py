"""The tick table of the hand-written pipeline schedules: which pass each stage runs on each tick,
the phases the schedule's scans run, and the bubble measured from that table under a cost model.

sharding/schedules.py runs these ticks in lockstep (every stage runs every slot of a tick, a
stage with nothing to do computing on masked inputs), so a tick costs the sum of its slots'
costs on every stage whether or not the stage has work in them: the bubble is the masked share.

Slots: F (a stage forward), B (a stage backward) and W (the weight-gradient half of a split
backward, zero_bubble only; there B is the input-gradient half). The item functions work alike
on Python ints (this table) and on jax arrays (the schedule's scans), so both read the same
arithmetic.

Cost model (one stage forward F = 1; matmul FLOPs: a backward matmul pass costs what its forward
does, once for the input gradient, once for the weight gradient; attention and the head left
out). As built, every backward recomputes the stage forward from the stashed stage input:
- 1f1b, interleaved_1f1b: the fused backward (one vjp) = recompute 1 + input gradient 1 + weight
  gradient 1 = 3.
- zero_bubble: B (vjp w.r.t. the stage input, parameters closed over: no weight-gradient matmuls)
  = recompute 1 + input gradient 1 = 2; W (vjp w.r.t. the parameters, the input closed over) =
  recompute 1 + the input-gradient chain through the stage's later layers 1 + weight gradient 1
  = 3 (see sharding/schedules.py for why W recomputes).
- gpipe: autodiff of the forward scan, no recompute (remat aside): backward 2.
"""

from __future__ import annotations

from typing import Any

COSTS = {  # schedule -> slot -> cost in stage forwards
    "gpipe": {"F": 1, "B": 2},
    "1f1b": {"F": 1, "B": 3},
    "interleaved_1f1b": {"F": 1, "B": 3},
    "zero_bubble": {"F": 1, "B": 2, "W": 3},
}


def forward_item(u: Any, S: int, R: int) -> tuple[Any, Any]:
    """(microbatch, repeat) of the u-th forward pass through a stage: groups of S microbatches
    run through repeat 0, then 1, ..., so that the last stage's output for repeat r reaches
    stage 0 for repeat r + 1 on the next tick."""
    within = u % (S * R)
    return (u // (S * R)) * S + within % S, within // S


def backward_item(w: Any, S: int, R: int) -> tuple[Any, Any]:
    """The same order mirrored: the w-th backward pass runs the repeats last to first."""
    m, r = forward_item(w, S, R)
    return m, R - 1 - r


def first_backward(S: int, R: int) -> int:
    """T0: the tick of the first backward (the last stage's first microbatch of the last repeat)."""
    return R * S - 1


def passes(kind: str, t: Any, s: Any, S: int, R: int, M: int) -> tuple[Any, Any]:
    """(pass index, running) of stage s on tick t in slot `kind` of a 1F1B-family schedule:
    u = t - s for F; for B (the last stage first, one stage down per tick) t - T0 - (S - 1 - s);
    for W (zero_bubble, R = 1) the microbatch t - (2S - 2) on every stage at once, s ticks after
    stage s's B (the last, stage 0, in its B's tick)."""
    if kind == "F":
        u = t - s
    elif kind == "B":
        u = t - first_backward(S, R) - (S - 1 - s)
    else:
        u = t - (2 * S - 2) + 0 * s
    return u, (u >= 0) & (u < R * M)


def phases(schedule: str, S: int, R: int, M: int) -> list[tuple[int, int, str]]:
    """(first tick, end tick, slots) of each scan the schedule runs, in order."""
    U, T0 = R * M, first_backward(S, R)
    if schedule == "gpipe":  # autodiff of one forward scan: all forwards, then all backwards
        return [(0, U + S - 1, "F"), (U + S - 1, 2 * (U + S - 1), "B")]
    if schedule == "zero_bubble":
        # The B wavefront runs from the last stage down to stage 0 without weight gradients;
        # from tick 2S - 2 (stage 0's first B) on, every tick has a W slot for the deferred ones.
        return [(0, T0, "F"), (T0, 2 * S - 2, "FB"), (2 * S - 2, U + S - 1, "FBW"), (U + S - 1, U + T0 + S - 1, "BW")]
    return [(0, T0, "F"), (T0, U + S - 1, "FB"), (U + S - 1, U + T0 + S - 1, "B")]


def tick_table(schedule: str, S: int, R: int, M: int) -> list[dict[str, list[int | None]]]:
    """One row per tick: slot -> the pass each stage runs in it (None: masked, idle)."""
    rows = []
    for first, end, slots in phases(schedule, S, R, M):
        for t in range(first, end):
            row = {}
            for kind in slots:
                if schedule == "gpipe":  # stage s runs virtual microbatch t - s, backwards mirrored
                    tt = t if kind == "F" else 2 * (R * M + S - 1) - 1 - t
                    row[kind] = [tt - s if 0 <= tt - s < R * M else None for s in range(S)]
                else:
                    row[kind] = [u if on else None for u, on in (passes(kind, t, s, S, R, M) for s in range(S))]
            rows.append(row)
    return rows


def measured_bubble(schedule: str, S: int, R: int, M: int) -> float:
    """Idle share of the lockstep schedule from its tick table: masked slot cost over all slot cost,
    summed over stages and ticks, slots costed by COSTS (the interleaved schedule's slots are 1/R
    of a stage each, which cancels)."""
    cost = COSTS[schedule]
    total = idle = 0
    for row in tick_table(schedule, S, R, M):
        for kind, items in row.items():
            total += cost[kind] * len(items)
            idle += cost[kind] * sum(i is None for i in items)
    return idle / total

"""Ticks: which pass each stage runs on each tick of a lockstep schedule, and the bubble measured
from that table under a cost model.

Every schedule here runs its ticks in lockstep: every stage runs every slot of a tick, a stage
with nothing to do computing on masked inputs, so a tick costs the sum of its slots' costs on
every stage whether or not the stage has work in them. The bubble is the masked share, and
`masked_share` is the one place it is computed (each schedule's `bubble`).

Slots: F (a stage forward), B (a stage backward) and W (the weight-gradient half of a split
backward, zero_bubble only; there B is the input-gradient half). The item functions work alike
on Python ints (the tick tables) and on jax arrays (the 1F1B step's scans), so both read the
same arithmetic.

Cost model (one stage forward F = 1; matmul FLOPs: a backward matmul pass costs what its forward
does, once for the input gradient, once for the weight gradient; attention and the head left
out), each schedule's `costs`. As built, every 1F1B-family backward recomputes the stage forward
from the stashed stage input:
- 1F1B and interleaved 1F1B: the fused backward (one vjp) = recompute 1 + input gradient 1 +
  weight gradient 1 = 3.
- zero-bubble: B (vjp w.r.t. the stage input, parameters closed over: no weight-gradient
  matmuls) = recompute 1 + input gradient 1 = 2; W (vjp w.r.t. the parameters, the input closed
  over) = recompute 1 + the input-gradient chain through the stage's later layers 1 + weight
  gradient 1 = 3 (pipeline/zero_bubble.py says why W recomputes).
- GPipe: autodiff of the forward scan, no recompute (remat aside): backward 2.
"""

from __future__ import annotations

from typing import Any

Phase = tuple[int, int, str]  # (first tick, end tick, the slots every tick of it runs)
Row = dict[str, list[int | None]]  # slot -> the pass each stage runs in it (None: masked, idle)


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


def forward_of_backward(w: Any, m: Any, r: Any, S: int, R: int) -> Any:
    """The index of the forward pass whose stage input the w-th backward pass, item (m, r) of
    `backward_item`, differentiates: its group of SR passes, then repeat and microbatch in it."""
    return (w // (S * R)) * (S * R) + r * S + m % S


def first_backward(S: int, R: int) -> int:
    """T0: the tick of the first backward (the last stage's first microbatch of the last repeat)."""
    return R * S - 1


def passes(kind: str, t: Any, s: Any, S: int, R: int, M: int) -> tuple[Any, Any]:
    """(pass index, running) of stage s on tick t in slot `kind` of a 1F1B-family schedule:
    u = t - s for F; for B (the last stage first, one stage down per tick) t - T0 - (S - 1 - s);
    for W (zero-bubble, R = 1) the microbatch t - (2S - 2) on every stage at once, s ticks after
    stage s's B (the last, stage 0, in its B's tick)."""
    if kind == "F":
        u = t - s
    elif kind == "B":
        u = t - first_backward(S, R) - (S - 1 - s)
    else:
        u = t - (2 * S - 2) + 0 * s
    return u, (u >= 0) & (u < R * M)


def masked_share(table: list[Row], costs: dict[str, int]) -> float:
    """Idle share of a lockstep schedule from its tick table: masked slot cost over all slot
    cost, summed over stages and ticks, slots costed by `costs` (the interleaved schedule's slots
    are 1/R of a stage each, which cancels). Integer sums divided once: a fraction equal to a
    closed form gives the same float."""
    total = idle = 0
    for row in table:
        for kind, items in row.items():
            total += costs[kind] * len(items)
            idle += costs[kind] * sum(i is None for i in items)
    return idle / total

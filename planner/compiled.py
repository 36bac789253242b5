"""What a compiled step says of itself, read the same way by the planner and the benchmarks:
its per-device bytes and FLOPs, and the collectives its HLO holds."""

from __future__ import annotations

import jax

from planner.hlo import static_counts


def compiled_stats(compiled: jax.stages.Compiled) -> dict[str, float]:
    """Per-device bytes from `memory_analysis()` and FLOPs from `cost_analysis()`, which counts
    the body of a loop (the layer scan, pipeline ticks) once, not once per trip.

    `total_bytes`, the one memory figure of a compile everywhere (planner, benchmarks): arguments,
    temporaries and outputs, less the outputs that reuse a donated argument's buffer."""
    mem = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = (cost[0] if isinstance(cost, list) else cost) or {}  # a deviceless GPU compile has none
    return {
        "argument_bytes": mem.argument_size_in_bytes,
        "output_bytes": mem.output_size_in_bytes,
        "alias_bytes": mem.alias_size_in_bytes,
        "temp_bytes": mem.temp_size_in_bytes,
        "total_bytes": (mem.argument_size_in_bytes + mem.temp_size_in_bytes + mem.output_size_in_bytes
                        - mem.alias_size_in_bytes),
        "xla_flops": cost.get("flops", float("nan")),
    }


def collective_counts(hlo_text: str) -> dict[str, int]:
    """How many collective ops of each kind the compiled HLO holds (async start/done pairs once)."""
    return static_counts(hlo_text)

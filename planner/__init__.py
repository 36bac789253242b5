"""The AOT planner's reading of a compile (plan.py): the collectives in compiled HLO, a roofline
over its kernels, the hardware table and step-time model, the compilers and target descriptions
for devices this host does not have, the least traffic a layout needs, and the plan's report.

Kept apart from `sharding`, which holds only what a training run needs (the hardware table is
there, sharding/hardware.py); the trainer never imports the planner. Below, the names plan.py
uses: the planner's API (planner/targets.py apart: `python -m planner.targets` runs it as a script).
"""

from planner.compiled import compiled_stats
from planner.hlo import collectives
# Under another name: `minimum` is also the module's.
from planner.minimum import minimum as minimum_traffic
from planner.progress import Heartbeat, wait_with_progress
from planner.report import evaluate, print_plan, print_search
from planner.roofline import compute_seconds, kernels
from planner.search import candidates

__all__ = ["Heartbeat", "candidates", "collectives", "compiled_stats", "compute_seconds", "evaluate", "kernels",
           "minimum_traffic", "print_plan", "print_search", "wait_with_progress"]

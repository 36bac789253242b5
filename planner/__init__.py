"""The AOT planner's reading of a compile (plan.py): the collectives in compiled HLO, a roofline
over its kernels, the hardware table and step-time model, the compilers and target descriptions
for devices this host does not have, the least traffic a layout needs, and the plan's report.

Kept apart from `sharding`, which holds only what a training run needs (the hardware table is
there, sharding/hardware.py); the trainer never imports the planner. Below, the names plan.py
uses: the planner's API.
"""

from planner.candidates import candidates
from planner.compiled import compiled_stats
from planner.hlo import collectives
from planner.minimum import minimum
from planner.progress import Heartbeat, wait_with_progress
from planner.rank import storage_gather_bytes
from planner.report import evaluate, print_plan, print_search
from planner.roofline import compute_seconds, kernels
from planner.targets import child_env, compiler_name, has_compiler, node_of, target_devices, tpu_slice_shape

__all__ = ["Heartbeat", "candidates", "child_env", "collectives", "compiled_stats", "compiler_name", "compute_seconds",
           "evaluate", "has_compiler", "kernels", "minimum", "node_of", "print_plan", "print_search",
           "storage_gather_bytes", "target_devices", "tpu_slice_shape", "wait_with_progress"]

"""The AOT planner's reading of a compile (plan.py): the collectives in compiled HLO, a roofline
over its kernels, the hardware table and step-time model, the compilers and target descriptions
for devices this host does not have, the least traffic a layout needs, and the plan's report.

Kept apart from `sharding`, which holds only what a training run needs; the trainer reads the
hardware table and the collective counts from here.
"""

"""Pipeline parallelism over the `pipeline` mesh axis: the schedules, each in its module, behind
one registry (pipeline/registry.py) that the trainer, the planner and the benchmarks look
schedules up in by name.

- gpipe.py: GPipe and its circular form (repeats > 1), a layer runner whose autodiff is the
  schedule.
- one_f_one_b.py: 1F1B, one forward and one backward per tick, gradients by hand; the step
  engine the two below share.
- interleaved.py: interleaved 1F1B (repeats > 1).
- zero_bubble.py: zero-bubble (ZB-H1), the backward split into input and weight gradients.
- ticks.py: the tick arithmetic and the bubble of a tick table; stages.py: the stage and
  microbatch views of the stack and the batch; grads.py: the model's pieces for the 1F1B step.

    schedule = pipeline.get(cfg.pipeline.schedule)
    schedule.check(cfg, stages, repeats, microbatches)  # ConfigError where it cannot run
    schedule.bubble(stages, repeats, microbatches), schedule.formula(...), schedule.in_flight(...)
    schedule.layer_runner(...)  # the model's forward; and where schedule.computes_grads:
    schedule.grad_fn(graphdef, GradSpec(...))  # loss and gradients, in place of autodiff
"""

from pipeline import gpipe, interleaved, one_f_one_b, zero_bubble  # noqa: F401 (each registers its schedule)
from pipeline.registry import Schedule, bubble_formula, bubble_fraction, get, names
from pipeline.stages import GradSpec

__all__ = ["GradSpec", "Schedule", "bubble_formula", "bubble_fraction", "get", "names"]

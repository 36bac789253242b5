"""The pipeline schedules by name: what each one is, and the one way to look it up.

A schedule owns everything that differs between schedules: its tick table (which pass each stage
runs on each tick), its bubble (the masked share of that table under its slot costs), the
activations a stage holds at most, the config checks it needs, and what the trainer runs. GPipe
gives a layer runner the model's forward takes, and the step differentiates the loss through it;
the 1F1B family (`computes_grads`) also gives a gradient function that computes the loss and
every gradient itself. Every schedule gives the layer runner: the 1F1B family's forward-only
passes (evaluation) run GPipe's.

The names are the config's (configs.schema.PIPELINE_SCHEDULES, which the configs cannot import
from here); tests/test_plan.py checks the two agree.
"""

from __future__ import annotations

from typing import Any, ClassVar

from flax import nnx

from configs import Config
from configs.registry import Registry, api
from model import LayerRunner
from model.loss import GradFn
from pipeline.stages import GradSpec
from pipeline.ticks import Phase, Row, masked_share
from sharding.rules import Rules

__all__ = ["Phase", "Row", "Schedule", "bubble_formula", "bubble_fraction", "get", "names", "register"]


class Schedule:
    """One pipeline schedule over S stages, R repeats (layer groups per stage) and M microbatches."""

    name: ClassVar[str]
    computes_grads: ClassVar[bool] = False  # gives `grad_fn`; else the step differentiates the runner
    costs: ClassVar[dict[str, int]]  # slot -> its cost in stage forwards (pipeline/ticks.py)

    def takes_repeats(self, repeats: int) -> bool:
        """Whether the schedule runs stages holding `repeats` layer groups each."""
        return True

    def check(self, cfg: Config, stages: int, repeats: int, microbatches: int) -> None:
        """Raises ConfigError, naming the key, where the schedule cannot run this config on a
        pipelined layout (the checks every schedule needs are the layout's)."""

    def phases(self, S: int, R: int, M: int) -> list[Phase]:
        """The ticks of each scan the schedule runs, in order."""
        raise NotImplementedError

    def item(self, kind: str, t: int, s: int, S: int, R: int, M: int) -> int | None:
        """The pass stage s runs on tick t in slot `kind` (None: masked, idle)."""
        raise NotImplementedError

    def tick_table(self, S: int, R: int, M: int) -> list[Row]:
        """One row per tick: slot -> the pass each stage runs in it."""
        return [{kind: [self.item(kind, t, s, S, R, M) for s in range(S)] for kind in slots}
                for first, end, slots in self.phases(S, R, M) for t in range(first, end)]

    def bubble(self, S: int, R: int, M: int) -> float:
        """Idle share of the schedule: the masked share of its tick table."""
        return masked_share(self.tick_table(S, R, M), self.costs)

    def formula(self, S: int, R: int, M: int) -> str:
        """The bubble as a closed form with its numbers, for the planner's printout."""
        raise NotImplementedError

    def in_flight(self, S: int, R: int, M: int) -> int:
        """The most [microbatch, length, embed] activations a stage holds for its backward."""
        raise NotImplementedError

    def layer_runner(self, S: int, R: int, M: int, stage_fn: Any, stage_rules: Rules) -> LayerRunner:
        """The runner the model's forward takes on a pipelined layout (model.LayerRunner)."""
        raise NotImplementedError

    def grad_fn(self, graphdef: nnx.GraphDef, spec: GradSpec) -> GradFn | None:
        """The loss and gradients computed by the schedule on the pipeline shape and settings of
        `spec` (None: autodiff through the runner)."""
        return None


_SCHEDULES: Registry[Schedule] = Registry("pipeline.schedule")
register, get, names = api(_SCHEDULES)  # a Schedule subclass decorated with `register`: its `name` selects it


def bubble_fraction(stages: int, repeats: int, microbatches: int, schedule: str = "gpipe") -> float:
    """`get(schedule).bubble`, for callers that hold a schedule's name."""
    return get(schedule).bubble(stages, repeats, microbatches)


def bubble_formula(schedule: str, stages: int, repeats: int, microbatches: int) -> str:
    """`get(schedule).formula`, for callers that hold a schedule's name."""
    return get(schedule).formula(stages, repeats, microbatches)

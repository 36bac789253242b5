"""Interleaved 1F1B (`pipeline.repeats` R > 1): 1F1B over R layer groups per stage, run by the
1F1B step (pipeline/one_f_one_b.py) with R repeats.

Stage s holds layer groups s, S + s, ..., (R - 1)S + s, as in the circular GPipe runner, and a
tick runs one group (1/R of the stage's layers). Forward passes go in groups of S microbatches
through repeat 0, then repeat 1, ...: the u-th pass of stage 0 is microbatch (u div SR) S +
u mod S in repeat (u mod SR) div S, at stage s on tick u + s, so the last stage's output for
repeat r is stage 0's input for repeat r + 1 on the next tick (the roll carries it round).
Backward passes run the same order with the repeats reversed, the first on tick T0 = RS - 1 (the
last stage, as the last repeat of microbatch 0 leaves the head). A stage input waits at most
2RS - 2 ticks for its backward: 2RS - 1 stash slots, indexed by the tick of the forward. Warm-up
and cool-down take RS - 1 ticks of 1/R of a stage each: the bubble is (S - 1) / (RM + S - 1).
With R = 1 this is the plain 1F1B.
"""

from __future__ import annotations

from configs import ConfigError
from pipeline.one_f_one_b import OneFOneB
from pipeline.registry import register


@register
class InterleavedOneFOneB(OneFOneB):
    """1F1B over R > 1 layer groups per stage, microbatches in groups of S."""

    name = "interleaved_1f1b"

    def takes_repeats(self, repeats: int) -> bool:
        return repeats > 1

    def check_groups(self, stages: int, repeats: int, microbatches: int) -> None:
        if repeats == 1:
            raise ConfigError(f"pipeline.schedule={self.name} needs pipeline.repeats > 1 (with one repeat: "
                              "pipeline.schedule=1f1b)")
        if microbatches % stages:
            raise ConfigError(f"pipeline.schedule={self.name} runs microbatches in groups of mesh.pipeline={stages}: "
                              f"pipeline.microbatches={microbatches} is not a multiple of it")

    def formula(self, S: int, R: int, M: int) -> str:
        return f"(S - 1) / (R x M + S - 1) = {S - 1} / ({R} x {M} + {S - 1})"

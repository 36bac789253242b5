"""What a config means on a device count: the mesh sizes, the sharding rules, the pipeline shape.

`plan_layout` turns the config's mesh and rules (data) into the sizes and rule tables a run
uses; every check it relies on is in trainer/checks.py, run here before anything is built.
"""

from __future__ import annotations

import dataclasses

import pipeline
from configs import Config
from sharding import Rules, resolve_mesh_shape, stored_rules, to_rules, with_axis
from trainer import checks


@dataclasses.dataclass(frozen=True)
class Layout:
    """A config on a device count: mesh sizes, rule tables and the pipeline's shape."""

    sizes: dict[str, int]
    param_rules: Rules
    act_rules: Rules  # activations outside the layer stack, and the input batch
    stage_rules: Rules  # activations inside a pipeline stage (= act_rules without pipelining)
    stages: int
    repeats: int
    microbatches: int
    schedule: str  # pipeline.schedule, a name in the pipeline package's registry

    @property
    def pipelined(self) -> bool:
        return self.stages > 1

    @property
    def bubble(self) -> float:
        return pipeline.get(self.schedule).bubble(self.stages, self.repeats, self.microbatches)


def _with_batch_axis(rules: Rules, axis: str) -> Rules:
    """`rules` with `axis` appended to the mesh axes of `batch`."""
    return with_axis(rules, "batch", axis)


def plan_layout(cfg: Config, num_devices: int, processes: int = 1) -> Layout:
    """The layout of `cfg` on `num_devices` devices in `processes` processes; raises ConfigError,
    naming the key, where they do not fit."""
    sizes = resolve_mesh_shape(cfg.mesh, num_devices)
    param_rules, act_rules = stored_rules(cfg.sharding.params, sizes), to_rules(cfg.sharding.activations)
    per_replica = checks.check_batch(cfg, sizes, act_rules, processes)
    checks.check_context(cfg, sizes, act_rules)
    checks.check_experts(cfg, sizes, act_rules)
    checks.check_gather(cfg, param_rules, act_rules, sizes)
    stages, repeats = sizes["pipeline"], cfg.pipeline.repeats
    micro = cfg.pipeline.microbatches or stages
    checks.check_pipeline(cfg, stages, micro, per_replica)
    stage_rules = act_rules
    if stages > 1 and per_replica % stages == 0:
        # Outside the stack (embedding, head, loss) the stages split the batch instead of
        # repeating the same work, where the rows divide evenly.
        act_rules = _with_batch_axis(act_rules, "pipeline")
    checks.check_megablox(cfg, sizes, stage_rules)
    return Layout(sizes, param_rules, act_rules, stage_rules, stages, repeats, micro, cfg.pipeline.schedule)

"""What a config means on a device count: the mesh sizes, the sharding rules, the pipeline shape.

`plan_layout` turns the config's mesh and rules (data) into the sizes and rule tables a run
uses; every check it relies on is in trainer/checks.py, run here before anything is built.
"""

from __future__ import annotations

import dataclasses

import pipeline
from configs import Config
from sharding import Rules, resolve_mesh_shape, to_rules
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
    return _with_axis(rules, "batch", axis)


def _with_axis(rules: Rules, name: str, axis: str) -> Rules:
    """`rules` with `axis` appended to the mesh axes of the logical `name`."""
    out = []
    for logical, entry in rules:
        if logical == name:
            entry = (entry if isinstance(entry, tuple) else (() if entry is None else (entry,))) + (axis,)
        out.append((logical, entry))
    return tuple(out)


def plan_layout(cfg: Config, num_devices: int, processes: int = 1) -> Layout:
    """The layout of `cfg` on `num_devices` devices in `processes` processes; raises ConfigError,
    naming the key, where they do not fit."""
    sizes = resolve_mesh_shape(cfg.mesh, num_devices)
    param_rules, act_rules = to_rules(cfg.sharding.params), to_rules(cfg.sharding.activations)
    per_replica = checks.check_batch(cfg, sizes, act_rules, processes)
    checks.check_context(cfg, sizes, act_rules)
    checks.check_experts(cfg, sizes, act_rules)
    if sizes["context"] > 1:
        # A context group's devices hold different positions of the same rows: the parameters
        # they would each hold whole are sharded over them as well, FSDP-style.
        param_rules = _with_axis(param_rules, "embed", "context")
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

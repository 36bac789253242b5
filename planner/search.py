"""The layouts a plan tries: the command line's own, or with --search one per mesh shape,
parameter storage, pipeline schedule and remat policy (plan.py)."""

from __future__ import annotations

import math

import pipeline
from configs import ConfigError
from configs.schema import MESH_AXES
from planner.rank import EXPERT_STORAGE


def _pinned(overrides: list[str]) -> dict[str, str]:
    return dict(o.split("=", 1) for o in overrides if "=" in o)


def _factorizations(n: int, axes: list[str]) -> list[dict[str, int]]:
    if len(axes) == 1:
        return [{axes[0]: n}]
    return [{axes[0]: d, **rest} for d in range(1, n + 1) if n % d == 0 for rest in _factorizations(n // d, axes[1:])]


def candidates(overrides: list[str], n: int, search: bool, remats: list[str], experts: int = 1) -> list[list[str]]:
    """Override lists to plan: the command line as given, or (search) one per mesh, storage and
    policy. A mixture of `experts` > 1 also searches `mesh.expert` over the sizes that divide it."""
    if not search:
        return [overrides]
    pinned = _pinned(overrides)
    fixed = {a: int(pinned[f"mesh.{a}"]) for a in MESH_AXES if pinned.get(f"mesh.{a}", "-1") != "-1"}
    fixed.setdefault("context", 1)  # the sequence split is the long-context choice: searched only as given
    if experts <= 1:
        fixed.setdefault("expert", 1)
    free = [a for a in MESH_AXES if a not in fixed]
    rest = math.prod(fixed.values())
    if rest <= 0 or n % rest or not free and rest != n:
        raise ConfigError(f"--devices={n}: the pinned mesh axes {fixed} do not divide it")
    meshes = _factorizations(n // rest, free) if free else [{}]
    meshes = [m for m in meshes if experts % m.get("expert", 1) == 0]
    policies = [pinned["model.remat"]] if "model.remat" in pinned else remats
    searched = {f"mesh.{a}" for a in MESH_AXES} | {"model.remat", "pipeline.schedule"}
    base = [o for o in overrides if o.split("=", 1)[0] not in searched]  # mesh.nodes and mesh.across stay

    repeats = int(pinned.get("pipeline.repeats", "1") or 1)

    def schedules(mesh: dict[str, int]) -> list[list[str]]:
        """A pipelined mesh runs under each schedule that takes the repeats given (or the one
        schedule given); others under none."""
        if mesh["pipeline"] == 1:
            return [[]]
        runs = [s for s in pipeline.names() if pipeline.get(s).takes_repeats(repeats)]
        return [[f"pipeline.schedule={s}"] for s in ([pinned["pipeline.schedule"]] if "pipeline.schedule" in pinned
                                                     else runs)]

    def storages(mesh: dict[str, int]) -> list[list[str]]:
        """The default storage, and on an expert-parallel mesh without tensor parallelism the one
        that splits the weights outside the experts over fsdp x expert too (unless the rules of
        stored parameters are given): it trades gathers over `expert` for their state's memory."""
        if mesh["expert"] == 1 or mesh["tensor"] > 1 or any(o.startswith("sharding.params") for o in base):
            return [[]]
        return [[], list(EXPERT_STORAGE)]

    meshes = [{**fixed, **m} for m in meshes]
    return [
        base + [f"mesh.{a}={m[a]}" for a in MESH_AXES] + st + s + [f"model.remat={r}"]
        for m in meshes for st in storages(m) for s in schedules(m) for r in policies
    ]

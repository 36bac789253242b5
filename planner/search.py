"""The layouts a plan tries: the command line's own, or with --search one per mesh shape,
pipeline schedule and remat policy (plan.py)."""

from __future__ import annotations

import math

import pipeline
from configs import ConfigError
from configs.schema import MESH_AXES


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

    meshes = [{**fixed, **m} for m in meshes]
    return [
        base + [f"mesh.{a}={m[a]}" for a in MESH_AXES] + s + [f"model.remat={r}"]
        for m in meshes for s in schedules(m) for r in policies
    ]

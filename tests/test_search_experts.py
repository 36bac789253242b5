"""`plan.py --search` on a mixture of experts (planner/rank.py): it tries expert-parallel layouts
(sizes that divide the expert count), ranks them analytically (the weights outside the experts
stored over fsdp x expert, their gathers counted), compiles only the `--top` best, and proposes
one that fits (real H100 compile: tests marked real_target)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import jax
import pytest

from conftest import ROOT, real_target_env
from configs import load_config
from plan import check, state_bytes
from planner import candidates
from sharding.hardware import HARDWARE
from planner.rank import expert_bytes
from planner.targets import has_compiler
from sharding import resolve_mesh_shape
from sharding.rules import logical_to_spec, to_rules
from trainer import prepare
from trainer.layout import plan_layout

TINY_DEEPSEEK = os.path.join(ROOT, "configs", "tiny-deepseek.yaml")


def _sizes(tried: list[list[str]], axis: str) -> set[int]:
    return {int(o.split("=")[1]) for c in tried for o in c if o.startswith(f"mesh.{axis}=")}


def test_search_tries_the_expert_sizes_that_divide_the_experts():
    assert _sizes(candidates(["mesh.pipeline=1"], 8, True, ["full"], experts=8), "expert") == {1, 2, 4, 8}
    assert _sizes(candidates(["mesh.pipeline=1"], 8, True, ["full"], experts=6), "expert") == {1, 2}
    assert _sizes(candidates(["mesh.pipeline=1"], 8, True, ["full"]), "expert") == {1}  # a dense model
    assert _sizes(candidates(["mesh.expert=4"], 8, True, ["full"], experts=8), "expert") == {4}  # pinned


def test_an_expert_mesh_stores_the_weights_outside_the_experts_split_over_it():
    """On expert=4 x fsdp=2 the weights outside the experts are stored over fsdp x expert (an
    expert group holds the same ones), the experts keep their axis and their `embed` rule; rules
    that already name `expert` for `embed` are taken as given, and without expert parallelism
    nothing changes."""
    rules = plan_layout(load_config(TINY_DEEPSEEK, ["mesh.expert=4", "mesh.fsdp=2", "mesh.data=1"]), 8).param_rules
    assert tuple(logical_to_spec(("layers", "expert", "embed", "mlp"), rules))[1:] == ("expert", "fsdp", "tensor")
    assert logical_to_spec(("layers", "embed", "heads", "head_dim"), rules)[1] == ("fsdp", "expert")
    assert tuple(logical_to_spec(("vocab", "embed"), rules)) == ("tensor", ("fsdp", "expert"))
    given = load_config(TINY_DEEPSEEK, ["mesh.expert=4", "mesh.fsdp=2", "mesh.data=1", "sharding.params.embed=[expert,fsdp]"])
    assert plan_layout(given, 8).param_rules == to_rules(given.sharding.params)
    plain = load_config(TINY_DEEPSEEK, ["mesh.fsdp=8", "mesh.data=1"])
    assert plan_layout(plain, 8).param_rules == to_rules(plain.sharding.params)


def test_the_expert_all_to_all_estimate_counts_each_routed_copy():
    """tiny-deepseek on expert=4 x data=2: 3 MoE layers and the prediction module's block, each
    token's 2 copies of a 128-wide float32 row out and back, forward, backward and recompute."""
    cfg = load_config(TINY_DEEPSEEK, ["mesh.expert=4", "mesh.data=2", "model.remat=full"])
    local_rows = 16 / 8 * 128  # batch rows over data x expert, times the sequence
    want = 4 * 6 * 2 * local_rows * 128 * 4 * 3 / 4
    assert expert_bytes(cfg, resolve_mesh_shape(cfg.mesh, 8)) == pytest.approx(want, rel=1e-12)
    none = load_config(TINY_DEEPSEEK, ["mesh.expert=4", "mesh.data=2", "model.remat=none"])
    assert expert_bytes(none, resolve_mesh_shape(none.mesh, 8)) == pytest.approx(want * 4 / 6, rel=1e-12)


def test_the_storage_gathers_are_what_the_storage_saves_three_times():
    """Split over expert (4), the weights outside the experts take (n-1)/n of their bytes off each
    device: data=8 holds every weight whole, expert=4 x data=2 the experts by a quarter and the
    rest by a quarter too (the exact shard sizes, state_bytes). The least traffic over `expert`
    (planner/minimum.py) gathers them forward and backward and reduces their gradients: 3 x what
    that saves (float32 compute: the gathered dtype is the stored one); data=8 gathers nothing."""
    base = ["mesh.pipeline=1", "model.remat=full"]
    whole, split = check(TINY_DEEPSEEK, [*base, "mesh.data=8"], 8), check(TINY_DEEPSEEK, [*base, "mesh.expert=4", "mesh.data=2"], 8)
    spec = prepare(split, 8, with_data=False)
    leaves = zip(jax.tree.leaves(spec.model.shapes), jax.tree.leaves(spec.model.axes, is_leaf=lambda x: isinstance(x, tuple)))
    experts = sum(math.prod(s.shape) * 4 for s, names in leaves if "expert" in names)
    assert experts > 0
    saved = state_bytes(whole, 8)["params"] - state_bytes(split, 8)["params"] - experts * 3 / 4
    assert saved > 0 and set(state_bytes(whole, 8)["minimum"]) == {"data"}
    assert state_bytes(split, 8)["minimum"]["expert"] == pytest.approx(3 * saved, rel=1e-9)


@pytest.mark.real_target
def test_search_on_moe_compiles_the_top_layouts_and_proposes_one_that_fits(tmp_path):
    if not has_compiler(HARDWARE["h100"]):
        pytest.skip("h100's compiler is not installed (make compilers)")
    out = tmp_path / "plan.json"
    done = subprocess.run([sys.executable, "plan.py", "--config", TINY_DEEPSEEK, "--devices", "8", "--hardware", "h100",
                           "--search", "--top", "2", "mesh.pipeline=1", "model.remat=full", "data.source=synthetic",
                           "--out", str(out)], cwd=ROOT, env=real_target_env(), capture_output=True, text=True,
                          timeout=1200)
    assert done.returncode == 0, done.stderr[-3000:]
    plans = json.loads(out.read_text())["plans"]
    tried = [p for p in plans if "layout" in p]
    assert {p["layout"]["expert"] for p in tried} == {1, 2, 4, 8}
    compiled = [p for p in plans if "memory" in p]
    assert len(compiled) == 2 and sorted(p["analytic_rank"] for p in compiled) == [1, 2]
    assert all(p["status"] == "not compiled" for p in tried if p.get("analytic_rank", 0) > 2)
    best = plans[0]
    assert best["status"] == "fits" and best["layout"]["expert"] > 1
    assert best["memory"]["total"] <= best["memory"]["budget"]
    assert best["estimate"]["memory"] <= best["memory"]["total"]  # the estimate is a floor

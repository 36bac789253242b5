"""`plan.py --search` on a mixture of experts (planner/rank.py): it tries expert-parallel layouts
(sizes that divide the expert count) and the storage that splits the weights outside the experts
over fsdp x expert, ranks them analytically, compiles only the `--top` best, and proposes one
that fits (real H100 compile: tests marked real_target)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT, real_target_env
from configs import load_config
from plan import check, state_bytes
from planner import candidates
from sharding.hardware import HARDWARE
from planner.rank import EXPERT_STORAGE, expert_bytes
from planner.targets import has_compiler
from sharding import resolve_mesh_shape
from sharding.rules import logical_to_spec, to_rules

TINY_DEEPSEEK = os.path.join(ROOT, "configs", "tiny-deepseek.yaml")


def _sizes(tried: list[list[str]], axis: str) -> set[int]:
    return {int(o.split("=")[1]) for c in tried for o in c if o.startswith(f"mesh.{axis}=")}


def test_search_tries_the_expert_sizes_that_divide_the_experts():
    assert _sizes(candidates(["mesh.pipeline=1"], 8, True, ["full"], experts=8), "expert") == {1, 2, 4, 8}
    assert _sizes(candidates(["mesh.pipeline=1"], 8, True, ["full"], experts=6), "expert") == {1, 2}
    assert _sizes(candidates(["mesh.pipeline=1"], 8, True, ["full"]), "expert") == {1}  # a dense model
    assert _sizes(candidates(["mesh.expert=4"], 8, True, ["full"], experts=8), "expert") == {4}  # pinned


def test_search_tries_the_expert_storage_only_where_it_splits_something():
    tried = candidates(["mesh.pipeline=1"], 8, True, ["full"], experts=8)
    stored = [c for c in tried if EXPERT_STORAGE[0] in c]
    assert stored
    assert all("mesh.expert=1" not in c and "mesh.tensor=1" in c for c in stored)
    assert len(stored) < len(tried) == len({tuple(c) for c in tried})
    given = candidates(["mesh.pipeline=1", "sharding.params.embed=fsdp"], 8, True, ["full"], experts=8)
    assert not any(EXPERT_STORAGE[0] in c for c in given)  # rules given on the command line stay


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
    """Split over expert (4) the weights outside the experts take (n-1)/n of their bytes off each
    device (the exact shard sizes, state_bytes); gathering them forward and backward and reducing
    their gradients moves 3 x that (float32 compute: the gathered dtype is the stored one)."""
    base = ["mesh.expert=4", "mesh.data=2", "mesh.pipeline=1", "model.remat=full"]
    plain, stored = check(TINY_DEEPSEEK, base, 8), check(TINY_DEEPSEEK, [*base, *EXPERT_STORAGE], 8)
    experts = logical_to_spec(("layers", "expert", "embed", "mlp"), to_rules(stored.sharding.params))
    assert experts[1] == "expert" and experts[3] == "fsdp", experts  # the experts stay split by expert
    entries = load_config(TINY_DEEPSEEK, ["sharding.params.embed=[fsdp,expert]", "sharding.params.mlp=fsdp"])
    assert logical_to_spec(("layers", "expert", "embed", "mlp"), to_rules(entries.sharding.params)) == experts
    saved = state_bytes(plain, 8)["params"] - state_bytes(stored, 8)["params"]
    assert saved > 0 and state_bytes(plain, 8)["expert_gathers"] == 0
    assert state_bytes(stored, 8)["expert_gathers"] == pytest.approx(3 * saved, rel=1e-9)


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
    assert any(EXPERT_STORAGE[0] in p["overrides"] for p in tried)
    compiled = [p for p in plans if "memory" in p]
    assert len(compiled) == 2 and sorted(p["analytic_rank"] for p in compiled) == [1, 2]
    assert all(p["status"] == "not compiled" for p in tried if p.get("analytic_rank", 0) > 2)
    best = plans[0]
    assert best["status"] == "fits" and best["layout"]["expert"] > 1
    assert best["memory"]["total"] <= best["memory"]["budget"]
    assert best["estimate"]["memory"] <= best["memory"]["total"]  # the estimate is a floor

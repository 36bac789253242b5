"""The AOT planner (plan.py): the HLO collective parser on known text and on real
compiles, predicted memory against real compiles and materialized state, fits / does not fit
(the Llama-3-8B shape on 64 H100s), the --search ranking and plan.json, the pipeline schedules
it tries and their bubble formulas, and bad input."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import subprocess
import sys

import jax
import pytest

from configs import load_config
import plan
from plan import main, state_bytes
from planner import candidates
from planner.progress import Heartbeat, wait_with_progress
import pipeline
from configs.schema import PIPELINE_SCHEDULES
from pipeline import bubble_formula, bubble_fraction
from pipeline.ticks import backward_item, forward_of_backward
from planner.hlo import collectives, device_groups, static_counts
from planner.report import print_plan
from conftest import ROOT
from planner.compiled import compiled_stats
from trainer.program import abstract_program

TINY = os.path.join(ROOT, "configs", "tiny.yaml")
LLAMA_8B = os.path.join(ROOT, "configs", "llama3-8b.yaml")
BOUND = 0.01  # predicted vs compiled/materialized bytes: the same program, so within 1%

KNOWN_HLO = """\
HloModule known

%add (a: f32[], b: f32[]) -> f32[] {
  ROOT %s = f32[] add(f32[] %a, f32[] %b)
}

%body.1 (arg: (s32[], bf16[8,16])) -> (s32[], bf16[8,16]) {
  %ag.1 = bf16[8,16]{1,0} all-gather(%x), channel_id=1, replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_1'}, dimensions={0}
  %cp.1 = f32[4]{0} collective-permute(%y), channel_id=2, source_target_pairs={{0,4},{1,5},{2,6},{3,7}}
  ROOT %t = (s32[], bf16[8,16]) tuple(%i, %ag.1)
}

%cond.2 (arg: (s32[], bf16[8,16])) -> pred[] {
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

ENTRY %main.3 (p0: f32[8,16]) -> f32[8,16] {
  %w = (s32[], bf16[8,16]) while(%init), condition=%cond.2, body=%body.1, backend_config={"known_trip_count":{"n":"6"}}
  %ar = (f32[8,16]{1,0}, f32[]) all-reduce(%a, %b), channel_id=3, replica_groups=[2,4]<=[8], to_apply=%add
  %rs = f32[2,16]{1,0} reduce-scatter(%c), channel_id=4, replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={0}, to_apply=%add
  ROOT %a2a = f32[8,16]{1,0} all-to-all(%d), channel_id=5, replica_groups=[4,2]<=[2,4]T(1,0), dimensions={0}
}
"""
PROMOTED = "  %ar.9 = f32[8,16]{1,0} all-reduce(%e), channel_id=6, replica_groups={}, to_apply=%add.1.clone_promoted\n"


def test_parser_on_known_hlo():
    ops, unknown = collectives(KNOWN_HLO, {"data": 2, "fsdp": 4}, nodes=4)
    got = {c.kind: (c.axes, c.group_size, c.bytes, c.count, c.wire_bytes, c.inter_node) for c in ops}
    assert unknown == 0
    assert got == {
        "all-gather": (("fsdp",), 4, 8 * 16 * 2, 6, 0.75 * 256, False),  # in the loop: 6 trips
        "collective-permute": (("data",), 2, 16, 6, 16.0, True),
        "all-reduce": (("fsdp",), 4, 8 * 16 * 4 + 4, 1, 2 * 0.75 * 516, False),
        "reduce-scatter": (("fsdp",), 4, 4 * 2 * 16 * 4, 1, 0.75 * 512, False),  # the operand: 4 shards
        "all-to-all": (("data",), 2, 8 * 16 * 4, 1, 0.5 * 512, True),
    }
    assert static_counts(KNOWN_HLO) == {**{k: 1 for k in got}, "ragged-all-to-all": 0}
    # A bf16 all-reduce the CPU backend widened to f32 counts at its bf16 size.
    widened = KNOWN_HLO.replace("  ROOT %a2a", PROMOTED + "  ROOT %a2a")
    extra = [c for c in collectives(widened, {"data": 2, "fsdp": 4}, 4)[0] if c not in ops]
    assert [(c.kind, c.axes, c.bytes) for c in extra] == [("all-reduce", ("data", "fsdp"), 8 * 16 * 2)]
    # An all-to-all of integers alone (an MoE dispatch's expert ids) is labelled by them; beside
    # floats, integers are loop counters and indices, not data.
    ids = KNOWN_HLO.replace("ROOT %a2a = f32[8,16]", "ROOT %a2a = s32[8,16]")
    labels = {c.kind: (c.dtype, c.by_dtype) for c in collectives(ids, {"data": 2, "fsdp": 4}, 4)[0]}
    assert labels["all-to-all"] == ("s32", (("s32", 8 * 16 * 4),))
    assert labels["all-reduce"][0] == "f32"  # (f32[8,16], f32[]): the scalar beside it counts as f32


@pytest.mark.parametrize(
    "text, groups",
    [
        ("replica_groups=mesh['axis_0'=2,'axis_1'=4], device_ids=([4,2]T(1,0)) {'axis_0'}", [[0, 1], [2, 3], [4, 5], [6, 7]]),
        ("replica_groups=mesh['axis_0'=8] {'axis_0':(2)2}", [[0, 2], [1, 3], [4, 6], [5, 7]]),
        ("replica_groups=[2,4]<=[4,2]T(1,0), ", [[0, 2, 4, 6], [1, 3, 5, 7]]),
        ("replica_groups={}, ", [list(range(8))]),
    ],
)
def test_device_group_forms(text: str, groups: list[list[int]]):
    assert sorted(device_groups(text, 8)) == groups


def _tiny(*overrides: str):
    return load_config(TINY, ["data.source=synthetic", *overrides])


def search(tmp_path_factory: pytest.TempPathFactory, name: str, *args: str) -> tuple[str, dict]:
    """`plan.py --devices 4 --search ARGS` run by its `main` in this process (the compiles still
    run in plan.py's child, as from the command line), on the CPU fallback: no compilers on its
    path. Its printed plan and plan.json (plan.py's command line: test_cli_bad_device_count_exit_status),
    written into a folder that does not exist yet, as `--out runs/plans/NAME.json` would be."""
    out = tmp_path_factory.mktemp(name) / "plans" / "plan.json"
    printed = io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(printed):
        mp.setenv("MESHLM_COMPILERS", str(tmp_path_factory.mktemp("no-compilers")))
        code = main(["--config", TINY, "--devices", "4", "--search", "--out", str(out), *args])
    assert code == 0, printed.getvalue()
    return printed.getvalue(), json.loads(out.read_text())


@pytest.fixture(scope="module")
def searched(tmp_path_factory) -> tuple[str, dict]:
    """One real `--search` over data x fsdp on 4 devices (pipeline and tensor pinned to 1), on the
    CPU fallback, so its figures can be checked against compiles in this process;
    tests/test_targets.py checks the real GPU and TPU compiles."""
    return search(tmp_path_factory, "plan", "--remat", "none,full", "mesh.pipeline=1", "mesh.tensor=1",
                  "data.source=synthetic")


def test_search_ranks_and_writes_plan_json(searched):
    printed, plan = searched
    assert plan["devices"] == 4 and plan["hardware"]["name"] == "h100" and plan["best"] == 0
    fits = [p for p in plan["plans"] if p["status"] == "fits"]
    assert {(p["layout"]["data"], p["layout"]["fsdp"]) for p in fits} == {(4, 1), (2, 2), (1, 4)}
    steps = [p["time"]["step_s"] for p in fits]
    assert steps == sorted(steps) and len(set(steps)) > 1  # ranked, and the layouts really differ
    skipped = [p for p in plan["plans"] if p["status"] == "skipped"]  # `full` never beats a fitting `none`
    assert len(skipped) == 3 and all(p["remat"] == "full" and "remat none" in p["reason"] for p in skipped)
    for p in fits:
        assert set(p["memory"]) >= {"params", "optimizer", "temps", "total", "budget", "margin"}
        assert set(p["time"]) >= {"compute_s", "exposed_comm_s", "overlapped_comm_s", "step_s", "mfu"}
        assert p["time"]["compute_s"] > 0 and p["hbm_bytes"] > 0 and p["flops"]["compiled"] > 0
        assert p["flops"]["model"] > p["flops"]["xla_cost_analysis"] > 0  # XLA counts the layer scan once
        assert all({"kind", "dtype", "axes", "count", "bytes", "wire_bytes", "seconds"} <= set(c) for c in p["collectives"])
    first = fits[0]["layout"]
    assert f"| 1 | data={first['data']} fsdp={first['fsdp']} | none | fits |" in printed


def test_predicted_memory_matches_real_compile_and_state(searched):
    """The planned pure-data and pure-FSDP layouts against an independent compile in this
    process, and the FSDP plan's parameter and optimizer bytes against the state really
    materialized on the first device."""
    from trainer.state import init_state

    _, plan = searched
    devices = jax.devices()[:4]
    by_layout = {(p["layout"]["data"], p["layout"]["fsdp"]): p for p in plan["plans"] if p["status"] == "fits"}
    totals = []
    for layout in [(4, 1), (1, 4)]:
        p = by_layout[layout]
        program = abstract_program(_tiny(*p["overrides"]), devices)
        stats = compiled_stats(program.compile()[0])
        real = stats["argument_bytes"] + stats["temp_bytes"] + stats["output_bytes"] - stats["alias_bytes"]
        m = p["memory"]
        assert abs(m["total"] - real) <= BOUND * real, (layout, m["total"], real)
        args = m["params"] + m["optimizer"] + m["batch"]
        assert abs(args - stats["argument_bytes"]) <= BOUND * stats["argument_bytes"], layout
        totals.append(m["total"])
    assert totals[0] != totals[1]  # the two layouts really differ
    state = init_state(program.spec.cfg.model, program.tx, 0, program.state_sh)
    on_first = sum(s.data.nbytes for x in jax.tree.leaves(state) for s in x.addressable_shards if s.device == devices[0])
    assert on_first == m["params"] + m["optimizer"]


def test_collectives_land_on_the_right_axes(searched):
    _, plan = searched
    by_layout = {(p["layout"]["data"], p["layout"]["fsdp"]): p for p in plan["plans"] if p["status"] == "fits"}
    param_bytes = state_bytes(_tiny("mesh.data=1", "mesh.fsdp=1", "mesh.tensor=1"), 1)["params"]
    data = {(c["kind"], tuple(c["axes"])): c for c in by_layout[(4, 1)]["collectives"]}
    assert set(data) == {("all-reduce", ("data",))}  # pure data parallel: gradients all-reduced, nothing gathered
    assert param_bytes <= data[("all-reduce", ("data",))]["bytes"] <= 1.1 * param_bytes
    fsdp: dict[tuple, dict] = {}  # (kind, axes) -> summed over dtypes and the op each was written as
    for c in by_layout[(1, 4)]["collectives"]:
        t = fsdp.setdefault((c["kind"], tuple(c["axes"])), {"bytes": 0, "count": 0})
        t["bytes"] += c["bytes"]
        t["count"] += c["count"]
    assert ("all-gather", ("fsdp",)) in fsdp and not any("data" in axes for _, axes in fsdp)
    gathered = fsdp[("all-gather", ("fsdp",))]
    assert gathered["bytes"] >= param_bytes  # every weight gathered at least once per step
    layers = _tiny().model.num_layers
    assert gathered["count"] >= 2 * layers  # forward and backward of each scanned layer


@pytest.fixture(scope="module")
def pipelined_search(tmp_path_factory) -> tuple[str, dict]:
    """`--search` on one pipelined mesh (pipeline=2 x data=2, 8 microbatches filled in) with no
    schedule given: one compile per schedule, on the CPU fallback."""
    return search(tmp_path_factory, "plan_pipe", "--remat", "none", "mesh.pipeline=2", "mesh.data=2", "mesh.fsdp=1",
                  "mesh.tensor=1", "data.source=synthetic")


def test_search_tries_each_schedule_with_its_bubble(pipelined_search, searched):
    printed, plan = pipelined_search
    fits = {p["pipeline"]["schedule"]: p for p in plan["plans"] if p["status"] == "fits"}
    assert set(fits) == {"gpipe", "1f1b", "zero_bubble"}
    for schedule, p in fits.items():
        assert p["layout"]["schedule"] == schedule and p["layout"]["microbatches"] == 8
        assert p["pipeline"]["bubble"] == p["time"]["bubble"] == bubble_fraction(2, 1, 8, schedule)
        assert f"pipeline=2 data=2 fsdp=1 microbatches=8 schedule={schedule} | none | fits |" in printed
    assert fits["gpipe"]["pipeline"]["bubble"] == 1 / 9  # (S - 1) / (M + S - 1), S = 2, M = 8
    assert fits["zero_bubble"]["pipeline"]["bubble"] == 3 / 51  # 1 x (1 + 2) / (9 x (1 + 2) + 8 x 3)
    # The two schedules are really different programs: GPipe keeps all 8 microbatches' activations.
    assert fits["gpipe"]["memory"]["temps"] > fits["1f1b"]["memory"]["temps"]
    assert "| 0.111 |" in printed
    _, unpipelined = searched
    assert all("pipeline" not in p and "schedule" not in p["layout"] for p in unpipelined["plans"])


def test_the_plan_prints_the_schedule_and_its_bubble_formula(pipelined_search, capsys):
    _, plan = pipelined_search
    for p in plan["plans"]:
        print_plan({**plan, "plans": [p]})
    out = capsys.readouterr().out
    assert "pipeline schedule 1f1b: bubble 0.111 = (S - 1) / (M + S - 1) = 1 / (8 + 1)" in out
    assert "pipeline schedule gpipe: bubble 0.111 = (S - 1) / (R x M + S - 1) = 1 / (1 x 8 + 1)" in out
    assert ("pipeline schedule zero_bubble: bubble 0.059 = (S - 1)(F + B) / ((M + S - 1)(F + B) + M W), "
            "F 1 B 2 W 3 = 1 x 3 / (9 x 3 + 8 x 3)") in out


def test_the_predicted_step_does_not_charge_the_bubble_again():
    """The pipeline programs compute on every tick (idle stages on masked inputs), so the roofline
    compute already holds the bubble: the step is compute plus exposed communication."""
    from sharding.hardware import HARDWARE, predict

    hw = HARDWARE["h100"]
    comm = [{"axes": ["pipeline"], "wire_bytes": 1e9, "inter_node": False}]
    t = predict(hw=hw, model_flops=1e15, compute_s=1.0, collectives=comm, bubble=0.5)
    assert t["exposed_comm_s"] > 0 and t["bubble"] == 0.5
    assert t["step_s"] == pytest.approx(1.0 + t["exposed_comm_s"])


def test_bubble_formula_names_the_numbers_of_the_fraction():
    assert bubble_formula("gpipe", 4, 2, 8) == "(S - 1) / (R x M + S - 1) = 3 / (2 x 8 + 3)"
    assert bubble_fraction(4, 2, 8) == 3 / (2 * 8 + 3)
    assert bubble_formula("1f1b", 4, 1, 16) == "(S - 1) / (M + S - 1) = 3 / (16 + 3)"
    assert bubble_fraction(4, 1, 16, "zero_bubble") == 9 / (19 * 3 + 16 * 3)


@pytest.mark.parametrize("schedule, shapes", [
    ("gpipe", [(2, 2, 1), (4, 16, 1), (3, 5, 1), (4, 8, 2), (2, 6, 3)]),
    ("1f1b", [(2, 2, 1), (4, 4, 1), (4, 16, 1), (3, 5, 1)]),
    ("interleaved_1f1b", [(2, 4, 2), (4, 8, 2), (2, 6, 3)]),
    ("zero_bubble", [(2, 2, 1), (4, 4, 1), (4, 16, 1), (3, 5, 1), (8, 8, 1)]),
])
def test_the_bubble_measured_on_the_tick_table_is_the_formula(schedule, shapes):
    """The schedule's own ticks (pipeline/ticks.py and the schedule's phases: the scans it runs,
    which stage runs which pass), masked slots costed by the cost model, give the bubble, and the
    printed closed form with its numbers evaluates to it."""
    s = pipeline.get(schedule)
    for S, M, R in shapes:
        table = s.tick_table(S, R, M)
        for kind in "FBW":  # every stage runs every microbatch's pass of each slot kind once
            ran = [sorted(i for row in table if kind in row for i in [row[kind][st]] if i is not None) for st in range(S)]
            assert all(r == ran[0] for r in ran) and ran[0] in ([], list(range(R * M)))
        closed = eval(s.formula(S, R, M).split(" = ")[-1].replace(" x ", " * "))
        assert s.bubble(S, R, M) == pytest.approx(closed, rel=1e-12)
    if schedule == "zero_bubble":  # below 1F1B's, by the W of S - 1 ticks
        for S, M, _ in shapes:
            assert s.bubble(S, 1, M) < pipeline.get("1f1b").bubble(S, 1, M)


def test_the_registry_holds_the_schedules_the_config_names():
    """configs cannot import the pipeline package: its list of names must follow the registry's."""
    assert pipeline.names() == PIPELINE_SCHEDULES
    assert [n for n in pipeline.names() if pipeline.get(n).computes_grads] == ["1f1b", "interleaved_1f1b", "zero_bubble"]


def _stage_input_lives(schedule: str, S: int, R: int, M: int) -> tuple[int, int]:
    """By the tick table, a stage input lives from the tick of its forward to that of its last use
    (its backward, or under zero_bubble its W): the most any stage holds at once, and the longest
    any lives, in ticks counting both ends."""
    table = pipeline.get(schedule).tick_table(S, R, M)
    most = longest = 0
    for st in range(S):
        forward, last = {}, {}
        for t, row in enumerate(table):  # the phases run ticks 0, 1, ... in order
            if row.get("F", [None] * S)[st] is not None:
                forward[row["F"][st]] = t
            if row.get("B", [None] * S)[st] is not None:
                w = row["B"][st]
                last[forward_of_backward(w, *backward_item(w, S, R), S, R)] = t
            if row.get("W", [None] * S)[st] is not None:
                last[row["W"][st]] = t  # R = 1: the W's pass index is its forward's
        assert forward.keys() == last.keys() == set(range(R * M))
        most = max(most, *(sum(forward[u] <= t <= last[u] for u in forward) for t in range(len(table))))
        longest = max(longest, *(last[u] - forward[u] + 1 for u in forward))
    return most, longest


@pytest.mark.parametrize("schedule, shapes", [
    ("1f1b", [(2, 2, 1), (4, 4, 1), (4, 16, 1), (3, 5, 1)]),
    ("interleaved_1f1b", [(2, 4, 2), (4, 8, 2), (2, 6, 3), (4, 32, 2)]),
    ("zero_bubble", [(2, 2, 1), (4, 4, 1), (4, 16, 1), (3, 5, 1), (8, 8, 1)]),
])
def test_the_stash_holds_every_stage_input_in_flight(schedule, shapes):
    """The 1F1B step stashes each stage input in slot (forward tick mod the schedule's
    stash_slots) until its last use, so the slots must cover the longest life (2RS - 1 ticks:
    no fewer, or a live input is overwritten, and no more, by the tick table), and the memory a
    schedule states holds every input in flight."""
    s = pipeline.get(schedule)
    for S, M, R in shapes:
        most, longest = _stage_input_lives(schedule, S, R, M)
        assert longest == s.stash_slots(S, R) and most <= s.in_flight(S, R, M)


def test_search_tries_the_schedules_the_repeats_allow_or_the_one_given():
    tried = candidates(["mesh.data=2", "pipeline.schedule=1f1b"], 4, True, ["none"])
    pipelined = [c for c in tried if "mesh.pipeline=2" in c]
    assert pipelined and all("pipeline.schedule=1f1b" in c for c in pipelined)
    assert all(not any(o.startswith("pipeline.schedule=") for o in c) for c in tried if "mesh.pipeline=1" in c)
    assert len(tried) == len({tuple(c) for c in tried})
    circular = candidates(["mesh.data=2", "pipeline.repeats=2"], 4, True, ["none"])
    assert {o for c in circular for o in c if o.startswith("pipeline.schedule=")} == {
        "pipeline.schedule=gpipe", "pipeline.schedule=interleaved_1f1b"}


def test_llama3_8b_data_parallel_is_refused_without_compiling(tmp_path, capsys):
    """Pure data parallel cannot fit (its state alone is 96 GB): decided before any compile.
    The compiled 8B layouts are in tests/test_targets.py."""
    data_parallel = ["--config", LLAMA_8B, "--devices", "64", "--search", "--out", str(tmp_path / "dp.json"),
                     "mesh.pipeline=1", "mesh.data=64", "mesh.fsdp=1", "mesh.tensor=1", "model.remat=full"]
    assert main(data_parallel) == 1
    assert "parameters + optimizer state alone need 96.4 GB" in capsys.readouterr().out


@pytest.mark.parametrize(
    "args, message",
    [
        (["--devices", "6", "mesh.fsdp=4"], "mesh"),
        (["--devices", "0"], "--devices"),
        (["--devices", "3", "--search"], "no valid layout"),
        (["--devices", "8", "--search", "--remat", "some"], "--remat"),
        (["--devices", "8", "--top", "2"], "--top"),
        (["--devices", "8", "--search", "--top", "-1"], "--top"),
        (["--devices", "8", "mesh.fsdpp=2"], "did you mean mesh.fsdp"),
    ],
)
def test_bad_input_exits_2_before_compiling(args: list[str], message: str, capsys):
    assert main(["--config", TINY, *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1


def test_cli_bad_device_count_exit_status():
    done = subprocess.run([sys.executable, "plan.py", "--config", TINY, "--devices", "6", "mesh.fsdp=4"],
                          cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 2 and done.stderr.startswith("error: mesh")


def test_the_fallback_is_said_before_anything_compiles(monkeypatch, tmp_path, capsys):
    """Without the target's compiler, the FALLBACK line (naming `make compilers`) is out before
    the compiling process starts, not after its minutes."""
    said: list[str] = []

    def compile_nothing(config, jobs, *rest):  # noqa: ANN001, ANN002 (run_child's arguments)
        said.append(capsys.readouterr().out)
        return [{"error": "not compiled"} for _ in jobs]

    monkeypatch.setenv("MESHLM_COMPILERS", str(tmp_path / "none"))
    monkeypatch.setattr(plan, "run_child", compile_nothing)
    assert main(["--config", TINY, "--devices", "8", "--hardware", "h200"]) == 1
    assert said and said[0].startswith("FALLBACK: h200's compiler is not installed (make compilers installs it); "
                                       "compiling for 8 fake CPU devices"), said


def test_the_wait_for_a_compile_names_it_and_counts_the_seconds(tmp_path, capsys):
    """The parent echoes each compile the child starts and, while it runs, the elapsed time."""
    progress, tmp = str(tmp_path / "progress"), str(tmp_path / "progress.tmp")
    script = (f"import os, time\nfor label in ('compiling a', 'compiling b'):\n"
              f"    open({tmp!r}, 'w').write(label)\n    os.replace({tmp!r}, {progress!r})\n    time.sleep(1.5)\n")
    child = subprocess.Popen([sys.executable, "-c", script])
    assert wait_with_progress(child, progress, every=0.4) == 0
    lines = capsys.readouterr().err.splitlines()
    assert lines.index("compiling a") < lines.index("compiling b"), lines
    assert any(re.fullmatch(r"compiling a \.\.\. \d+ s", line) for line in lines), lines
    assert all(re.fullmatch(r"(compiling [ab]|(starting the compiling process|compiling [ab]) \.\.\. \d+ s)", line)
               for line in lines), lines


def test_a_compile_is_named_by_preset_target_and_layout():
    from sharding.hardware import HARDWARE

    cfg = load_config(LLAMA_8B, ["mesh.data=1", "mesh.fsdp=64", "model.remat=full"])
    v5p, h100 = HARDWARE["tpu-v5p"], HARDWARE["h100"]
    label = plan.compiling_label
    assert label(LLAMA_8B, cfg, v5p, v5p, 64, "") == "compiling llama3-8b for v5p 4x4x4 (fsdp=64, remat full)"
    assert label("llama3-8b", cfg, h100, h100, 64, "") == "compiling llama3-8b for 64 x h100 (fsdp=64, remat full)"
    assert label(None, cfg, h100, None, 64, "") == (
        "compiling the default config for 64 fake CPU devices (fsdp=64, remat full)")


def test_a_long_loop_says_how_far_it_got_and_a_short_one_nothing(capsys):
    """A search's checks of hundreds of layouts report on stderr while they run, past the heartbeat."""
    quiet, loud = Heartbeat("checking the layouts", 3, every=60.0), Heartbeat("checking the layouts", 588)
    quiet.tick()
    assert capsys.readouterr().err == ""
    loud.tick(), loud.tick()  # the first two items within the heartbeat
    assert capsys.readouterr().err == ""
    loud.every = 0.0  # the third starts past it
    loud.tick()
    assert re.fullmatch(r"checking the layouts \(2 of 588\) \.\.\. \d+ s\n", capsys.readouterr().err)

"""Pipeline parallelism on 8 fake devices: the same loss and gradients as the plain scan, the
same training curve as data parallelism, real collective-permutes in the compiled step, and
checkpoints that move freely between pipeline layouts."""

from __future__ import annotations

import functools
import json
import os
import pathlib
import re
from typing import Callable

import jax
import numpy as np
import pytest

import trainer
from bench.procs import two_processes
from configs import ConfigError, load_config
from conftest import ROOT, stdlib_glob, stopped_at
from test_context import initial_params, packed_batch
from sharding import activation_rules
from planner.compiled import collective_counts
from trainer import abstract_program
from trainer.objectives.lm import make_loss_fn
from trainer.step import accumulate

TINY = os.path.join(ROOT, "configs", "tiny.yaml")
PIPELINED = {
    "pipeline=4 x data=2": ["mesh.pipeline=4", "mesh.data=2", "pipeline.microbatches=8"],
    "pipeline=2 x fsdp=2 x tensor=2": ["mesh.pipeline=2", "mesh.data=1", "mesh.fsdp=2", "mesh.tensor=2",
                                       "pipeline.microbatches=4"],
    "circular: pipeline=2 x data=2 x tensor=2, 2 repeats, remat, grad accum": [
        "mesh.pipeline=2", "mesh.data=2", "mesh.tensor=2", "pipeline.repeats=2", "pipeline.microbatches=2",
        "model.remat=save_dots_no_batch", "train.grad_accum=2"],
    "circular: pipeline=2 x data=4, 2 repeats, dot_product attention": [
        "mesh.pipeline=2", "mesh.data=4", "pipeline.repeats=2", "model.attention=dot_product"],
    "1f1b: pipeline=4 x data=2": ["mesh.pipeline=4", "mesh.data=2", "pipeline.microbatches=8",
                                  "pipeline.schedule=1f1b"],
    "1f1b: pipeline=2 x fsdp=2 x tensor=2, remat, grad accum": [
        "mesh.pipeline=2", "mesh.data=1", "mesh.fsdp=2", "mesh.tensor=2", "pipeline.microbatches=2",
        "model.remat=save_dots_no_batch", "train.grad_accum=2", "pipeline.schedule=1f1b"],
    "interleaved 1f1b: pipeline=2 x data=4, 2 repeats, 2 groups of 2 microbatches, packed documents": [
        "mesh.pipeline=2", "mesh.data=4", "pipeline.repeats=2", "pipeline.microbatches=4",
        "pipeline.schedule=interleaved_1f1b"],
    "interleaved 1f1b: pipeline=2 x fsdp=2 x tensor=2, 2 repeats, remat, grad accum": [
        "mesh.pipeline=2", "mesh.data=1", "mesh.fsdp=2", "mesh.tensor=2", "pipeline.repeats=2",
        "pipeline.microbatches=2", "model.remat=save_dots_no_batch", "train.grad_accum=2",
        "pipeline.schedule=interleaved_1f1b"],
    "1f1b: pipeline=4 x data=2, loss_chunk=16 (the head whole on every device)": [
        "mesh.pipeline=4", "mesh.data=2", "pipeline.microbatches=4", "pipeline.schedule=1f1b", "model.loss_chunk=16"],
    "zero bubble: pipeline=4 x data=2, packed documents": ["mesh.pipeline=4", "mesh.data=2", "pipeline.microbatches=8",
                                                           "pipeline.schedule=zero_bubble"],
    "zero bubble: pipeline=4 x data=2, 4 microbatches (M = S)": [
        "mesh.pipeline=4", "mesh.data=2", "pipeline.microbatches=4", "pipeline.schedule=zero_bubble"],
    "zero bubble: pipeline=2 x fsdp=2 x tensor=2, remat, grad accum": [
        "mesh.pipeline=2", "mesh.data=1", "mesh.fsdp=2", "mesh.tensor=2", "pipeline.microbatches=4",
        "model.remat=save_dots_no_batch", "train.grad_accum=2", "pipeline.schedule=zero_bubble"],
}


def config(*overrides: str):
    return load_config(TINY, [f"data.path={stdlib_glob('json')}", *overrides])


def loss_and_grads(cfg, devices=None, documents: bool = False) -> tuple[float, dict, str, int]:
    """Loss and gradients of one batch under cfg's layout, gathered to the host, the compiled
    program's HLO, and how many times tracing it ran the loss function (or the pipeline schedule's
    gradient function, which replaces autodiff of it); with `documents`, rows of packed documents
    (segment ids and positions)."""
    program = abstract_program(cfg, devices)
    params = initial_params(program)
    if documents:
        rows = packed_batch(cfg.model.seq_len, True)
    else:
        rows = {"tokens": np.asarray(jax.random.randint(jax.random.key(7), (16, cfg.model.seq_len + 1), 0, 257))}
    batch = {k: jax.device_put(v, program.batch_sh) for k, v in rows.items()}
    traces = []

    def counted(f: Callable) -> Callable:
        def traced(params: dict, batch: dict) -> tuple:
            traces.append(f)
            return f(params, batch)
        return traced

    loss_fn = counted(make_loss_fn(program.spec.model.graphdef, program.compute))
    grad_fn = counted(program.compute.grad_fn) if program.compute.grad_fn else None
    fn = jax.jit(lambda params, batch: accumulate(loss_fn, params, batch, cfg.train.grad_accum, grad_fn))
    with activation_rules(program.mesh, program.spec.layout.act_rules):
        compiled = fn.lower(params, batch).compile()
    loss, grads = compiled(params, batch)
    return float(loss), jax.tree.map(np.asarray, grads), compiled.as_text(), len(traces)


@functools.cache
def pipelined(layout: str) -> tuple[float, dict, str, int]:
    """loss_and_grads under PIPELINED[layout], computed once in the module: the tests that read
    what a layout's program does share its compile with the test of what it computes."""
    cfg = config(*PIPELINED[layout])
    assert abstract_program(cfg).spec.layout.pipelined
    return loss_and_grads(cfg, documents=layout.endswith("packed documents"))


@pytest.fixture(scope="module")
def reference():
    """The plain scan's loss and gradients on one device: random rows, and packed documents."""
    out = {documents: loss_and_grads(config("mesh.data=1"), jax.devices()[:1], documents)[:2]
           for documents in (False, True)}
    assert abs(out[True][0] - out[False][0]) > 1e-3  # else the packed cases test nothing more
    return out


@pytest.mark.parametrize("layout", list(PIPELINED))
def test_pipelined_loss_and_gradients_equal_the_plain_scan(reference, layout):
    loss, grads, *_ = pipelined(layout)
    ref_loss, ref_grads = reference[layout.endswith("packed documents")]
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    flat_ref, flat = jax.tree_util.tree_leaves_with_path(ref_grads), jax.tree.leaves(grads)
    for (path, r), g in zip(flat_ref, flat):
        np.testing.assert_allclose(g, r, rtol=2e-4, atol=2e-6, err_msg=jax.tree_util.keystr(path))
    # Gradients must reach every layer (a stage that silently skipped its layers would give zeros).
    per_layer = np.abs(grads["layers"]["mlp"]["down"]).sum(axis=(1, 2))
    assert (per_layer > 0).all()


@pytest.mark.parametrize("layout", [layout for layout in PIPELINED if "grad accum" in layout])
def test_an_accumulated_step_traces_the_loss_once(layout):
    """Accumulating over micro-batches traces the loss (or the schedule's gradient function) once,
    in the micro-batch scan (an eval_shape that learnt its aux's structure first traced it twice: a
    third to a half of tracing and lowering these train steps). The compile is the layout's above."""
    assert pipelined(layout)[3] == 1


STEPS = 4
# The training runs below share these, so the train step of each layout (the same program whatever
# train.steps is, under a constant schedule) compiles once in the module; the persistent cache
# serves the later runs and test_the_compiled_step_really_permutes_between_stages.
CONSTANT = ["optim.schedule=constant", "optim.warmup_steps=0", "train.log_every=1"]
TRAIN = [*CONSTANT, f"train.steps={STEPS}"]
CURVES = {"data=8": ["mesh.data=8"], "pipeline=4 x data=2": PIPELINED["pipeline=4 x data=2"],
          "circular": PIPELINED["circular: pipeline=2 x data=4, 2 repeats, dot_product attention"]}


def test_the_compiled_step_really_permutes_between_stages():
    plain = collective_counts(abstract_program(config(*CURVES["data=8"], *TRAIN)).lower().compile().as_text())
    piped = collective_counts(abstract_program(config(*CURVES["pipeline=4 x data=2"], *TRAIN)).lower().compile().as_text())
    assert plain["collective-permute"] == 0
    assert piped["collective-permute"] > 0


@pytest.fixture(scope="module")
def run_dirs(tmp_path_factory) -> dict[str, pathlib.Path]:
    """The run directory of each layout's run in `runs`."""
    return {name: tmp_path_factory.mktemp("run") for name in CURVES}


@pytest.fixture(scope="module")
def runs(run_dirs) -> dict[str, list[dict]]:
    """The records (loss, grad_norm, ...) of STEPS steps from the same start under each layout of
    CURVES; each run also checkpoints at step 2, where test_checkpoints_move_between_pipeline_layouts
    resumes it under another layout."""
    return {name: trainer.run(config(*layout, *TRAIN, "checkpoint.every=2", f"run.dir={run_dirs[name]}"))
            for name, layout in CURVES.items()}


@pytest.fixture(scope="module")
def curves(runs) -> dict[str, list[float]]:
    """The losses of `runs`."""
    return {name: [r["loss"] for r in records] for name, records in runs.items()}


@pytest.mark.parametrize("layout", ["pipeline=4 x data=2", "circular"])
def test_training_curve_equals_data_parallelism(curves, layout):
    assert curves["data=8"][-1] < curves["data=8"][0] - 0.1, "a comparison of flat curves proves nothing"
    np.testing.assert_allclose(curves[layout], curves["data=8"], rtol=2e-5)


def test_zero_bubble_with_a_stage_per_process_trains_like_one_process(tmp_path, runs):
    """2 processes x 4 fake devices, pipeline=2 outermost (one stage per process: every tick's
    activations and input gradients cross between them) against GPipe in 1 process x 8 devices
    (pipeline=4 x data=2, the curves' run), over its first 2 steps: both losses and both
    gradient norms (the first step's gradients, whole, and the second's, of parameters those
    moved). Further steps would cost both processes more steps through their collectives;
    the gradient norms check what they would, the gradients' sizes (Adam's first update sees
    little more than their signs)."""
    steps = 2
    reference = runs["pipeline=4 x data=2"][:steps]
    assert reference[-1]["loss"] < reference[0]["loss"] - 0.1, "a comparison of flat curves proves nothing"
    procs = two_processes("--config", TINY, f"run.dir={tmp_path}", "mesh.pipeline=2", "mesh.data=2", "mesh.tensor=2",
                          "pipeline.microbatches=4", "pipeline.schedule=zero_bubble", f"data.path={stdlib_glob('json')}",
                          *CONSTANT, f"train.steps={steps}")
    codes = [p.finish(240) for p in procs]
    assert codes == [0, 0], procs[0].output + procs[1].output
    assert "2 process(es)" in procs[0].output
    with open(tmp_path / "metrics.jsonl") as f:
        records = [json.loads(line) for line in f]
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    for key in ("loss", "grad_norm"):
        np.testing.assert_allclose([r[key] for r in records], [r[key] for r in reference], rtol=2e-5, err_msg=key)


@pytest.mark.parametrize("first, second", [("pipeline=4 x data=2", "data=8"), ("data=8", "circular")],
                         ids=["pipeline=4 -> none", "none -> pipeline=2 x 2 repeats"])
def test_checkpoints_move_between_pipeline_layouts(tmp_path, capsys, run_dirs, curves, first, second):
    """2 steps under `first` (its straight run's checkpoint at step 2, alone in a copy of its run
    directory), resumed under `second`: the last 2 losses of `second`'s straight run."""
    stopped_at(run_dirs[first], tmp_path, 2)
    resumed = trainer.run(config(*CURVES[second], *TRAIN, f"run.dir={tmp_path}"))
    assert "resumed from step 2" in capsys.readouterr().out
    assert [r["step"] for r in resumed] == [3, 4]
    np.testing.assert_allclose([r["loss"] for r in resumed], curves[second][2:], rtol=2e-5)


@functools.cache
def four_stage(schedule: str, m: int) -> jax.stages.Compiled:
    cfg = config("mesh.pipeline=4", "mesh.data=2", f"pipeline.microbatches={m}", f"train.global_batch={4 * m}",
                 f"pipeline.schedule={schedule}")
    return abstract_program(cfg).lower().compile()


def four_stage_temp_bytes(schedule: str, m: int) -> int:
    return four_stage(schedule, m).memory_analysis().temp_size_in_bytes


def logits_rows(text: str) -> tuple[set[int], list[str]]:
    """The per-device (rows x positions) of every float32 [..., vocab 264] value a compiled
    program's HLO computes, and the collectives that move such values."""
    rows = {int(np.prod([int(d) for d in dims.split(",")])) for dims in re.findall(r"= f32\[([\d,]+),264\]", text)}
    moved = [line for line in text.splitlines()
             if re.search(r"= f32\[[\d,]+,264\]\S* (all-gather|all-reduce|all-to-all|collective-permute)", line)]
    return rows, moved


def test_1f1b_splits_the_head_over_the_pipeline_devices():
    """The last stage's output goes through the head and loss as S = 4 pieces of L / S = 8
    positions, one per pipeline device: the compiled 1F1B train step's logits are at most 2
    rows (a data replica's share of a microbatch) x 8 positions per device, not x 32, and no
    collective moves logits (a gather of the targets' logits inside the pieces' vmap would
    all-gather them). With `model.loss_chunk=16` the pieces (8) are no whole chunk: every
    device computes the whole head, 16-position chunks of both rows (as before the split), in
    the loss and gradients of test_pipelined_loss_and_gradients_equal_the_plain_scan's layout
    (2 rows per microbatch and replica too; its compile, shared). The losses of both are that
    test's."""
    rows, moved = logits_rows(four_stage("1f1b", 8).as_text())
    assert rows and max(rows) <= 2 * 8 and not moved, (rows, moved[:3])
    whole, _ = logits_rows(pipelined("1f1b: pipeline=4 x data=2, loss_chunk=16 (the head whole on every device)")[2])
    assert max(whole) == 2 * 16, whole


@pytest.mark.parametrize("schedule, fewest", [("1f1b", 8), ("zero_bubble", 8)])
def test_1f1b_temporaries_stay_flat_in_microbatches_while_gpipe_grows(schedule, fewest):
    """Same microbatch size (2 rows per data replica), M = `fewest` and 16: GPipe keeps every
    microbatch's activations until its backward, 1F1B at most 2S - 1 stage inputs, zero-bubble
    those and S output cotangents of deferred weight gradients. (Zero-bubble from M = 8: at
    M = S = 4 its W-and-F scan runs one trip, which XLA inlines, 67 KB below M = 5, 6, 8, 16.
    1F1B from M = 8 too: GPipe's two compiles serve both schedules, and its M = 8 the head
    split above.)"""
    temp_bytes = four_stage_temp_bytes
    act = 2 * 32 * 64 * 4  # one microbatch's [rows, seq_len, d_model] float32 activation per device
    more = 16 - fewest
    gpipe = temp_bytes("gpipe", 16) - temp_bytes("gpipe", fewest)
    flat = temp_bytes(schedule, 16) - temp_bytes(schedule, fewest)
    assert gpipe > more * act  # the two schedules really differ: GPipe grows by more than an activation each
    assert flat < act  # the extra microbatches cost 1F1B less than one activation (their token rows only)


def test_interleaved_1f1b_temporaries_stay_flat_while_circular_gpipe_grows():
    """Two stages of two repeats, 2 rows per microbatch and data replica, M = 4 and 16: the
    circular GPipe schedule keeps every microbatch's activations of both repeats, interleaved
    1F1B at most 2RS - 1 = 7 stage inputs."""
    def temp_bytes(schedule: str, m: int) -> int:
        cfg = config("mesh.pipeline=2", "mesh.data=4", "pipeline.repeats=2", f"pipeline.microbatches={m}",
                     f"train.global_batch={8 * m}", f"pipeline.schedule={schedule}")
        return abstract_program(cfg).lower().compile().memory_analysis().temp_size_in_bytes

    act = 2 * 32 * 64 * 4
    gpipe = temp_bytes("gpipe", 16) - temp_bytes("gpipe", 4)
    flat = temp_bytes("interleaved_1f1b", 16) - temp_bytes("interleaved_1f1b", 4)
    assert gpipe > 12 * act, gpipe
    assert flat < act, flat


@pytest.mark.parametrize("overrides, message", [
    (["mesh.pipeline=2", "mesh.data=4", "pipeline.repeats=2", "pipeline.schedule=1f1b"],
     "pipeline.schedule=1f1b runs each stage's layers once: pipeline.repeats=2 needs pipeline.schedule=gpipe or "
     "interleaved_1f1b"),
    (["mesh.pipeline=2", "mesh.data=4", "pipeline.schedule=interleaved_1f1b"],
     "pipeline.schedule=interleaved_1f1b needs pipeline.repeats > 1 (with one repeat: pipeline.schedule=1f1b)"),
    (["mesh.pipeline=2", "mesh.data=4", "pipeline.repeats=2", "pipeline.microbatches=3", "train.global_batch=24",
      "pipeline.schedule=interleaved_1f1b"],
     "pipeline.schedule=interleaved_1f1b runs microbatches in groups of mesh.pipeline=2: pipeline.microbatches=3"),
    (["mesh.data=8", "pipeline.schedule=1f1b"], "pipeline.schedule=1f1b needs mesh.pipeline > 1"),
    (["mesh.pipeline=2", "mesh.data=4", "pipeline.repeats=2", "pipeline.schedule=zero_bubble"],
     "pipeline.schedule=zero_bubble runs each stage's layers once: pipeline.repeats=2 needs pipeline.schedule=gpipe "
     "or interleaved_1f1b"),
    (["mesh.data=8", "pipeline.schedule=zero_bubble"], "pipeline.schedule=zero_bubble needs mesh.pipeline > 1"),
])
def test_a_schedule_that_cannot_run_the_layout_is_refused_before_compiling(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        abstract_program(config(*overrides))


def test_an_unknown_schedule_is_refused():
    with pytest.raises(ConfigError, match="pipeline.schedule"):
        config("pipeline.schedule=zero_bubble_v")

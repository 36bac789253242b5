"""Watching a run: TensorBoard events equal metrics.jsonl, profile.steps writes a trace,
summary.json accounts for the wall time across invocations (a preempted one included), and
`python -m ops.plot` draws a real PNG."""

from __future__ import annotations

import glob
import json
import os
import shutil
import signal

import jax
import numpy as np
import pytest

from conftest import ROOT, stdlib_glob
from configs import ConfigError, load_config
from bench.procs import Train

TINY = os.path.join(ROOT, "configs", "tiny.yaml")


def overrides(run_dir, *extra: str) -> list[str]:
    data = [f"data.path={stdlib_glob('email')}", "data.eval_fraction=0.3"]  # a held-out split for eval
    return [f"run.dir={run_dir}", *data, "train.log_every=1", *extra]


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """A run of 4 steps (trace of steps 2..3, eval every 2), then its last checkpoint removed
    and the run continued to 6 steps without eval: steps 3 and 4 run twice. On one device, for speed."""
    import trainer

    run_dir = tmp_path_factory.mktemp("observe") / "run"
    first = overrides(run_dir, "checkpoint.every=2", "eval.every=2", "eval.batches=1", "mesh.data=1")
    trainer.run(load_config(TINY, [*first, "train.steps=4", "profile.steps=[2,3]"]), jax.devices()[:1])
    shutil.rmtree(run_dir / "checkpoints" / "4")
    trainer.run(load_config(TINY, [*first, "train.steps=6", "eval.every=0"]), jax.devices()[:1])
    return run_dir


def metrics_lines(run_dir) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_tensorboard_events_hold_every_logged_scalar(resumed):
    from ops.observe import read_scalars

    lines = metrics_lines(resumed)
    scalars = read_scalars(os.path.join(resumed, "tb"))
    assert len(glob.glob(os.path.join(resumed, "tb", "events.out.tfevents.*"))) == 2, "one event file per invocation"
    keys = {k for line in lines for k in line} - {"step"}
    assert {"loss", "grad_norm", "eval_loss", "tokens_per_s"} <= keys
    assert set(scalars) == keys
    for key in keys:  # every value, in the order written (re-run steps twice), to float32 rounding
        expected = [(line["step"], np.float32(line[key])) for line in lines if key in line]
        assert [(s, np.float32(v)) for s, v in scalars[key]] == expected, key
    assert [s for s, _ in scalars["loss"]] == [1, 2, 3, 4, 3, 4, 5, 6]


def test_profile_steps_write_a_trace(resumed):
    traces = glob.glob(os.path.join(resumed, "profile", "**", "*.xplane.pb"), recursive=True)
    assert len(traces) == 1 and os.path.getsize(traces[0]) > 1000, "only the first invocation traces"


def test_summary_accounts_for_the_wall_time_of_each_invocation(resumed):
    with open(os.path.join(resumed, "summary.json")) as f:
        summary = json.load(f)
    first, second = summary["invocations"]
    assert (first["start_step"], first["end_step"], first["recomputed_steps"], first["outcome"]) == (0, 4, 0, "done")
    assert (second["start_step"], second["end_step"], second["recomputed_steps"]) == (2, 6, 2)
    for inv in (first, second):
        s = inv["seconds"]
        assert s["productive"] > 0 and s["compile"] > 0 and s["init"] > 0 and s["checkpoint"] > 0
        assert inv["goodput"] == pytest.approx(s["productive"] / inv["wall_s"])
    assert first["seconds"]["eval"] > 0 and second["seconds"]["eval"] == 0
    assert first["seconds"]["profile"] > 0 and first["seconds"]["recompute"] == 0
    assert second["seconds"]["recompute"] > 0
    assert summary["wall_s"] == pytest.approx(first["wall_s"] + second["wall_s"])
    assert summary["recomputed_steps"] == 2 and summary["final_step"] == summary["train_steps"] == 6
    last = [line for line in metrics_lines(resumed) if "loss" in line][-1]
    assert last["step"] == 6 and summary["final_loss"] == last["loss"]
    assert summary["eval_loss"] == [line for line in metrics_lines(resumed) if "eval_loss" in line][-1]["eval_loss"]
    assert summary["tokens_per_s"] > 0 and summary["mfu"] is None  # no known peak FLOP/s on CPU


# Seconds of sleep injected into each phase of a run, per call (calls per run in the comments);
# the totals differ, so time moved from one phase to another cannot pass for its own.
SLEEP = {"init": 0.2, "compile": 0.3, "first_execution": 0.45, "checkpoint": 0.2, "eval": 0.25, "data_wait": 0.15,
         "productive": 0.175}
CALLS = {"init": 1, "compile": 1, "first_execution": 1, "checkpoint": 2, "eval": 2, "data_wait": 4, "productive": 4}


def test_goodput_puts_time_spent_in_a_phase_into_that_phase(tmp_path, monkeypatch):
    """A known sleep inside each phase (distributed start-up, the compile, each save, each eval,
    each batch fetch, each step) shows up in that phase's seconds, and the phases together stay
    within the wall time measured outside the run: nothing is counted twice or in another phase."""
    import time

    import trainer
    import trainer.loop
    from sharding import distributed
    from trainer.checkpoint import Checkpointer
    from trainer.program import Program

    def slowed(fn, seconds: float, first: float = 0.0):
        calls = []

        def slow(*args, **kwargs):
            time.sleep(seconds + (first if not calls else 0.0))
            calls.append(1)
            return fn(*args, **kwargs)

        return slow

    def compile_then_slow_steps(self, state=None):
        time.sleep(SLEEP["compile"])
        step, secs = real_compile(self, state)
        return slowed(step, SLEEP["productive"], first=SLEEP["first_execution"]), secs

    def slow_batches(*args):
        for batch in real_batches(*args):
            time.sleep(SLEEP["data_wait"])
            yield batch

    real_compile, real_compile_eval, real_batches = Program.compile, Program.compile_eval, trainer.loop.global_batches
    monkeypatch.setattr(distributed, "initialize", slowed(distributed.initialize, SLEEP["init"]))
    monkeypatch.setattr(Program, "compile", compile_then_slow_steps)
    monkeypatch.setattr(Program, "compile_eval", lambda self: slowed(real_compile_eval(self), SLEEP["eval"]))
    monkeypatch.setattr(Checkpointer, "save", slowed(Checkpointer.save, SLEEP["checkpoint"]))
    monkeypatch.setattr(trainer.loop, "global_batches", slow_batches)
    run_dir = tmp_path / "run"
    cfg = load_config(TINY, overrides(run_dir, "mesh.data=1", "train.steps=4", "checkpoint.every=2", "eval.every=2",
                                      "eval.batches=1"))
    t0 = time.perf_counter()
    trainer.run(cfg, jax.devices()[:1])
    outside = time.perf_counter() - t0
    with open(run_dir / "summary.json") as f:
        (inv,) = json.load(f)["invocations"]
    seconds = inv["seconds"]
    for phase, sleep in SLEEP.items():
        assert seconds[phase] >= sleep * CALLS[phase], (phase, seconds)
    assert seconds["recompute"] == 0 and seconds["profile"] == 0
    # the first step's extra is not step time: tokens/s is over the steps at their steady cost
    assert inv["tokens_per_s"] == pytest.approx(inv["tokens"] / seconds["productive"])
    assert sum(seconds.values()) <= outside and inv["wall_s"] <= outside, (seconds, inv["wall_s"], outside)


def test_plot_writes_a_png_with_curves(resumed, tmp_path, capsys):
    from matplotlib.image import imread

    from ops import plot

    out = tmp_path / "curves.png"
    assert plot.main([str(resumed), "--out", str(out)]) == 0
    image = imread(out)  # RGBA floats in [0, 1]
    assert image.shape[0] >= 300 and image.shape[1] >= 500
    coloured = np.abs(image[..., 0] - image[..., 2]) > 0.2  # the curves are C0 blue; axes and text are grey
    assert coloured.mean() > 0.002, "no curve drawn"
    assert plot.main([str(tmp_path / "nothing"), "--out", str(tmp_path / "x.png")]) == 2
    assert not (tmp_path / "x.png").exists()


@pytest.mark.parametrize(
    "value, message",
    [
        ("[3,2]", "profile.steps: [3, 2] must satisfy 1 <= first <= last <= train.steps=50"),
        ("[0,2]", "profile.steps: [0, 2] must satisfy 1 <= first"),
        ("[5,60]", "<= train.steps=50"),
        ("[1,2,3]", "profile.steps: expected [first, last] (two steps), got [1, 2, 3]"),
        ("[a,b]", "profile.steps: expected a list of int, got ['a', 'b']"),
    ],
)
def test_bad_profile_steps(value, message):
    with pytest.raises(ConfigError) as e:
        load_config(TINY, [f"profile.steps={value}"])
    assert message in str(e.value)


def test_profile_steps_list_syntax():
    assert load_config(TINY, ["profile.steps=[2,4]"]).profile.steps == [2, 4]
    assert load_config(TINY, ["profile.steps=2,4"]).profile.steps == [2, 4]
    assert load_config(TINY, ["profile.steps=[]"]).profile.steps == []


def test_a_preempted_run_writes_its_summary(tmp_path):
    run = Train("--config", TINY, *overrides(tmp_path / "run", "train.steps=500", "checkpoint.every=1000"), devices=1)
    run.wait_for(r"^step +3/500")
    run.signal(signal.SIGTERM)
    assert run.finish(60) == 143, run.output
    with open(tmp_path / "run" / "summary.json") as f:
        summary = json.load(f)
    (inv,) = summary["invocations"]
    assert inv["outcome"] == "preempted" and inv["end_step"] == summary["final_step"] >= 3
    assert "summary: step" in run.output and "goodput" in run.output

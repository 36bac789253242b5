"""Issue 18's done-when run: `mesh.pipeline=4 pipeline.microbatches=16 pipeline.schedule=1f1b`
trains the tiny model on packed documents with GPipe's losses, and a checkpoint written under
1F1B resumes exactly. Four fake CPU devices (pipeline=4, one row per microbatch), all runs
shared by the module."""

from __future__ import annotations

import os
import string

import jax
import numpy as np
import pytest

import trainer
from configs import load_config
from conftest import ROOT, stopped_at
from trainer import abstract_program

STEPS, HALF = 4, 2
# A constant schedule makes the first HALF steps of a HALF-step and a STEPS-step run the same updates.
COMMON = ["mesh.pipeline=4", "mesh.data=1", "pipeline.microbatches=16", "train.global_batch=16",
          "data.packing=document", "optim.schedule=constant", "optim.warmup_steps=0", "train.log_every=1",
          f"checkpoint.every={HALF}"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """Per-step losses of gpipe, 1f1b and zero_bubble over STEPS, 1f1b resumed from its checkpoint at HALF, and each
    schedule's compiled temporaries per device. Short random documents: a row of 32 targets
    packs several, so microbatches hold different numbers of targets."""
    root = tmp_path_factory.mktemp("pipeline_train")
    rng = np.random.default_rng(0)
    letters = np.array(list(string.ascii_letters + " "))
    (root / "docs").mkdir()
    for i in range(300):
        (root / "docs" / f"{i:03d}.txt").write_text("".join(rng.choice(letters, rng.integers(2, 31))))
    devices = jax.devices()[:4]

    def cfg(schedule: str, steps: int, run_dir: str):
        return load_config(os.path.join(ROOT, "configs", "tiny.yaml"),
                           [f"data.path={root / 'docs' / '*.txt'}", *COMMON, f"pipeline.schedule={schedule}",
                            f"train.steps={steps}", f"run.dir={root / run_dir}"])

    def losses(history: list[dict]) -> list[float]:
        return [r["loss"] for r in history]

    compiled = {s: abstract_program(cfg(s, STEPS, "unused"), devices).compile()[0] for s in ("gpipe", "1f1b")}
    out = {"temps": {s: c.memory_analysis().temp_size_in_bytes for s, c in compiled.items()},
           "1f1b entry": entry_computation(compiled["1f1b"].as_text())}
    for schedule in ("gpipe", "1f1b", "zero_bubble"):
        out[schedule] = losses(trainer.run(cfg(schedule, STEPS, schedule), devices))
    # The straight 1F1B run's checkpoint at HALF (checkpoint.every), alone in a copy of its run
    # directory, resumed to STEPS: a run of its own to HALF would repeat those steps to write it.
    stopped_at(root / "1f1b", root / "resumed", HALF)
    out["second half"] = trainer.run(cfg("1f1b", STEPS, "resumed"), devices)
    return out


def entry_computation(hlo: str) -> str:
    """The ENTRY computation of an HLO module's text: what runs outside every loop."""
    start = hlo.index("\nENTRY ")
    return hlo[start:hlo.index("\n}", start)]


def test_no_collective_is_hoisted_out_of_the_pipeline_loops(runs):
    """XLA:CPU orders a device's collectives within a loop body, but not a collective hoisted out
    of a loop against the loop's own: the 1F1B step deadlocked (now and then, under load) with
    devices in a hoisted all-to-all of the targets while another entered the loop's all-reduce.
    Where the stack runs several CPU devices it keeps them in the loops (ops/xla_env.py,
    KEEP_COLLECTIVES_IN_LOOPS): the step's entry computation holds the loops and the gradient
    all-reduce after them, no all-to-all and no all-gather (with the pass on it held two of each)."""
    entry = runs["1f1b entry"]
    assert " while(" in entry and " all-reduce(" in entry, entry[:2000]
    assert " all-to-all(" not in entry and " all-gather(" not in entry, entry


def test_the_two_schedules_are_different_programs(runs):
    # GPipe keeps all 16 microbatches' activations for the backward, 1F1B at most 2S - 1 = 7 stage inputs.
    assert runs["temps"]["gpipe"] > 2 * runs["temps"]["1f1b"], runs["temps"]


@pytest.mark.parametrize("schedule", ["1f1b", "zero_bubble"])
def test_1f1b_trains_with_the_losses_of_gpipe(runs, schedule):
    assert len(runs["gpipe"]) == STEPS
    assert runs["gpipe"][-1] < runs["gpipe"][0] - 0.1, ("a comparison of flat curves proves nothing", runs["gpipe"])
    np.testing.assert_allclose(runs[schedule], runs["gpipe"], rtol=2e-5)


def test_a_1f1b_checkpoint_resumes_exactly(runs):
    assert [r["step"] for r in runs["second half"]] == list(range(HALF + 1, STEPS + 1))
    np.testing.assert_array_equal([r["loss"] for r in runs["second half"]], runs["1f1b"][HALF:])

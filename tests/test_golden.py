"""An absolute anchor: the first steps of the tiny preset on one CPU device reproduce stored values.

Every other numerical test compares two variants of our own code (layouts, resume, pipeline), so
a bug that every layout shares (a rotary sign, a norm epsilon, a loss term) passes them all. This
one compares the loss and gradient norm of steps 1..5 with tests/golden/tiny_steps.json, made from
a fixed text in the repository (tests/golden/corpus.txt: not the standard library, which differs
between Python versions) with concat packing and no gradient accumulation.

After a deliberate change of the numbers (not to make this test pass), regenerate from the
repository root and say why in the commit:

    python -m tests.test_golden
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
from importlib import metadata

import jax
import numpy as np

import trainer
from configs import load_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORPUS = os.path.join("tests", "golden", "corpus.txt")
GOLDEN = os.path.join(ROOT, "tests", "golden", "tiny_steps.json")
REGENERATE = "python -m tests.test_golden"
OVERRIDES = [
    "train.steps=5", "train.log_every=1", "train.grad_accum=1", "mesh.data=1", "data.packing=concat",
    "data.tokenizer=byte", "data.eval_fraction=0", "eval.every=0",
]
# Observed (relative): the same run on 1 CPU device and on 1 of 8 fake ones differs by at most
# 1 ulp (9e-8); a flipped rotary sign moves the losses by 5e-6 to 3e-5, the grad norms by 2e-5 to 2e-4.
RTOL = 2e-6
VERSIONED = ("jax", "jaxlib", "flax", "optax", "grain", "numpy")


def run_steps(devices: list, run_dir: str, extra: tuple[str, ...] = ()) -> dict:
    """The tiny preset with OVERRIDES (and `extra`) on `devices` (one), from scratch in `run_dir`."""
    overrides = [f"run.dir={run_dir}", f"data.path={os.path.join(ROOT, CORPUS)}", *OVERRIDES, *extra]
    history = trainer.run(load_config(os.path.join(ROOT, "configs", "tiny.yaml"), overrides), devices)
    logged = [r for r in history if "loss" in r]
    return {key: [r[key] for r in logged] for key in ("step", "loss", "grad_norm")}


def corpus_sha256() -> str:
    with open(os.path.join(ROOT, CORPUS), "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def test_the_first_steps_of_the_tiny_preset_match_the_golden_values(tmp_path):
    with open(GOLDEN) as f:
        golden = json.load(f)
    how = f"(made with {golden['versions']}); if the change is deliberate, regenerate: {REGENERATE}"
    assert golden["overrides"] == OVERRIDES and golden["corpus_sha256"] == corpus_sha256(), (
        f"the golden run's settings or corpus changed since {GOLDEN} was written {how}"
    )
    got = run_steps(jax.devices()[:1], str(tmp_path / "run"))
    assert got["step"] == golden["step"] == [1, 2, 3, 4, 5]
    for key in ("loss", "grad_norm"):
        np.testing.assert_allclose(
            got[key], golden[key], rtol=RTOL, atol=0, err_msg=f"{key} of steps 1..5 left the golden values {how}"
        )


def main() -> None:
    jax.config.update("jax_platforms", "cpu")  # the golden values are CPU float32
    with tempfile.TemporaryDirectory() as tmp:
        got = run_steps(jax.devices()[:1], os.path.join(tmp, "run"))
    golden = {
        "regenerate": REGENERATE,
        "overrides": OVERRIDES,
        "corpus_sha256": corpus_sha256(),
        "versions": {name: metadata.version(name) for name in VERSIONED} | {"python": sys.version.split()[0]},
        **got,
    }
    with open(GOLDEN, "w") as f:
        json.dump(golden, f, indent=1)
        f.write("\n")
    print(f"wrote {GOLDEN}: losses {got['loss']}")


if __name__ == "__main__":
    main()

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
import pytest

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


def layer_loops(*overrides: str) -> int:
    """How many loops the tiny preset's step on one CPU device lowers to."""
    cfg = load_config(os.path.join(ROOT, "configs", "tiny.yaml"), ["mesh.data=1", "data.source=synthetic", *overrides])
    return trainer.abstract_program(cfg, jax.devices()[:1]).lower().as_text().count("stablehlo.while")


def attention_dots(*overrides: str) -> int:
    """How many matmuls the tiny preset's step on one CPU device lowers to (XLA's own: the MKL
    kernel's are custom calls)."""
    cfg = load_config(os.path.join(ROOT, "configs", "tiny.yaml"),
                      ["mesh.data=1", "data.source=synthetic", "model.cpu_matmul=xla", *overrides])
    return trainer.abstract_program(cfg, jax.devices()[:1]).lower().as_text().count("stablehlo.dot_general")


def test_on_cpu_a_shallow_stack_is_unrolled_and_a_deep_one_scanned():
    assert layer_loops() == 0  # 4 layers, model.scan_unroll=0: unrolled on CPU
    assert layer_loops("model.scan_unroll=1") > 0  # the scan and its transpose
    assert layer_loops("model.num_layers=9") > 0  # deeper than trainer.layout.CPU_UNROLL_LAYERS


def test_query_blocks_lower_to_more_matmuls_than_one_block():
    # seq_len 32 is one block of the CPU's pick (trainer.layout.CPU_ATTENTION_BLOCK): the plain
    # kernel; blocks of 8 score 4 query blocks, each with its own matmuls.
    assert attention_dots("model.attention_block=8") > attention_dots()
    # Past one block the CPU's pick (model.attention_block=0) blocks by itself; one block overrides it.
    assert attention_dots("model.seq_len=128") > attention_dots("model.seq_len=128", "model.attention_block=128")


def merged_token_dots(*overrides: str) -> int:
    """How many matmuls of the tiny preset's compiled step on one CPU device contract the lhs's
    leading dim (a weight gradient over merged tokens, taken by the dot as it is laid out), with
    XLA's own matmuls (the MKL kernel reads its operands transposed in place)."""
    cfg = load_config(os.path.join(ROOT, "configs", "tiny.yaml"),
                      ["mesh.data=1", "data.source=synthetic", "model.cpu_matmul=xla", *overrides])
    compiled, _ = trainer.abstract_program(cfg, jax.devices()[:1]).compile()
    return compiled.as_text().count("lhs_contracting_dims={0}")


def test_on_cpu_the_weight_gradients_sum_over_merged_tokens():
    # model.flat_weight_grads=auto on CPU: every block weight gradient is one dot on the
    # activation as laid out (6 a layer: XLA merges k's and v's, which share their input); the
    # two-dim sums make XLA:CPU write the activation transposed first.
    layers = load_config(os.path.join(ROOT, "configs", "tiny.yaml")).model.num_layers
    assert merged_token_dots() >= 6 * layers
    assert merged_token_dots("model.flat_weight_grads=off") == 0


# Both ways of running the stack and of attending: the golden values are one computation,
# whatever the loop, whether the queries go in blocks (the sums skip only exact zeros), and
# whose matmuls multiply on CPU (the MKL kernel, the default on one CPU device, or XLA's; XLA's
# blocked attention equals its plain one in tests/test_model.py).
@pytest.mark.parametrize("extra", [(), ("model.scan_unroll=1",), ("model.attention_block=8",),
                                   ("model.flat_weight_grads=off",), ("train.batch_streams=2",),
                                   ("model.cpu_matmul=xla",)],
                         ids=["cpu-default-unrolled", "scanned", "query-blocked", "two-dim-weight-grads", "two-streams",
                              "xla-matmuls"])
def test_the_first_steps_of_the_tiny_preset_match_the_golden_values(tmp_path, extra):
    with open(GOLDEN) as f:
        golden = json.load(f)
    how = f"(made with {golden['versions']}); if the change is deliberate, regenerate: {REGENERATE}"
    assert golden["overrides"] == OVERRIDES and golden["corpus_sha256"] == corpus_sha256(), (
        f"the golden run's settings or corpus changed since {GOLDEN} was written {how}"
    )
    got = run_steps(jax.devices()[:1], str(tmp_path / "run"), extra)
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

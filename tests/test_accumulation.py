"""Every target token weighs the same, however the batch is cut: with document packing of short,
uneven documents the micro-batches hold different numbers of targets, and still `grad_accum` 1, 2
and 4 give the one-big-batch loss and gradients on one device, data and tensor parallel layouts
and a pipeline; the eval loss is the token-weighted mean over its batches."""

from __future__ import annotations

import os
import string

import jax
import numpy as np
import pytest

from configs import load_config
from conftest import ROOT
from data import open_source
from data.pipeline import eval_batches, process_dataset
from sharding import activation_rules
from ops.goodput import Goodput
from trainer.hooks import EvalHook
from ops.metrics import MetricsLogger
from trainer.program import abstract_program
from trainer.state import init_state
from trainer.objectives.lm import make_loss_fn
from trainer.step import accumulate

LAYOUTS = {
    "one device": ["mesh.data=1"],
    "data=8": ["mesh.data=8"],
    "data=2,fsdp=2,tensor=2, loss_chunk=8": ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", "model.loss_chunk=8"],
    "pipeline=2 x data=4": ["mesh.pipeline=2", "mesh.data=4", "pipeline.microbatches=2"],
}
# grad_accum=1 on one device is the reference; the layouts at grad_accum=1 on this corpus add
# little to tests/test_train.py and tests/test_pipeline.py, and each case is a compile.
CASES = [("one device", 2), ("one device", 4), ("data=8", 4), ("data=2,fsdp=2,tensor=2, loss_chunk=8", 2),
         ("pipeline=2 x data=4", 2), ("pipeline=2 x data=4", 4)]


@pytest.fixture(scope="module")
def short_docs(tmp_path_factory) -> str:
    """600 files of 2-30 random characters: a row of 32 targets packs several documents, each
    ending in a target that does not count, plus padding, so rows differ in their target counts."""
    root = tmp_path_factory.mktemp("short_docs")
    rng = np.random.default_rng(0)
    letters = np.array(list(string.ascii_letters + " "))
    for i in range(600):
        (root / f"{i:03d}.txt").write_text("".join(rng.choice(letters, rng.integers(2, 31))))
    return str(root / "*.txt")


def config(path: str, *overrides: str):
    base = [f"data.path={path}", "data.packing=document", "train.global_batch=32", "data.eval_fraction=0.3"]
    return load_config(os.path.join(ROOT, "configs", "tiny.yaml"), base + list(overrides))


def targets(batch: dict[str, np.ndarray]) -> np.ndarray:
    """[rows, seq_len]: 1 where a position's next token is a target of the same document."""
    seg = batch["segment_ids"]
    return (seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] != 0)


@pytest.fixture(scope="module")
def reference(short_docs):
    """The first global batch of the corpus, the initial parameters, and their loss and
    gradients in one batch on one device."""
    cfg = config(short_docs, "mesh.data=1")
    batch = process_dataset(open_source(cfg, cfg.train.objective), 32, cfg.run.seed, 0, 1)[0]
    program = abstract_program(cfg, jax.devices()[:1])
    params = jax.device_get(init_state(cfg.model, program.tx, 0, program.state_sh).params)
    return batch, params, loss_and_grads(cfg, batch, params, jax.devices()[:1])


def loss_and_grads(cfg, batch: dict, params: dict, devices: list | None = None) -> tuple[float, dict]:
    program = abstract_program(cfg, devices)
    params = jax.device_put(params, program.state_sh.params)
    batch = {k: jax.device_put(v, program.batch_sh) for k, v in batch.items()}
    loss_fn = make_loss_fn(program.spec.model.graphdef, program.compute)
    with activation_rules(program.mesh, program.spec.layout.act_rules):
        loss, grads = jax.jit(lambda p, b: accumulate(loss_fn, p, b, cfg.train.grad_accum))(params, batch)
    return float(loss), jax.tree.map(np.asarray, grads)


@pytest.mark.parametrize("layout,grad_accum", CASES)
def test_accumulation_weighs_every_token_the_same(short_docs, reference, layout, grad_accum):
    batch, params, (ref_loss, ref_grads) = reference
    # Micro-batch a takes rows a, a + k, ...: they must hold different numbers of targets, or
    # a mean of micro-batch means would pass as well.
    counts = [int(targets(batch)[a::grad_accum].sum()) for a in range(grad_accum)]
    assert grad_accum == 1 or len(set(counts)) > 1, counts
    cfg = config(short_docs, *LAYOUTS[layout], f"train.grad_accum={grad_accum}")
    devices = jax.devices()[:1] if layout == "one device" else None
    assert abstract_program(cfg, devices).spec.layout.pipelined == layout.startswith("pipeline")
    loss, grads = loss_and_grads(cfg, batch, params, devices)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    for (path, r), g in zip(jax.tree_util.tree_leaves_with_path(ref_grads), jax.tree.leaves(grads)):
        np.testing.assert_allclose(g, r, rtol=2e-4, atol=2e-6, err_msg=jax.tree_util.keystr(path))
    assert np.abs(ref_grads["embedding"]).max() > 0  # all-zero gradients would prove nothing


def test_eval_loss_is_the_token_weighted_mean(short_docs, tmp_path):
    cfg = config(short_docs, "mesh.data=2", "mesh.tensor=4", "eval.every=1", "eval.batches=3", f"run.dir={tmp_path}")
    source = open_source(cfg, cfg.train.objective)
    rows = eval_batches(source, 32, 3, cfg.run.seed, 0, 1)
    counts = [int(targets(r).sum()) for r in rows]
    assert len(set(counts)) > 1, counts  # else a mean of batch means would pass as well
    program = abstract_program(cfg)
    state = init_state(cfg.model, program.tx, 0, program.state_sh)
    logger = MetricsLogger(cfg, 0, 0.0, jax.devices())
    EvalHook(cfg, program, rows, logger, Goodput()).run(1, state, stopping=False)
    # The three batches as one batch of 96 rows, on one device: one sum over one count.
    together = {k: np.concatenate([r[k] for r in rows]) for k in rows[0]}
    total, count = jax.jit(make_loss_fn(program.spec.model.graphdef))(jax.device_get(state.params), together)
    assert int(count) == sum(counts)
    np.testing.assert_allclose(logger.history[-1]["eval_loss"], float(total) / float(count), rtol=2e-6)

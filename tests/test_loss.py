"""The output head and loss: the chunked head and loss (`model.loss_chunk`) give the same loss and
gradients as the whole-sequence one, with document masks and with the vocabulary sharded over
`tensor`; the head's backward computes its weight gradient with its input gradient."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from jax.extend import core as jcore

from conftest import ROOT, real_target_env
from sharding.hardware import HARDWARE
from planner.targets import has_compiler

from configs import ConfigError, load_config

from sharding import activation_rules
from trainer.program import abstract_program
from trainer.state import init_state
from trainer.objectives.lm import make_loss_fn
from trainer.step import accumulate


def _loss_and_grads(cfg, batch, chunk):
    program = abstract_program(cfg)
    params = init_state(cfg.model, program.tx, 0, program.state_sh).params
    loss_fn = make_loss_fn(program.spec.model.graphdef, dataclasses.replace(program.compute, loss_chunk=chunk))
    batch = {k: jax.device_put(v, program.batch_sh) for k, v in batch.items()}
    with activation_rules(program.mesh, program.spec.layout.act_rules):
        loss, grads = jax.jit(lambda p, b: accumulate(loss_fn, p, b, 1))(params, batch)
    return float(loss), jax.tree.map(np.asarray, grads)


@pytest.mark.parametrize("documents", [False, True])
def test_chunked_loss_equals_the_whole_one(tiny, documents):
    cfg = tiny("mesh.data=2", "mesh.tensor=4")  # the vocabulary is sharded four ways
    rng = np.random.default_rng(0)
    batch = {"tokens": rng.integers(0, 257, (16, 33)).astype(np.int32)}
    if documents:
        cut = rng.integers(1, 32, 16)[:, None]
        batch["segment_ids"] = np.where(np.arange(33) < cut, 1, 2).astype(np.int32)
        batch["positions"] = np.where(np.arange(33) < cut, np.arange(33), np.arange(33) - cut).astype(np.int32)
    whole, whole_grads = _loss_and_grads(cfg, batch, 0)
    chunked, chunked_grads = _loss_and_grads(cfg, batch, 8)
    np.testing.assert_allclose(chunked, whole, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-7), chunked_grads, whole_grads)
    assert np.abs(whole_grads["embedding"]).max() > 0  # gradients that are all zero would prove nothing


def test_a_chunk_must_divide_the_sequence(tiny):
    with pytest.raises(ConfigError, match="model.loss_chunk: 5 must be 0"):
        tiny("model.loss_chunk=5")


def _barrier_shapes(jaxpr: jcore.Jaxpr) -> list[list[tuple[int, ...]]]:
    """The operand shapes of every optimization_barrier in `jaxpr` and the jaxprs inside it."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "optimization_barrier":
            found.append([tuple(v.aval.shape) for v in eqn.invars])
        for sub in jcore.jaxprs_in_params(eqn.params):
            found += _barrier_shapes(sub)
    return found


@pytest.mark.real_target
def test_a_tied_tables_gradient_is_reduced_once(tmp_path):
    """A tied table's gradient has two parts, the head's and the lookup's. libtpu's program for 8
    v5p chips on data=8 reduces the bf16 gradients of every matrix once (the norms' scales are
    reduced in float32): its bf16 all-reduces hold 2 bytes per matrix parameter, the table counted once (ordering the head's part first, as an
    untied head's is, made libtpu reduce the table twice: 1.12x)."""
    if not has_compiler(HARDWARE["tpu-v5p"]):
        pytest.skip("tpu-v5p's compiler is not installed (make compilers)")
    small = ["model.num_layers=2", "model.d_model=512", "model.num_heads=4", "model.num_kv_heads=2",
             "model.d_ff=1024", "model.vocab_size=1024", "model.seq_len=256", "model.attention=xla"]
    done = subprocess.run([sys.executable, "plan.py", "--config", os.path.join(ROOT, "configs", "llama3-1b.yaml"),
                           "--devices", "8", "--hardware", "tpu-v5p", "--out", str(tmp_path / "plan.json"),
                           "mesh.data=8", "train.global_batch=8", *small],
                          cwd=ROOT, env=real_target_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    plan = json.loads((tmp_path / "plan.json").read_text())["plans"][0]
    reduced = sum(c["by_dtype"].get("bf16", 0) for c in plan["collectives"] if c["kind"] == "all-reduce")
    cfg = load_config(os.path.join(ROOT, "configs", "llama3-1b.yaml"), ["train.global_batch=8", *small])
    assert cfg.model.tie_embeddings
    params = abstract_program(cfg).abstract_state().params
    leaves = jax.tree_util.tree_leaves_with_path(params)
    matrices = sum(int(np.prod(a.shape)) for path, a in leaves if "norm" not in jax.tree_util.keystr(path))
    assert reduced == 2 * matrices, (reduced, 2 * matrices)


@pytest.mark.parametrize("tied, chunk", [(True, 0), (False, 0), (False, 8)])
def test_the_head_weight_gradient_is_computed_with_its_input_gradient(tiny, tied, chunk):
    """The whole-sequence output head's backward ties its weight gradient to its input gradient:
    libtpu otherwise schedules that [embed, vocab] matmul after the layers' whole backward pass,
    and the logits' gradient it reads, [batch, length, vocab], stays alive through it. The
    chunked loss leaves them untied: tying them there costs memory. So does a tied embedding
    table, whose two gradients are then reduced over the batch apart (the next test)."""
    cfg = tiny(f"model.tie_embeddings={str(tied).lower()}")
    program = abstract_program(cfg)
    loss_fn = make_loss_fn(program.spec.model.graphdef, dataclasses.replace(program.compute, loss_chunk=chunk))
    params = program.abstract_state().params
    batch = {"tokens": jax.ShapeDtypeStruct((2, cfg.model.seq_len + 1), np.int32)}
    with activation_rules(program.mesh, program.spec.layout.act_rules):
        jaxpr = jax.make_jaxpr(lambda p, b: accumulate(loss_fn, p, b, 1))(params, batch).jaxpr
    m = cfg.model
    head = (m.vocab_size, m.d_model) if tied else (m.d_model, m.vocab_size)
    length = chunk or m.seq_len
    assert ([(2, length, m.d_model), head] in _barrier_shapes(jaxpr)) == (chunk == 0 and not tied)


def test_the_head_writes_logits_in_model_logits_dtype_and_the_loss_reads_either(tiny):
    """A bf16 model's head writes bf16 logits by default (`model.logits_dtype=compute`: no float32
    [batch, length, vocab] array for the loss to hold) and float32 ones when asked; the loss
    upcasts either and takes the targets' logits by a gather or a masked sum with the same values
    and, to float32 rounding, the same gradients."""
    from flax import nnx

    from model.loss import cross_entropy_sum

    rng = np.random.default_rng(0)
    tokens = jax.numpy.asarray(rng.integers(0, 257, (2, 32)), jax.numpy.int32)
    logits = {}
    for dtype in ("compute", "float32"):
        cfg = tiny("model.dtype=bfloat16", f"model.logits_dtype={dtype}")
        program = abstract_program(cfg)
        model = nnx.merge(program.spec.model.graphdef, init_state(cfg.model, program.tx, 0, None).params)
        logits[dtype] = model(tokens)
    assert logits["compute"].dtype == jax.numpy.bfloat16 and logits["float32"].dtype == jax.numpy.float32
    # The same head, rounded once more: bf16's 8 bits of mantissa apart, not more.
    np.testing.assert_allclose(np.asarray(logits["compute"], np.float32), logits["float32"], rtol=1 / 128, atol=1e-2)
    assert not np.array_equal(np.asarray(logits["compute"], np.float32), logits["float32"])

    targets = tokens[:, 1:].astype(jax.numpy.int32)
    weights = jax.numpy.asarray(rng.integers(0, 2, targets.shape), jax.numpy.float32)
    for x in logits.values():
        x = x[:, :-1]
        gathered = jax.value_and_grad(lambda l: cross_entropy_sum(l.astype(jax.numpy.float32), targets, weights, True))(x)
        masked = jax.value_and_grad(lambda l: cross_entropy_sum(l.astype(jax.numpy.float32), targets, weights, False))(x)
        auto = jax.value_and_grad(lambda l: cross_entropy_sum(l, targets, weights))(x)
        assert float(gathered[0]) == float(masked[0]) == float(auto[0])
        np.testing.assert_allclose(masked[1].astype(np.float32), gathered[1].astype(np.float32), rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(auto[1].astype(np.float32), gathered[1].astype(np.float32), rtol=1e-6, atol=1e-7)
        assert np.abs(np.asarray(gathered[1], np.float32)).max() > 0

"""The optimizers of `optim.name` (trainer/optimizer.py): each trains the tiny model and
resumes bitwise exactly on a sharded layout; the weight-decay mask, Muon's two parameter groups
and clipping apply to each; their state shards like AdamW's."""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import trainer
from configs import load_config
from conftest import stopped_at
from sharding import shardings
from sharding.mesh import make_mesh
from sharding.rules import to_rules
from trainer.optimizer import make_optimizer, muon_dims
from trainer.state import abstract_model, state_shardings

NAMES = ("adamw", "muon", "adafactor", "lion")
# A rate each learns with in a few steps (adafactor's is relative to the parameters' RMS, lion's
# sign steps want a smaller one): docs/training.md's advice.
LR = {"adamw": "3e-3", "muon": "3e-3", "adafactor": "1e-2", "lion": "3e-4"}


@pytest.mark.parametrize("name", [n for n in NAMES if n != "adamw"])  # adamw: tests/test_train.py
def test_each_optimizer_learns_and_resumes_exactly(tiny, tmp_path, name):
    """6 steps saved at 3 and 6; the step-3 checkpoint (a copy of the run dir without step 6)
    resumed gives steps 4-6 bit for bit (5 and 6 read the restored optimizer state)."""
    common = [f"optim.name={name}", f"optim.lr={LR[name]}", "optim.schedule=constant", "optim.warmup_steps=0",
              "checkpoint.every=3", "mesh.data=2", "mesh.fsdp=4", "train.steps=6"]
    straight = [r["loss"] for r in trainer.run(tiny(*common, f"run.dir={tmp_path / 'straight'}"))]
    assert straight[-1] < straight[0] - 0.1, straight
    resumed = stopped_at(tmp_path / "straight", tmp_path / "resumed", 3)
    second = trainer.run(tiny(*common, f"run.dir={resumed}"))
    assert [r["step"] for r in second] == [4, 5, 6]
    np.testing.assert_array_equal([r["loss"] for r in second], straight[3:])


def _setup(name: str, *overrides: str) -> tuple:
    cfg = load_config("tiny", [f"optim.name={name}", "optim.warmup_steps=0", "optim.schedule=constant", *overrides])
    _, shapes, axes = abstract_model(cfg.model)
    params = jax.tree.map(lambda s: jnp.full(s.shape, 0.5, s.dtype), shapes)
    return cfg, axes, params


@pytest.mark.parametrize("name", NAMES)
def test_weight_decay_reaches_matrices_only_at_each_groups_rate(name):
    """With zero gradients only the decoupled decay moves a parameter: -lr x decay x param on
    matrices (Muon's at optim.muon_lr, the rest at optim.lr), nothing on norm scales."""
    cfg, axes, params = _setup(name, "optim.lr=0.01", "optim.muon_lr=0.05", "optim.weight_decay=0.1")
    tx, _ = make_optimizer(cfg.optim, 10, axes)
    updates, _ = jax.jit(lambda p: tx.update(jax.tree.map(jnp.zeros_like, p), tx.init(p), p))(params)
    flat_axes = jax.tree.leaves(axes, is_leaf=lambda x: isinstance(x, tuple))
    groups = set()
    for names, u in zip(flat_axes, jax.tree.leaves(updates)):
        matrix = len([n for n in names if n != "layers"]) >= 2
        lr = 0.05 if name == "muon" and muon_dims(names) else 0.01
        groups.add(lr)
        np.testing.assert_allclose(np.asarray(u), -lr * 0.1 * 0.5 if matrix else 0.0, rtol=1e-6, err_msg=str(names))
    assert groups == ({0.05, 0.01} if name == "muon" else {0.01})


@pytest.mark.parametrize("name", NAMES)
def test_clipping_applies_before_each_optimizer(name):
    """Two steps with a clipped first gradient equal the unclipped optimizer fed the clipped
    gradient, and differ from it fed the raw one (every optimizer here is scale-free in one
    step, so the check needs the second)."""
    cfg, axes, params = _setup(name, "optim.clip=1.0", "optim.weight_decay=0")
    unclipped_cfg, _, _ = _setup(name, "optim.clip=0", "optim.weight_decay=0")
    keys = iter(jax.random.split(jax.random.key(0), 2))
    grads = [jax.tree.map(lambda p, k=next(keys): jax.random.normal(k, p.shape) * scale, params)
             for scale in (100.0, 1e-4)]
    assert float(optax.tree.norm(grads[0])) > 10 and float(optax.tree.norm(grads[1])) < 1

    def two_steps(tx: optax.GradientTransformation):  # noqa: ANN202 (a jitted function)
        def steps(p: dict, gs: list) -> list:
            state = tx.init(p)
            for g in gs:
                u, state = tx.update(g, state, p)
                p = optax.apply_updates(p, u)
            return jax.tree.leaves(p)

        return jax.jit(steps)

    clipped_tx, _ = make_optimizer(cfg.optim, 10, axes)
    plain_tx, _ = make_optimizer(unclipped_cfg.optim, 10, axes)
    plain = two_steps(plain_tx)  # one compile for both of its gradient lists
    pre_clipped = [jax.tree.map(lambda g: g / optax.tree.norm(grads[0]), grads[0]), grads[1]]
    got = two_steps(clipped_tx)(params, grads)
    for a, b in zip(got, plain(params, pre_clipped)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    assert any(not np.allclose(a, b, rtol=1e-3) for a, b in zip(got, plain(params, grads)))


@pytest.mark.parametrize("name,sharded", [("adamw", 22), ("muon", 15), ("adafactor", 11), ("lion", 11)])
def test_optimizer_state_shards_like_the_parameters(name, sharded):
    """On data=2 x fsdp=4 every moment shaped like its parameter takes the parameter's sharding
    (AdamW: mu and nu of 11 parameters, all sharded but the 0-dim count; Muon: mu of its 7 block
    matrices, mu and nu of the other 4; lion: mu; adafactor: the unfactored second moments);
    adafactor's factored row/column statistics are replicated."""
    cfg = load_config("tiny", [f"optim.name={name}"])
    _, shapes, axes = abstract_model(cfg.model)
    tx, _ = make_optimizer(cfg.optim, 10, axes)
    mesh = make_mesh({"pipeline": 1, "data": 2, "fsdp": 4, "expert": 1, "context": 1, "tensor": 1}, jax.devices()[:8])
    param_sh = shardings(axes, to_rules(cfg.sharding.params), mesh)
    state = state_shardings(tx, shapes, param_sh, mesh)
    opt_shapes = jax.eval_shape(tx.init, shapes)
    specs = [s.spec for s in jax.tree.leaves(state.opt_state)]
    assert sum(spec != jax.sharding.PartitionSpec() for spec in specs) == sharded
    for leaf, sh in zip(jax.tree.leaves(opt_shapes), jax.tree.leaves(state.opt_state)):
        assert len(sh.spec) <= len(leaf.shape)  # a sharding that fits its array

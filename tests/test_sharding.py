"""Mesh and rules: every parameter and optimizer moment is sharded as the rules say, the
layouts really differ, nothing drifts after a step, and impossible layouts fail clearly."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from configs import ConfigError, load_config

from sharding import activation_rules, make_mesh, resolve_mesh_shape, shardings, to_rules
from trainer.optimizer import make_optimizer
from trainer.program import abstract_program
from trainer.state import abstract_model, init_state, state_shardings

LAYOUTS = {
    "data=8": dict(data=8),
    "fsdp=8": dict(data=1, fsdp=8),
    "data=2,fsdp=2,tensor=2": dict(data=2, fsdp=2, tensor=2),
    "fsdp=2,tensor=4": dict(data=1, fsdp=2, tensor=4),
}


def mesh_cfg(*overrides: str, **sizes: int):
    return load_config("tiny", [f"mesh.{k}={v}" for k, v in sizes.items()] + list(overrides))


def test_minus_one_fills_the_rest():
    assert resolve_mesh_shape(mesh_cfg(data=-1, tensor=2).mesh, 8) == dict(pipeline=1, data=4, fsdp=1, expert=1, context=1, tensor=2)


@pytest.mark.parametrize(
    "sizes, message",
    [
        (dict(data=3), "mesh: pipeline=1 x data=3 x fsdp=1 x expert=1 x context=1 x tensor=1 = 3 devices, but 8 are available"),
        (dict(data=-1, fsdp=3), "mesh.data=-1: the other axes' product 3 does not divide the 8 devices"),
        (dict(data=-1, fsdp=-1), "only one axis may be -1"),
        (dict(data=0), "mesh.data: must be a positive size or -1"),
    ],
)
def test_impossible_meshes(sizes, message):
    with pytest.raises(ConfigError) as err:
        resolve_mesh_shape(mesh_cfg(**sizes).mesh, 8)
    assert message in str(err.value)


def build(layout: dict):
    return build_cfg(mesh_cfg(**layout))


def build_cfg(cfg):
    mesh = make_mesh(resolve_mesh_shape(cfg.mesh, 8))
    graphdef, shapes, axes = abstract_model(cfg.model)
    tx, schedule = make_optimizer(cfg.optim, 10, axes)
    sh = state_shardings(tx, shapes, shardings(axes, to_rules(cfg.sharding.params), mesh), mesh)
    return cfg, mesh, graphdef, tx, schedule, sh


@pytest.fixture(scope="module")
def states():
    out = {}
    for name, layout in LAYOUTS.items():
        cfg, mesh, graphdef, tx, schedule, sh = build(layout)
        out[name] = (init_state(cfg.model, tx, 0, sh), mesh)
    return out


# What the default rules must give, written out by hand: (layers, embed, heads, head_dim) etc.
EXPECTED = {
    "fsdp=2,tensor=4": {
        "embedding": P("tensor", "fsdp"),
        ("layers", "attn", "q"): P("pipeline", "fsdp", "tensor", None),
        ("layers", "attn", "k"): P("pipeline", "fsdp", "tensor", None),
        ("layers", "attn", "o"): P("pipeline", "tensor", None, "fsdp"),
        ("layers", "mlp", "gate"): P("pipeline", "fsdp", "tensor"),
        ("layers", "mlp", "down"): P("pipeline", "tensor", "fsdp"),
        ("layers", "attn_norm", "scale"): P("pipeline", None),  # a norm's scale is replicated: no gathers
        ("final_norm", "scale"): P(None),
    },
    "data=8": {
        "embedding": P("tensor", "fsdp"),  # both axes of size 1: effectively replicated
        ("layers", "mlp", "gate"): P("pipeline", "fsdp", "tensor"),
    },
}


def _get(tree, key):
    for k in key if isinstance(key, tuple) else (key,):
        tree = tree[k]
    return tree


@pytest.mark.parametrize("layout", list(EXPECTED))
def test_parameters_and_moments_are_sharded_as_the_rules_say(states, layout):
    state, mesh = states[layout]
    for key, spec in EXPECTED[layout].items():
        param = _get(state.params, key)
        assert param.sharding.spec == spec, key
        assert param.sharding.mesh.shape == mesh.shape
        adam = state.opt_state[1][0]  # chain(clip, adamw) -> adamw's ScaleByAdamState
        assert _get(adam.mu, key).sharding.spec == spec
        assert _get(adam.nu, key).sharding.spec == spec
    assert state.step.sharding.spec == P()


def test_layouts_really_differ(states):
    """Per-device shard shapes of the same parameter differ between layouts."""
    shard_shapes = {
        name: tuple(x.addressable_shards[0].data.shape for x in jax.tree.leaves(state.params))
        for name, (state, _) in states.items()
    }
    assert len(set(shard_shapes.values())) == len(LAYOUTS), shard_shapes


def test_fsdp_splits_parameter_memory(states):
    def per_device_bytes(state):
        return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(state))

    full = per_device_bytes(states["data=8"][0])
    assert per_device_bytes(states["fsdp=8"][0]) < full / 4


def _two_steps(step, program, state) -> list:
    """The state's shardings (params, Adam mu, Adam nu: lists of leaves) after each of two real steps."""
    tokens = np.random.RandomState(0).randint(0, 256, (2, 16, program.spec.cfg.model.seq_len + 1)).astype(np.int32)
    after = []
    with activation_rules(program.mesh, program.spec.layout.act_rules):
        for rows in tokens:
            state, _ = step(state, {"tokens": jax.device_put(rows, program.batch_sh)})
            adam = state.opt_state[1][0]  # chain(clip, adamw) -> adamw's ScaleByAdamState
            after.append([[x.sharding for x in jax.tree.leaves(tree)] for tree in (state.params, adam.mu, adam.nu)])
    return after


def test_shardings_neither_drift_nor_recompile_over_two_steps():
    """The trainer's jitted step, run twice: it compiles once, and after each step every
    parameter and Adam moment has exactly the sharding the rules give its logical names. The
    same step jitted without pinned shardings hands back shardings spelled otherwise (the
    size-1 `pipeline` axis dropped) and compiles again on step 2, so both checks can fail."""
    cfg = mesh_cfg(**LAYOUTS["data=2,fsdp=2,tensor=2"])  # the shardings, not the layer loop
    program = abstract_program(cfg)
    _, _, axes = abstract_model(cfg.model)
    expected = jax.tree.leaves(shardings(axes, to_rules(cfg.sharding.params), program.mesh))
    assert len({sh.spec for sh in expected}) > 3, "the rules must really shard the parameters in several ways"

    for after in _two_steps(program.step, program, init_state(cfg.model, program.tx, 0, program.state_sh)):
        assert after == [expected] * 3
    assert program.step._cache_size() == 1, "the second step must reuse the first step's executable"

    unpinned = jax.jit(program.step.__wrapped__, donate_argnums=0)  # the same step function, nothing pinned
    first, _ = _two_steps(unpinned, program, init_state(cfg.model, program.tx, 0, program.state_sh))
    assert first[0] != expected and unpinned._cache_size() == 2


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["model.d_ff=100", "mesh.data=1", "mesh.tensor=8"], "model.d_ff=100 is not divisible by 8"),
        (["model.vocab_size=260", "mesh.data=1", "mesh.tensor=8"], "model.vocab_size=260 is not divisible by 8"),
        # kv heads divide heads, so heads alone can only fail when kv heads are not sharded.
        (["model.num_heads=12", "model.num_kv_heads=4", "sharding.params.kv_heads=null", "mesh.data=1", "mesh.tensor=8"],
         "model.num_heads=12 is not divisible by 8"),
        (["model.num_kv_heads=2", "mesh.data=1", "mesh.tensor=8"], "model.num_kv_heads=2 is not divisible by 8"),
        (["model.d_model=68", "model.head_dim=4", "mesh.data=1", "mesh.fsdp=8"], "model.d_model=68 is not divisible by 8"),
    ],
)
def test_dims_that_do_not_split_evenly_name_the_key(overrides, message):
    from trainer.checks import check_divisible

    cfg = load_config("tiny", overrides)
    _, shapes, axes = abstract_model(cfg.model)
    with pytest.raises(ConfigError) as err:
        check_divisible(shapes, axes, to_rules(cfg.sharding.params), resolve_mesh_shape(cfg.mesh, 8))
    assert message in str(err.value)


def test_moe_parameters_are_sharded_as_the_rules_say():
    """Expert weights split their `expert` dim over the expert axis, besides FSDP and tensor;
    the router keeps its expert dim whole. Every parameter has the sharding of its names."""
    cfg = load_config("tiny", ["mesh.data=1", "mesh.expert=2", "mesh.fsdp=2", "mesh.tensor=2",
                               "model.moe.num_experts=4", "model.moe.shared_experts=1"])
    cfg, mesh, graphdef, tx, schedule, sh = build_cfg(cfg)
    state = init_state(cfg.model, tx, 0, sh)
    expected = {
        ("layers", "mlp", "gate"): P("pipeline", "expert", "fsdp", "tensor"),
        ("layers", "mlp", "up"): P("pipeline", "expert", "fsdp", "tensor"),
        ("layers", "mlp", "down"): P("pipeline", "expert", "tensor", "fsdp"),
        ("layers", "mlp", "router"): P("pipeline", "fsdp", None),
        ("layers", "mlp", "shared", "gate"): P("pipeline", "fsdp", "tensor"),
    }
    for key, spec in expected.items():
        assert _get(state.params, key).sharding.spec == spec, key
        assert _get(state.opt_state[1][0].mu, key).sharding.spec == spec, key
    _, _, axes = abstract_model(cfg.model)
    rules = to_rules(cfg.sharding.params)
    for leaf, names in zip(jax.tree.leaves(state.params), jax.tree.leaves(axes, is_leaf=lambda x: isinstance(x, tuple))):
        assert leaf.sharding.spec == shardings(names, rules, mesh).spec
    assert _get(state.params, ("layers", "mlp", "gate")).addressable_shards[0].data.shape == (4, 2, 32, 64)

"""Mixture of experts on 8 fake devices: the same losses, router statistics and gradients on one
device as under expert parallelism (alone, with FSDP and tensor, with a pipeline), all-to-alls in
the compiled expert-parallel step, the layer against a dense reference (outputs and gradients
through the router, both routers), the megablox grouped-matmul kernel (interpreted) against
ragged_dot, capacity mode dropping exactly the over-capacity tokens,
the load-balancing loss falling when a router learns on a skewed batch, and checkpoints moving
between expert layouts."""

from __future__ import annotations

import functools
import types
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

import hf as hf_cli
import trainer
from configs import load_config
from conftest import ROOT, stopped_at
from test_context import initial_params
from configs import ConfigError
from model.kernels import Experts
from model.moe import MoE, expert_rows, local_dispatch, megablox_matmul
from model.router import STATS, router_stats
from sharding import activation_rules, make_mesh, resolve_mesh_shape, to_rules
from sharding.experts import expert_parallel
from planner.compiled import collective_counts
from trainer import abstract_program
from trainer.checks import check_devices
from trainer.kernels import grouped_matmul
from trainer.layout import plan_layout
from trainer.objectives.lm import make_loss_fn
from trainer.step import accumulate_stats

TINY = os.path.join(ROOT, "configs", "tiny.yaml")
MOE = ["model.num_layers=2", "model.moe.num_experts=8", "model.moe.experts_per_token=2", "model.moe.d_ff=32",
       "model.moe.shared_experts=1", "data.source=synthetic"]
LAYOUTS = {
    "expert=8": ["mesh.data=1", "mesh.expert=8"],
    "fsdp=8 (one expert shard: each device dispatches its own tokens)": ["mesh.data=1", "mesh.fsdp=8"],
    "expert=2 x fsdp=2 x tensor=2": ["mesh.data=1", "mesh.expert=2", "mesh.fsdp=2", "mesh.tensor=2"],
    # Only the routed rows move (the exchange emulated on CPU devices, tests/test_moe_ragged.py).
    "expert=4 x data=2, ragged dispatch": ["mesh.data=2", "mesh.expert=4", "model.moe.dispatch=ragged"],
    # Pipeline microbatches see their own router statistics: the reference accumulates the same split.
    "expert=2 x pipeline=2 x data=2": ["mesh.data=2", "mesh.expert=2", "mesh.pipeline=2", "pipeline.microbatches=2"],
}


def config(*overrides: str):
    return load_config(TINY, [*MOE, *overrides])


def step_outputs(cfg, devices=None) -> dict:
    """Loss, MoE statistics and gradients of one batch under cfg's layout, and the compiled HLO."""
    program = abstract_program(cfg, devices)
    params = initial_params(program)
    tokens = np.asarray(jax.random.randint(jax.random.key(7), (16, cfg.model.seq_len + 1), 0, 257))
    batch = {"tokens": jax.device_put(tokens, program.batch_sh)}
    loss_fn = make_loss_fn(program.spec.model.graphdef, program.compute, model_terms=True)
    fn = jax.jit(lambda p, b: accumulate_stats(loss_fn, p, b, cfg.train.grad_accum, program.compute.grad_fn))
    with activation_rules(program.mesh, program.spec.layout.act_rules):
        compiled = fn.lower(params, batch).compile()
    loss, grads, (count, stats) = compiled(params, batch)
    gate = params["layers"]["mlp"]["gate"]
    return {"loss": float(loss), "stats": np.asarray(stats) / float(count), "grads": jax.tree.map(np.asarray, grads),
            "hlo": compiled.as_text(), "shard": gate.addressable_shards[0].data.shape, "sizes": program.spec.layout.sizes}


@pytest.fixture(scope="module")
def reference():
    return step_outputs(config("mesh.data=1"), jax.devices()[:1])


@pytest.fixture(scope="module")
def reference_accumulated():
    return step_outputs(config("mesh.data=1", "train.grad_accum=2"), jax.devices()[:1])


@pytest.fixture(scope="module")
def expert8():
    return step_outputs(config(*LAYOUTS["expert=8"]))


def _compare(got: dict, ref: dict) -> None:
    assert got["sizes"] != ref["sizes"] and got["shard"] != ref["shard"], "the layouts must really differ"
    np.testing.assert_allclose(got["loss"], ref["loss"], rtol=1e-6)
    np.testing.assert_allclose(got["stats"], ref["stats"], rtol=1e-5)
    flat_ref = jax.tree_util.tree_leaves_with_path(ref["grads"])
    for (path, r), g in zip(flat_ref, jax.tree.leaves(got["grads"])):
        np.testing.assert_allclose(g, r, rtol=2e-4, atol=2e-6, err_msg=jax.tree_util.keystr(path))
    assert (np.abs(got["grads"]["layers"]["mlp"]["router"]).sum(axis=(1, 2)) > 0).all()


def test_expert8_equals_one_device(reference, expert8):
    lm_loss, aux, z, dropped, imbalance = reference["stats"]  # model.terms MOE_METRICS
    assert aux > 1.0 and imbalance > 1.0 and z > 0 and lm_loss < reference["loss"]  # a real routing
    assert dropped == 0.0  # dropless
    _compare(expert8, reference)


@pytest.mark.parametrize("layout", ["expert=2 x fsdp=2 x tensor=2", "fsdp=8 (one expert shard: each device dispatches its own tokens)",
                                    "expert=4 x data=2, ragged dispatch"])
def test_expert_fsdp_tensor_equals_one_device(reference, layout):
    _compare(step_outputs(config(*LAYOUTS[layout])), reference)


def test_expert_pipeline_data_equals_one_device_accumulating(reference, reference_accumulated):
    assert reference_accumulated["stats"][1] != reference["stats"][1]  # microbatches' aux losses differ
    _compare(step_outputs(config(*LAYOUTS["expert=2 x pipeline=2 x data=2"])), reference_accumulated)


def test_the_expert_parallel_step_holds_all_to_alls(reference, expert8):
    assert collective_counts(reference["hlo"])["all-to-all"] == 0
    # Rows there, their expert ids there, outputs back; the backward pass sends the gradients
    # both ways (the ids have none).
    assert collective_counts(expert8["hlo"])["all-to-all"] >= 5


# --- the layer alone -------------------------------------------------------------------------


def _layer(router: str, **moe) -> MoE:
    cfg = load_config(TINY, ["model.d_model=16", "model.moe.num_experts=4", "model.moe.d_ff=8",
                             f"model.moe.router={router}", *[f"model.moe.{k}={v}" for k, v in moe.items()]]).model
    return MoE(cfg, rngs=nnx.Rngs(3))


def _dense_reference(params: dict, x: jax.Array, router: str, k: int, renormalize: bool) -> jax.Array:
    """Every expert on every token, weighted by a top-k mask: no sorting, no grouped matmuls."""
    logits = jnp.einsum("bld,de->ble", x, params["router"])
    kth = jnp.sort(logits, axis=-1)[..., -k][..., None]
    chosen = logits >= kth
    if router == "softmax_topk":
        w = jax.nn.softmax(jnp.where(chosen, logits, -jnp.inf), axis=-1)
    else:
        w = jnp.where(chosen, jax.nn.softmax(logits, axis=-1), 0.0)
        w = w / w.sum(-1, keepdims=True) if renormalize else w
    h = jax.nn.silu(jnp.einsum("bld,edf->blef", x, params["gate"])) * jnp.einsum("bld,edf->blef", x, params["up"])
    return jnp.einsum("blef,efd,ble->bld", h, params["down"], w)


@pytest.mark.parametrize("router, renormalize", [("softmax_topk", True), ("topk_softmax", True), ("topk_softmax", False)])
def test_layer_and_router_gradients_equal_a_dense_reference(router, renormalize):
    layer = _layer(router, renormalize=str(renormalize).lower())
    graphdef, state = nnx.split(layer)
    params = nnx.to_pure_dict(state)
    x = jax.random.normal(jax.random.key(1), (2, 5, 16))
    probe = jax.random.normal(jax.random.key(2), (2, 5, 16))

    def ours(p: dict, x: jax.Array) -> jax.Array:
        s = nnx.state(layer)
        nnx.replace_by_pure_dict(s, p)
        y, stats = nnx.merge(graphdef, s)(x)
        return jnp.sum(y * probe) + stats[0]

    def theirs(p: dict, x: jax.Array) -> jax.Array:
        logits = jnp.einsum("bld,de->ble", x, p["router"])
        probs = jax.nn.softmax(logits, axis=-1)
        ids = jax.lax.top_k(logits, 2)[1]
        share = jnp.mean(jax.nn.one_hot(ids, 4).sum(-2), axis=(0, 1)) / 2
        return jnp.sum(_dense_reference(p, x, router, 2, renormalize) * probe) + 4 * jnp.sum(share * probs.mean((0, 1)))

    # Value and gradients jitted together: one compile per side instead of one per primitive.
    (y_ours, g_ours), (y_theirs, g_theirs) = (jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(params, x)
                                              for f in (ours, theirs))
    np.testing.assert_allclose(y_ours, y_theirs, rtol=1e-5)
    assert np.abs(g_theirs[0]["router"]).max() > 1e-3  # the router really gets a gradient
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g_theirs), jax.tree.leaves(g_ours)):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-6, err_msg=jax.tree_util.keystr(path))


# --- the grouped matmul: megablox against ragged_dot ---------------------------------------

MEGABLOX = functools.partial(megablox_matmul, interpret=True)  # the TPU kernel's own code, run on CPU


def _kernel_experts(num: int, d: int = 128, f: int = 256) -> tuple[jax.Array, ...]:
    """Experts as wide as the kernel's 128 tiles (one tile of 128 along d, two along f)."""
    keys = jax.random.split(jax.random.key(3), 3)
    return (0.1 * jax.random.normal(keys[0], (num, d, f)), 0.1 * jax.random.normal(keys[1], (num, d, f)),
            0.1 * jax.random.normal(keys[2], (num, f, d)))


def test_megablox_equals_ragged_dot_forward_and_gradients():
    """256 rows over 4 experts of uneven sizes (100, 0, 40, 90: one empty, groups crossing the
    128-row tiles) plus 26 padding rows (id 4, output 0), in shuffled order: the rows and every
    weight's gradient agree with jax.lax.ragged_dot."""
    gate, up, down = _kernel_experts(4)
    rows = jax.random.normal(jax.random.key(0), (256, 128))
    ids = jnp.asarray(np.random.RandomState(0).permutation(np.repeat([0, 2, 3, 4], [100, 40, 90, 26])), jnp.int32)
    probe = jax.random.normal(jax.random.key(1), (256, 128))

    def loss(matmul, *args: jax.Array) -> tuple[jax.Array, jax.Array]:
        y = expert_rows(args[0], ids, Experts(*args[1:]), matmul=matmul)
        return jnp.sum(jnp.sin(y) * probe), y

    grads = {name: jax.jit(jax.value_and_grad(functools.partial(loss, mm), argnums=(0, 1, 2, 3), has_aux=True))(
        rows, gate, up, down) for name, mm in (("ragged_dot", jax.lax.ragged_dot), ("megablox", MEGABLOX))}
    (_, y_ref), g_ref = grads["ragged_dot"]
    (_, y), g = grads["megablox"]
    assert np.abs(y_ref[ids < 4]).min() > 0 and not np.asarray(y_ref[ids == 4]).any()  # every real row computed
    np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
    for name, a, b in zip(("rows", "gate", "up", "down"), g, g_ref):
        assert np.abs(b).max() > 1e-2, name
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5, err_msg=name)
    assert not np.asarray(g[1][1]).any()  # the empty expert gets no gradient


def test_megablox_in_the_expert_parallel_dispatch_equals_one_device():
    """Dropless over 2 devices on `expert` (each receives 2 x 128 rows, most of them padding) with
    the kernel per device equals every expert on one device with ragged_dot."""
    gate, up, down = _kernel_experts(4, f=128)
    mesh = make_mesh(resolve_mesh_shape(load_config(TINY, ["mesh.data=1", "mesh.expert=2", "mesh.fsdp=4",
                                                           "model.moe.num_experts=4"]).mesh, 8))
    rules = (("batch", ("expert",)), ("expert", "expert"))
    x = jax.random.normal(jax.random.key(0), (2, 64, 128))
    logits = jax.random.normal(jax.random.key(1), (2, 64, 4)) + jnp.array([2.0, 0, 0, -9])  # expert 3: (almost) none
    weights, ids = jax.lax.top_k(jax.nn.softmax(logits), 2)
    rows = NamedSharding(mesh, PartitionSpec("expert"))
    with activation_rules(mesh, rules):
        y, _ = jax.jit(expert_parallel(rules, 2, MEGABLOX), static_argnums=4)(
            *(jax.device_put(a, rows) for a in (x, ids, weights, Experts(gate, up, down))), 0.0)
    # Jitted: one compile, not one per primitive (op by op, dispatch would be most of the test's time).
    y_ref, _ = jax.jit(local_dispatch, static_argnums=4)(x, ids, weights, Experts(gate, up, down), 0.0)
    assert np.abs(y_ref).min() > 0
    np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)


def test_the_grouped_matmul_follows_the_platform():
    """auto: megablox on TPU where its tiles divide the shapes, ragged_dot elsewhere; megablox
    asked for on a GPU is refused naming the key (the tiles are checked in tests/test_cli.py)."""
    cfg = load_config(TINY, ["model.d_model=128", "model.seq_len=64", "model.moe.num_experts=4", "mesh.data=1"])
    layout = plan_layout(cfg, 1)
    assert grouped_matmul(cfg, layout, "tpu").func is megablox_matmul
    assert not grouped_matmul(cfg, layout, "tpu").keywords["interpret"]
    assert grouped_matmul(cfg, layout, "cpu") is jax.lax.ragged_dot
    assert grouped_matmul(cfg, layout, "cuda") is jax.lax.ragged_dot
    odd = load_config(TINY, ["model.d_model=128", "model.seq_len=60", "model.moe.num_experts=4", "mesh.data=1"])
    assert grouped_matmul(odd, plan_layout(odd, 1), "tpu") is jax.lax.ragged_dot  # 60 x 2 rows: no 128 tile
    asked = load_config(TINY, ["model.d_model=128", "model.seq_len=64", "model.moe.num_experts=4", "mesh.data=1",
                               "model.moe.grouped_matmul=megablox"])
    assert grouped_matmul(asked, layout, "cpu").keywords["interpret"]
    gpu = types.SimpleNamespace(platform="gpu", device_kind="", process_index=0)
    check_devices(cfg, [gpu])  # auto is no kernel asked for by name
    with pytest.raises(ConfigError, match="model.moe.grouped_matmul=megablox is a TPU kernel"):
        check_devices(asked, [gpu])


# --- capacity mode ---------------------------------------------------------------------------


def _experts(num: int, d: int = 4, f: int = 3) -> tuple[jax.Array, ...]:
    keys = jax.random.split(jax.random.key(5), 3)
    return (jax.random.normal(keys[0], (num, d, f)), jax.random.normal(keys[1], (num, d, f)),
            jax.random.normal(keys[2], (num, f, d)))


def _one_expert(x: jax.Array, e: int, gate: jax.Array, up: jax.Array, down: jax.Array) -> jax.Array:
    return (jax.nn.silu(x @ gate[e]) * (x @ up[e])) @ down[e]


def test_capacity_drops_exactly_the_over_capacity_tokens():
    """6 tokens, 2 experts, top-1, capacity ceil(1.0 x 6 / 2) = 3 per expert: expert 0 is chosen
    by tokens 0, 1, 2, 3, 5, so tokens 3 and 5 (its 4th and 5th) are dropped."""
    gate, up, down = _experts(2)
    x = jax.random.normal(jax.random.key(0), (1, 6, 4))
    ids = jnp.array([0, 0, 0, 0, 1, 0]).reshape(1, 6, 1)
    weights = jnp.ones((1, 6, 1))
    dispatch = jax.jit(local_dispatch, static_argnums=4)  # one compile, not one per primitive
    y, kept = dispatch(x, ids, weights, Experts(gate, up, down), 1.0)
    np.testing.assert_array_equal(kept.reshape(-1), [True, True, True, False, True, False])
    for t in range(6):
        want = _one_expert(x[0, t], int(ids[0, t, 0]), gate, up, down) if kept[0, t, 0] else np.zeros(4)
        np.testing.assert_allclose(y[0, t], want, rtol=1e-5, atol=1e-6)
    y_free, kept_free = dispatch(x, ids, weights, Experts(gate, up, down), 0.0)  # dropless keeps all
    assert kept_free.all() and np.abs(y_free[0, 3]).sum() > 0


def test_capacity_under_expert_parallelism_counts_each_device_s_tokens():
    """Two devices on `expert`, one row each (3 tokens), capacity ceil(1.0 x 3 / 2) = 2 per
    expert and device: row 0 sends 3 tokens to expert 0 (the 3rd dropped), row 1 keeps all."""
    gate, up, down = _experts(2)
    sizes = resolve_mesh_shape(load_config(TINY, ["mesh.data=1", "mesh.expert=2", "mesh.fsdp=4",
                                                  "model.moe.num_experts=2"]).mesh, 8)
    mesh = make_mesh(sizes)
    rules = (("batch", ("expert",)), ("expert", "expert"))
    x = jax.random.normal(jax.random.key(0), (2, 3, 4))
    ids = jnp.array([[0, 0, 0], [1, 1, 0]]).reshape(2, 3, 1)
    weights = jnp.full((2, 3, 1), 0.5)
    dispatch = expert_parallel(rules, 2)
    rows = NamedSharding(mesh, PartitionSpec("expert"))
    with activation_rules(mesh, rules):
        y, kept = jax.jit(dispatch, static_argnums=4)(
            *(jax.device_put(a, rows) for a in (x, ids, weights, Experts(gate, up, down))), 1.0)
    np.testing.assert_array_equal(np.asarray(kept).reshape(2, 3), [[True, True, False], [True, True, True]])
    for b in range(2):
        for t in range(3):
            want = 0.5 * _one_expert(x[b, t], int(ids[b, t, 0]), gate, up, down) if kept[b, t, 0] else np.zeros(4)
            np.testing.assert_allclose(y[b, t], want, rtol=1e-5, atol=1e-6)


# --- the load-balancing loss -----------------------------------------------------------------


def test_the_aux_loss_falls_when_the_router_learns_on_a_skewed_batch():
    """Tokens that share one direction, which the router scores high for experts 0 and 1, all
    pick those two (imbalance E / k = 2); gradient steps on the router by the aux loss alone
    spread them out (aux towards its minimum 1, imbalance towards 1)."""
    direction = jax.random.normal(jax.random.key(8), (16,))
    direction = direction / jnp.linalg.norm(direction)
    x = 2.0 * direction + jax.random.normal(jax.random.key(9), (4, 16, 16))
    router = _layer("softmax_topk").router[...] + 0.5 * jnp.outer(direction, jnp.array([1.0, 1.0, -1.0, -1.0]))

    @jax.jit
    def stats(r: jax.Array) -> jax.Array:
        logits = jnp.einsum("bld,de->ble", x, r)
        ids = jax.lax.top_k(logits, 2)[1]
        return router_stats(logits, ids, jnp.ones(ids.shape, bool))

    first = stats(router)
    assert first[0] > 1.5 and first[3] > 1.9, first  # nearly every token on experts 0 and 1
    step = jax.jit(lambda r: r - 0.1 * jax.grad(lambda r: stats(r)[0])(r))
    for _ in range(40):
        router = step(router)
    last = stats(router)
    assert last[0] < 1.05 and last[3] < 1.3, (first, last)


# --- checkpoints -----------------------------------------------------------------------------


def test_checkpoints_move_between_expert_layouts(tmp_path, capsys):
    """A run on expert=8 saves at steps 2 and 4; its step-2 checkpoint, resumed on expert=2 x
    fsdp=2 x tensor=2, gives the expert=8 run's steps 3 and 4 (step 3 reads the parameters, step 4
    the optimizer state too)."""
    common = [*MOE, "optim.schedule=constant", "optim.warmup_steps=0", "train.log_every=1", "checkpoint.every=2",
              "train.steps=4"]
    straight = trainer.run(load_config(TINY, [*common, *LAYOUTS["expert=8"], f"run.dir={tmp_path / 'straight'}"]))
    # The same run stopped at step 2: its directory without the step-4 checkpoint.
    moved = stopped_at(tmp_path / "straight", tmp_path / "moved", 2)
    capsys.readouterr()
    resumed = trainer.run(load_config(TINY, [*common, *LAYOUTS["expert=2 x fsdp=2 x tensor=2"], f"run.dir={moved}"]))
    assert "resumed from step 2" in capsys.readouterr().out
    losses = [r["loss"] for r in straight]
    assert len(set(losses)) == 4 and straight[0]["moe_aux_loss"] > 1.0  # the steps really update
    np.testing.assert_allclose([r["loss"] for r in resumed], losses[2:], rtol=2e-5)
    np.testing.assert_allclose([r["moe_aux_loss"] for r in resumed], [r["moe_aux_loss"] for r in straight[2:]], rtol=2e-5)
    # Hugging Face export refuses shared experts (neither Mixtral nor Qwen3-MoE has ungated ones)
    # in one line and writes nothing.
    assert hf_cli.main(["export", "--run-dir", str(moved), "--out", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: model.moe.shared_experts=1: neither Mixtral nor Qwen3-MoE") and err.count("\n") == 1
    assert not (tmp_path / "hf").exists()


def _grouped(num_layers: int):
    return load_config(TINY, [*MOE, f"model.num_layers={num_layers}", "model.moe.every=2", "model.d_ff=48"]).model


def test_every_second_layer_equals_a_layer_by_layer_reference_and_stays_scanned():
    """model.moe.every=2: the grouped, scanned stack equals the layers run one by one in order
    (dense, MoE, dense, MoE), logits and router statistics; its program does not grow with depth."""
    from model.block import Block
    from model.inputs import TokenInputs
    from model.decode import forward, init_cache
    from model.flops import moe_layer_count
    from model.transformer import Transformer, transformer_from_params

    cfg = _grouped(4)
    # Every model computation below is jitted: one compile each instead of one per primitive,
    # which op by op would make this a slow test.
    params = jax.jit(lambda: nnx.to_pure_dict(nnx.state(Transformer(cfg, rngs=nnx.Rngs(1)))))()
    assert params["layers"]["dense"]["mlp"]["gate"].shape[:2] == (2, 1) and "router" in params["layers"]["moe"]["mlp"]
    tokens = jax.random.randint(jax.random.key(2), (2, 16), 0, 257)

    @jax.jit
    def ours(params: dict) -> tuple[jax.Array, jax.Array, jax.Array]:
        model = transformer_from_params(cfg, params)
        cached, _ = forward(model, tokens, init_cache(model, 2, 20), 0)  # KV-cache decoding walks the groups too
        return model(tokens), model.features_and_stats(tokens)[1], cached

    @functools.partial(jax.jit, static_argnums=1)
    def reference(params: dict, order: tuple[str, ...]) -> tuple[jax.Array, jax.Array]:
        model = transformer_from_params(cfg, params)
        positions = jnp.broadcast_to(jnp.arange(16), tokens.shape)
        h, total = model.embed(tokens), jnp.zeros(len(STATS))
        for group in range(2):
            for kind in order:
                p = jax.tree.map(lambda a: a[group, 0] if kind == "dense" else a[group], params["layers"][kind])
                graphdef, state = nnx.split(nnx.eval_shape(lambda: Block(cfg, rngs=nnx.Rngs(0), moe=kind == "moe")))
                nnx.replace_by_pure_dict(state, p)
                h, s = nnx.merge(graphdef, state)(h, TokenInputs(positions))
                total = total + s
        return model.logits(model.final_norm(h)), total / moe_layer_count(cfg)

    logits, stats, cached = ours(params)
    ref_logits, ref_stats = reference(params, ("dense", "moe"))
    swapped, _ = reference(params, ("moe", "dense"))
    assert float(jnp.abs(swapped - ref_logits).max()) > 1e-2  # the order of the layers shows
    np.testing.assert_allclose(logits, ref_logits, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(stats, ref_stats, rtol=1e-5)
    assert moe_layer_count(cfg) == 2 and stats[0] > 0.5  # a real aux loss, averaged over the 2 MoE layers
    np.testing.assert_allclose(cached, ref_logits, rtol=1e-5, atol=1e-5)

    def program(num_layers: int) -> jax.core.ClosedJaxpr:
        c = _grouped(num_layers)
        p = nnx.to_pure_dict(nnx.state(nnx.eval_shape(lambda: Transformer(c, rngs=nnx.Rngs(0)))))
        return jax.make_jaxpr(lambda p, t: transformer_from_params(c, p)(t))(p, tokens)

    shallow, deep = program(4), program(16)
    scans = [e for e in deep.jaxpr.eqns if e.primitive.name == "scan"]
    assert len(scans) == 1 and scans[0].params["length"] == 8  # one scan over the 8 groups ...
    inner = [e for e in scans[0].params["jaxpr"].jaxpr.eqns if e.primitive.name == "scan"]
    assert len(inner) == 1  # ... whose body scans the group's dense layers
    assert len(deep.jaxpr.eqns) == len(shallow.jaxpr.eqns)

"""DeepSeek-V3 routing (model/router.py): the sigmoid gate with grouped top-k against transformers'
DeepseekV3TopkRouter, the load-steered bias (toward balance, fewer drops), dense first layers, and
one step's loss, statistics and gradients the same on one device and on expert, fsdp x tensor and
pipeline layouts."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import ROOT
from configs import ConfigError, load_config
from model.moe import MoE
from model.router import route, router_stats
from sharding import activation_rules
from test_context import initial_params
from trainer import abstract_program
from trainer.optimizer import make_optimizer, muon_dims, without_router_bias
from trainer.objectives.lm import make_loss_fn
from trainer.step import accumulate_stats

TINY = os.path.join(ROOT, "configs", "tiny.yaml")
SIGMOID = ["model.moe.num_experts=8", "model.moe.experts_per_token=2", "model.moe.d_ff=32", "model.moe.router=sigmoid",
           "model.moe.n_group=4", "model.moe.topk_group=2", "model.moe.routed_scaling_factor=2.5",
           "model.moe.shared_experts=1"]


def _moe_cfg(*overrides: str):
    return load_config(TINY, ["model.d_model=16", *SIGMOID, *overrides]).model


# --- the gate against transformers ---------------------------------------------------------------


def _hf_router(weight: np.ndarray, bias: np.ndarray, top_k: int, n_group: int, topk_group: int, scale: float):
    torch = pytest.importorskip("torch")
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    cfg = DeepseekV3Config(hidden_size=weight.shape[1], n_routed_experts=weight.shape[0], num_experts_per_tok=top_k,
                           n_group=n_group, topk_group=topk_group, routed_scaling_factor=scale, norm_topk_prob=True)
    router = DeepseekV3TopkRouter(cfg)
    with torch.no_grad():
        router.weight.copy_(torch.tensor(weight))
        router.e_score_correction_bias.copy_(torch.tensor(bias))
    return lambda x: [t.detach().numpy() for t in router(torch.tensor(x))[1:]]


@pytest.mark.parametrize("n_group, topk_group", [(4, 2), (1, 1)])
def test_sigmoid_gate_equals_transformers(n_group, topk_group):
    """Ids (as sets) and weights of meshlm's gate on 64 tokens equal DeepseekV3TopkRouter's, with a
    random bias large enough to change choices; the grouped choice really differs from the plain one."""
    rng = np.random.RandomState(0)
    weight, bias = rng.normal(size=(16, 32)).astype(np.float32), (0.3 * rng.normal(size=16)).astype(np.float32)
    x = rng.normal(size=(64, 32)).astype(np.float32)
    theirs_w, theirs_ids = _hf_router(weight, bias, 4, n_group, topk_group, 2.5)(x)
    cfg = _moe_cfg("model.moe.num_experts=16", "model.moe.experts_per_token=4", f"model.moe.n_group={n_group}",
                   f"model.moe.topk_group={topk_group}").moe
    logits = jnp.asarray(x) @ jnp.asarray(weight).T
    ids, w = route(logits, cfg, jnp.asarray(bias))
    assert len(theirs_ids) == 64 and np.abs(theirs_w.sum(-1) - 2.5).max() < 1e-5  # renormalized, then scaled
    for row in range(64):
        order_o, order_t = np.argsort(np.asarray(ids)[row]), np.argsort(theirs_ids[row])
        np.testing.assert_array_equal(np.asarray(ids)[row][order_o], theirs_ids[row][order_t])
        np.testing.assert_allclose(np.asarray(w)[row][order_o], theirs_w[row][order_t], rtol=1e-5)
    unbiased = route(logits, cfg, jnp.zeros(16))[0]
    assert (np.sort(np.asarray(unbiased), -1) != np.sort(np.asarray(ids), -1)).any(), "the bias must change choices"
    if n_group > 1:
        plain = route(logits, _moe_cfg("model.moe.num_experts=16", "model.moe.experts_per_token=4",
                                       "model.moe.n_group=1", "model.moe.topk_group=1").moe, jnp.asarray(bias))[0]
        assert (np.sort(np.asarray(plain), -1) != np.sort(np.asarray(ids), -1)).any(), "groups must change choices"


# --- the bias: toward balance, fewer drops ---------------------------------------------------------


def _skewed_layer(*overrides: str) -> tuple[MoE, jax.Array]:
    """An MoE layer whose router sends nearly every token of a batch to experts 0 and 1."""
    layer = MoE(_moe_cfg("model.moe.n_group=1", "model.moe.topk_group=1", *overrides), rngs=nnx.Rngs(3))
    rng = np.random.RandomState(1)
    router = 0.5 * rng.normal(size=(16, 8)).astype(np.float32)
    router[0, :2] = 4.0  # feature 0 is 1 on every token: experts 0 and 1 get +4 logits
    layer.router[...] = jnp.asarray(router)
    x = jax.random.normal(jax.random.key(0), (4, 32, 16)).at[..., 0].set(1.0)
    return layer, x


def _bias_steps(layer: MoE, x: jax.Array, steps: int, rate: float) -> tuple[np.ndarray, list[np.ndarray]]:
    """`steps` updates of the layer's bias by the training loss's own path: the gradient of the
    layer's `bias_load` statistic through the optimizer `make_optimizer` builds. Returns the first
    step's gradient and the router statistics before each step and after the last."""
    graphdef, state = nnx.split(layer)
    params = nnx.to_pure_dict(state)
    axes = jax.tree.map(lambda p: ("expert",) * p.ndim, params)
    tx, _ = make_optimizer(load_config(TINY, []).optim, 10, axes, router_bias_rate=rate)

    def stats(p: dict) -> jax.Array:
        s = nnx.state(layer)
        nnx.replace_by_pure_dict(s, p)
        return nnx.merge(graphdef, s)(x)[1]

    @jax.jit
    def step(p: dict, opt: object) -> tuple[dict, object, jax.Array, dict]:
        s, grads = stats(p), jax.grad(lambda q: stats(q)[4])(p)
        updates, opt = tx.update(grads, opt, p)
        return jax.tree.map(jnp.add, p, updates), opt, s, grads

    # Jitted, as `step` is: eagerly each operation of the optimizer's init and of the layer would
    # compile alone.
    opt, seen, first = jax.jit(tx.init)(params), [], None
    for _ in range(steps):
        params, opt, s, grads = step(params, opt)
        seen.append(np.asarray(s))
        first = grads if first is None else first
    seen.append(np.asarray(jax.jit(stats)(params)))
    layer_state = nnx.state(layer)
    nnx.replace_by_pure_dict(layer_state, params)
    nnx.update(layer, layer_state)
    return first, seen


def test_bias_moves_toward_balance():
    """On a skewed batch the bias's gradient is each expert's share of the assignments minus the
    mean share (counted here in NumPy), the first update moves each bias by the rate against it,
    and 100 updates bring the imbalance from > 3 to < 1.3."""
    layer, x = _skewed_layer()
    logits = np.einsum("bld,de->ble", np.asarray(x, np.float64), np.asarray(layer.router[...], np.float64))
    top = np.argsort(-1 / (1 + np.exp(-logits)), axis=-1)[..., :2]
    share = np.bincount(top.reshape(-1), minlength=8) / top.size
    first, seen = _bias_steps(layer, x, 100, rate=0.01)
    np.testing.assert_allclose(first["router_bias"], share - 1 / 8, atol=1e-6)
    assert not np.any(without_router_bias(first)["router_bias"])
    assert seen[0][3] > 3.0 and seen[-1][3] < 1.3, (seen[0], seen[-1])
    bias = np.asarray(layer.router_bias[...])
    assert bias[:2].max() < bias[2:].min(), bias  # the overloaded experts pushed down
    np.testing.assert_allclose(bias / 0.01, np.round(bias / 0.01), atol=1e-3)  # whole steps of the rate


def test_bias_drops_fewer_tokens_under_a_capacity():
    """capacity_factor 1: the skewed batch drops over 40% of its assignments with the bias at 0
    (rate 0: it stays) and, once the bias has balanced the load, under 10%."""
    layer, x = _skewed_layer("model.moe.capacity_factor=1.0")
    _, still = _bias_steps(layer, x, 2, rate=0.0)
    assert still[0][2] == still[-1][2] > 0.4
    _, moved = _bias_steps(layer, x, 100, rate=0.01)
    assert moved[-1][2] < 0.1 < still[-1][2], (still[-1], moved[-1])


def test_sequence_balance_loss_equals_numpy():
    """The sigmoid router's aux statistic is DeepSeek-V3's sequence-wise balance loss (float64 NumPy)."""
    rng = np.random.RandomState(2)
    logits = rng.normal(size=(3, 7, 8))
    ids = np.argsort(-logits, -1)[..., :2]
    s = 1 / (1 + np.exp(-logits))
    counts = np.stack([np.bincount(row.reshape(-1), minlength=8) for row in ids])  # [b, E]
    f = 8 / (2 * 7) * counts
    p = (s / s.sum(-1, keepdims=True)).mean(1)
    got = router_stats(jnp.asarray(logits, jnp.float32), jnp.asarray(ids), jnp.ones(ids.shape, bool), "sigmoid")
    np.testing.assert_allclose(float(got[0]), (f * p).sum(-1).mean(), rtol=1e-5)


# --- config rules --------------------------------------------------------------------------------


@pytest.mark.parametrize("overrides, message", [
    (["model.moe.n_group=3"], "model.moe.n_group: 3 does not divide model.moe.num_experts=8"),
    (["model.moe.topk_group=5"], "model.moe.topk_group: 5 is more than model.moe.n_group=4"),
    (["model.moe.experts_per_token=5", "model.moe.topk_group=2"], "model.moe.experts_per_token: 5 is more than the 4"),
    (["model.moe.router=softmax_topk"], "model.moe.n_group: 4 needs model.moe.router=sigmoid"),
    (["model.moe.first_k_dense_replace=4"], "model.moe.first_k_dense_replace: 4 leaves no MoE layer"),
    (["model.moe.first_k_dense_replace=1", "model.moe.every=2", "model.num_layers=3"],
     "model.moe.first_k_dense_replace: 1 with model.moe.every=2"),
])
def test_bad_routing_keys_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match="^" + message.replace("(", r"\(")):
        load_config(TINY, [*SIGMOID, *overrides])


# --- one step of tiny-deepseek on the layouts ----------------------------------------------------

# The preset (MLA, a dense first layer, grouped sigmoid routing, a shared expert), shortened: 3
# layers so that the 2 MoE ones split into 2 pipeline stages.
STEP = ["model.num_layers=3", "model.seq_len=32", "data.source=synthetic", "model.moe.aux_loss_coef=0.001"]
LAYOUTS = {
    "expert=8": ["mesh.data=1", "mesh.expert=8"],
    "expert=2 x fsdp=2 x tensor=2": ["mesh.data=1", "mesh.expert=2", "mesh.fsdp=2", "mesh.tensor=2"],
    "expert=2 x pipeline=2 x data=2": ["mesh.data=2", "mesh.expert=2", "mesh.pipeline=2", "pipeline.microbatches=2"],
}
_REFERENCES: dict[bool, dict] = {}


def _step(*overrides: str, devices: list | None = None) -> dict:
    """Loss, statistics and gradients of one batch, the routing bias set to a random vector."""
    cfg = load_config("tiny-deepseek", [*STEP, *overrides])
    program = abstract_program(cfg, devices)
    params = jax.tree.map(np.asarray, initial_params(program))
    params["layers"]["mlp"]["router_bias"] = 0.02 * np.random.RandomState(5).normal(size=(2, 8)).astype(np.float32)
    params = jax.device_put(params, program.state_sh.params)
    tokens = np.asarray(jax.random.randint(jax.random.key(7), (16, cfg.model.seq_len + 1), 0, 257))
    batch = {"tokens": jax.device_put(tokens, program.batch_sh)}
    loss_fn = make_loss_fn(program.spec.model.graphdef, program.compute, model_terms=True)
    fn = jax.jit(lambda p, b: accumulate_stats(loss_fn, p, b, cfg.train.grad_accum, program.compute.grad_fn))
    with activation_rules(program.mesh, program.spec.layout.act_rules):
        loss, grads, (count, stats) = fn(params, batch)
    return {"loss": float(loss), "stats": np.asarray(stats) / float(count), "grads": jax.tree.map(np.asarray, grads),
            "sizes": program.spec.layout.sizes}


def _reference(accumulate: bool) -> dict:
    """One device's step (over the pipeline's two microbatches when `accumulate`), computed once."""
    if accumulate not in _REFERENCES:
        _REFERENCES[accumulate] = _step("mesh.data=1", *(["train.grad_accum=2"] if accumulate else []),
                                        devices=jax.devices()[:1])
    return _REFERENCES[accumulate]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_tiny_deepseek_step_equals_one_device(layout):
    """The step on the layout equals one device's (accumulating the pipeline's microbatches): loss,
    router statistics and every gradient, the dense first layer's and the bias's load included."""
    ref = _reference("pipeline" in layout)
    got = _step(*LAYOUTS[layout])
    assert got["sizes"] != ref["sizes"]
    assert np.abs(ref["grads"]["layers"]["mlp"]["router_bias"]).max() > 0  # a load signal
    assert np.abs(ref["grads"]["dense_layers"]["mlp"]["gate"]).max() > 0
    assert np.abs(ref["grads"]["layers"]["attn"]["kv_b"]).max() > 0  # latent attention
    np.testing.assert_allclose(got["loss"], ref["loss"], rtol=1e-6)
    np.testing.assert_allclose(got["stats"], ref["stats"], rtol=1e-5)
    for (path, r), g in zip(jax.tree_util.tree_leaves_with_path(ref["grads"]), jax.tree.leaves(got["grads"])):
        np.testing.assert_allclose(g, r, rtol=2e-4, atol=2e-6, err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("old, new, message", [
    ("softmax_topk", "sigmoid", "model.moe.router=sigmoid adds the sigmoid router's bias"),
    ("sigmoid", "softmax_topk", "model.moe.router=softmax_topk drops the sigmoid router's bias"),
])
def test_resuming_across_the_routing_bias_names_the_router(tmp_path, old, new, message):
    """The bias is a parameter: a run resumes with the router it has (or not) one for."""
    from configs import dump_config
    from trainer.checkpoint import check_resumable

    def cfg(router: str):
        return load_config(TINY, ["model.moe.num_experts=8", f"model.moe.router={router}", f"run.dir={tmp_path}"])

    (tmp_path / "config.yaml").write_text(dump_config(cfg(old)))
    (tmp_path / "checkpoints" / "2").mkdir(parents=True)
    check_resumable(cfg(old))
    with pytest.raises(ConfigError, match="^" + message):
        check_resumable(cfg(new))


def test_a_run_moves_and_checkpoints_the_bias(tmp_path):
    """Three real train steps on expert=2 x data=4: each step moves every layer's bias by the
    rate (a multiple of it, at most three), the checkpoint holds it, and the metrics log the load."""
    import json

    import trainer
    from trainer.checkpoint import restore_params

    rate = 0.01
    cfg = load_config("tiny-deepseek", [*STEP, "mesh.expert=2", "train.steps=3", "train.log_every=1", "checkpoint.every=3",
                             "eval.every=0", f"model.moe.router_bias_update_rate={rate}", f"run.dir={tmp_path}"])
    trainer.run(cfg)
    _, step, params = restore_params(str(tmp_path))
    bias = np.asarray(params["layers"]["mlp"]["router_bias"]) / rate
    assert step == 3 and bias.shape == (2, 8) and np.abs(bias).max() > 0, bias
    np.testing.assert_allclose(bias, np.round(bias), atol=1e-3)
    assert np.abs(bias).max() <= 3 + 1e-3 and (np.abs(np.round(bias)) % 2 == 1).any()  # three steps of +-1 or 0
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert all("moe_imbalance" in r and "moe_bias_load" not in r for r in rows if "loss" in r)


def test_muon_orthogonalizes_the_dense_first_layers():
    """The dense first layers are stacked on `sublayers` alone; Muon treats them as the stack's."""
    for matrix in (("embed", "mlp"), ("mlp", "embed")):
        assert muon_dims(("sublayers", *matrix)) == muon_dims(("layers", *matrix))
        assert muon_dims(("sublayers", *matrix)) is not None
    assert muon_dims(("sublayers", "embed")) is None  # a norm scale

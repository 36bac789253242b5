"""Multi-token prediction (model/mtp.py): with `model.mtp_loss_coef=0` the training loss and the
shared parameters' gradients are the plain model's; its loss equals a direct computation on each
document alone (no shifts, no masks); layouts give one device's loss and gradients; export drops
the modules; a 1F1B-family pipeline refuses it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from bench.procs import TINY
from configs import ConfigError, load_config
from model import hf
from model.inputs import TokenInputs
from model.transformer import transformer_from_params
from sharding import activation_rules
from test_context import initial_params, packed_batch
from trainer import abstract_program
from trainer.optimizer import make_optimizer
from trainer.state import init_state, random_params
from trainer.objectives.lm import make_loss_fn
from trainer.step import accumulate_stats

# Two rows of 33 tokens: documents of 12, 14 and 7 padding tokens (segment 0), and of 20 and 13.
DOCS = [[(1, 12), (2, 14), (0, 7)], [(1, 20), (2, 13)]]


def batch() -> dict[str, np.ndarray]:
    tokens = np.random.default_rng(3).integers(0, 257, (2, 33)).astype(np.int32)
    seg = np.array([sum(([s] * n for s, n in row), []) for row in DOCS], np.int32)
    pos = np.array([sum((list(range(n)) for _, n in row), []) for row in DOCS], np.int32)
    return {"tokens": tokens, "segment_ids": seg, "positions": pos}


def outputs(overrides: list[str]) -> tuple[float, dict, tuple, dict, object]:
    """Loss, gradients and aux of one packed batch on one device; the parameters; the config."""
    cfg = load_config(TINY, ["data.source=synthetic", "mesh.data=1", "train.global_batch=2", *overrides])
    program = abstract_program(cfg, jax.devices()[:1])
    params = initial_params(program)
    loss_fn = make_loss_fn(program.spec.model.graphdef, program.compute, model_terms=True)
    loss, grads, aux = jax.jit(lambda p, b: accumulate_stats(loss_fn, p, b, 1))(params, batch())
    return float(loss), jax.tree.map(np.asarray, grads), aux, jax.tree.map(np.asarray, params), cfg


@pytest.fixture(scope="module")
def plain():
    return outputs([])


@pytest.fixture(scope="module")
def weighted():
    return outputs(["model.mtp_depth=2", "model.mtp_loss_coef=0.3"])


def test_mtp_loss_coef_0_gives_the_plain_models_loss_and_gradients(plain, weighted):
    loss0, grads0, _, params0, _ = plain
    loss, grads, aux, params, _ = outputs(["model.mtp_depth=2", "model.mtp_loss_coef=0"])
    # The modules are really there and really trained with a weight: the variants differ.
    assert abs(weighted[0] - loss0) > 0.1 and np.abs(weighted[1]["mtp"][0]["eh_proj"]).max() > 0
    # The main parameters are created first, so both models start from the same ones.
    jax.tree.map(np.testing.assert_array_equal, {k: v for k, v in params.items() if k != "mtp"}, params0)
    np.testing.assert_allclose(loss, loss0, rtol=1e-6)
    for (path, g0), g in zip(jax.tree_util.tree_leaves_with_path(grads0),
                             jax.tree.leaves({k: v for k, v in grads.items() if k != "mtp"})):
        np.testing.assert_allclose(g, g0, rtol=1e-5, atol=1e-7, err_msg=jax.tree_util.keystr(path))
    assert all(float(np.abs(g).max()) == 0 for g in jax.tree.leaves(grads["mtp"]))
    count, (lm, mtp) = aux
    assert abs(float(lm / count) - loss0) < 1e-6 and float(mtp / count) > 5  # ~ln(264) untrained


def direct_mtp_loss(cfg, params: dict) -> float:  # noqa: ANN001 (a ModelConfig)
    """The mean over depths of each depth's mean cross-entropy, computed as DeepSeek-V3 writes it:
    each document alone, its sequence cut by one more token at each depth."""
    model = transformer_from_params(cfg, params)

    @jax.jit  # one program per document length, not one per operation as eager dispatch compiles
    def per_depth(doc: jax.Array) -> list[jax.Array]:
        n, h, out = doc.shape[1], model.features(doc[:, :-1]), []  # the main model's normed hidden states
        for k, module in enumerate(model.mtp, start=1):
            length = n - 1 - k  # positions whose token k + 1 ahead is in the document
            pos = jnp.arange(length)[None]
            h = module(h[:, :length], model.embed(doc[:, k:k + length]), TokenInputs(pos))[0]
            logits = model.logits(module.norm(h))
            out.append(optax.softmax_cross_entropy_with_integer_labels(
                logits.astype(jnp.float32), doc[:, k + 1:k + 1 + length])[0])
        return out

    tokens = batch()["tokens"]
    losses = {k: [] for k in range(1, cfg.mtp_depth + 1)}
    for row, docs in enumerate(DOCS):
        start = 0
        for seg, n in docs:
            doc, start = jnp.asarray(tokens[row, start:start + n][None]), start + n
            if seg == 0:
                continue
            for k, depth_losses in enumerate(per_depth(doc), start=1):
                losses[k] += list(np.asarray(depth_losses))
    return float(np.mean([np.mean(v) for v in losses.values()]))


def test_mtp_loss_equals_each_document_computed_alone(plain, weighted):
    loss, _, (count, (lm, mtp)), params, cfg = weighted
    direct = direct_mtp_loss(cfg.model, params)
    assert abs(direct - float(mtp / count)) <= 1e-5 * direct
    np.testing.assert_allclose(loss, float(lm / count) + 0.3 * direct, rtol=1e-6)
    np.testing.assert_allclose(float(lm / count), plain[0], rtol=1e-6)


MTP_TINY = ["model.mtp_depth=2", "model.mtp_loss_coef=0.3"]
MTP_LAYOUTS = {
    "fsdp=2 x tensor=2 x context=2, ring": ["mesh.data=1", "mesh.fsdp=2", "mesh.tensor=2", "mesh.context=2",
                                            "context.strategy=ring"],
    # The modules run outside the stages, where the batch is split over `pipeline` too.
    "pipeline=2 x data=2 x context=2, gpipe, ring": ["mesh.pipeline=2", "mesh.data=2", "mesh.context=2",
                                                     "pipeline.microbatches=2", "context.strategy=ring"],
}


def training_loss_and_grads(overrides: list[str], devices: list) -> tuple[float, dict]:
    """The training loss (multi-token prediction included) and gradients of test_context's
    packed batch under the layout of `overrides`."""
    cfg = load_config(TINY, ["data.source=synthetic", *MTP_TINY, *overrides])
    program = abstract_program(cfg, devices)
    params = initial_params(program)
    data = {k: jax.device_put(v, program.batch_sh) for k, v in packed_batch(cfg.model.seq_len, True).items()}
    loss_fn = make_loss_fn(program.spec.model.graphdef, program.compute, model_terms=True)
    with activation_rules(program.mesh, program.spec.layout.act_rules):
        loss, grads, _ = jax.jit(lambda p, b: accumulate_stats(loss_fn, p, b, 1))(params, data)
    return float(loss), jax.tree.map(np.asarray, grads)


@pytest.fixture(scope="module")
def one_device() -> tuple[float, dict]:
    return training_loss_and_grads(["mesh.data=1"], jax.devices()[:1])


@pytest.mark.parametrize("layout", list(MTP_LAYOUTS))
def test_mtp_layouts_give_the_loss_and_gradients_of_one_device(one_device, layout):
    """Packed documents. Under the load-balanced context split the rows are reordered: the
    tokens ahead must have been found in sequence order."""
    ref_loss, ref_grads = one_device
    loss, grads = training_loss_and_grads(MTP_LAYOUTS[layout], jax.devices())
    assert np.abs(ref_grads["mtp"][1]["eh_proj"]).max() > 0  # the modules are trained here
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    for (path, r), g in zip(jax.tree_util.tree_leaves_with_path(ref_grads), jax.tree.leaves(grads)):
        np.testing.assert_allclose(g, r, rtol=2e-4, atol=2e-6, err_msg=jax.tree_util.keystr(path))


def test_export_drops_the_mtp_modules(plain, weighted):
    *_, params0, cfg0 = plain
    *_, params, cfg = weighted
    ours = hf.to_hf_tensors(params, cfg.model)
    assert ours.keys() == hf.to_hf_tensors(params0, cfg0.model).keys()
    assert not any("mtp" in name or "eh_proj" in name for name in ours)


def test_a_1f1b_pipeline_refuses_mtp():
    cfg = load_config(TINY, ["data.source=synthetic", "mesh.pipeline=2", "pipeline.schedule=1f1b",
                             "pipeline.microbatches=4", "model.mtp_depth=1"])
    with pytest.raises(ConfigError, match="model.mtp_depth=1: pipeline.schedule=1f1b"):
        abstract_program(cfg, jax.devices())



def test_a_hugging_face_start_draws_the_mtp_modules_as_a_random_start_does():
    """Hugging Face checkpoints hold no prediction modules: a run started from one (init.from_hf)
    takes them from the random init of run.seed, created alone on their shards."""
    cfg = load_config(TINY, ["data.source=synthetic", "mesh.data=2", "mesh.fsdp=4", *MTP_TINY])
    program = abstract_program(cfg, jax.devices())
    whole = init_state(cfg.model, program.tx, 0, program.state_sh).params["mtp"]
    alone = random_params(cfg.model, 0, program.state_sh.params, "mtp")
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), alone, whole)
    assert jax.tree.leaves(alone)[0].sharding == jax.tree.leaves(program.state_sh.params["mtp"])[0]
    assert float(np.abs(np.asarray(alone[0]["eh_proj"])).max()) > 0


@pytest.mark.parametrize("remat", ["none", "full"])
def test_mtp_modules_follow_the_remat_policy(remat):
    """Under model.remat each module is one checkpoint more than the layer scan's one, and (outside
    a scan) keeps XLA from merging its recompute into the forward pass."""
    cfg = load_config(TINY, ["data.source=synthetic", "mesh.data=1", "train.global_batch=2", f"model.remat={remat}",
                             *MTP_TINY])
    program = abstract_program(cfg, jax.devices()[:1])
    loss_fn = make_loss_fn(program.spec.model.graphdef, program.compute, model_terms=True)
    text = str(jax.make_jaxpr(lambda p, b: loss_fn(p, b)[0])(program.spec.model.shapes, batch()))
    assert text.count("remat2[") == (0 if remat == "none" else 1 + 2)
    assert text.count("prevent_cse=True") == (0 if remat == "none" else 2)


def test_muon_takes_the_prediction_modules_matrices():
    """Under optim.name=muon the modules' matrices are orthogonalized as the blocks' are (they have
    no `layers` dim), and the embedding, head and norms still go to AdamW."""
    from sharding import logical_axes
    from trainer.optimizer import muon_dims
    from model.transformer import abstract_transformer

    cfg = load_config(TINY, ["model.mtp_depth=1", "model.tie_embeddings=false"]).model
    axes = logical_axes(nnx.state(abstract_transformer(cfg)))
    module = axes["mtp"][0]
    assert muon_dims(module["eh_proj"]).reduction_axis == (0,) and muon_dims(module["block"]["attn"]["q"])
    assert muon_dims(module["block"]["mlp"]["down"]).output_axis == (1,)
    assert not any(muon_dims(axes[name]) for name in ("embedding", "lm_head"))
    assert not muon_dims(module["enorm"]["scale"]) and not muon_dims(module["block"]["attn_norm"]["scale"])


def test_a_run_logs_the_mtp_loss(tiny, capsys):
    """Two steps of a dense model with one module: each record's loss is its lm_loss plus
    mtp_loss_coef x mtp_loss, and the printed line shows both parts."""
    import trainer

    records = trainer.run(tiny("model.mtp_depth=1", "model.mtp_loss_coef=0.5", "train.steps=2"))
    assert len(records) == 2
    for r in records:
        assert r["mtp_loss"] > 4 and abs(r["loss"] - (r["lm_loss"] + 0.5 * r["mtp_loss"])) < 1e-5 * r["loss"]
    assert "lm_loss" in capsys.readouterr().out.split("mtp_loss")[0].splitlines()[-1]


def test_the_chunked_head_gives_the_mtp_loss_of_the_whole_one(weighted):
    """model.loss_chunk: each module's head and loss 16 positions at a time, as the main head's
    (against `weighted`, the same two modules with the whole head)."""
    whole = weighted
    chunked = outputs(["model.mtp_depth=2", "model.loss_chunk=16"])
    np.testing.assert_allclose(chunked[0], whole[0], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(chunked[2][1]), np.asarray(whole[2][1]), rtol=1e-6)


def test_mtp_with_experts_on_expert_parallel_gives_one_devices_loss_and_gradients():
    """A mixture-of-experts model's modules hold an MoE block too; its tokens reach the experts
    by the layout's dispatch, outside the layer stack. One module: a second one's block would run
    the same dispatch again."""
    moe = ["model.num_layers=2", "model.moe.num_experts=8", "model.moe.experts_per_token=2", "model.moe.d_ff=32",
           "model.mtp_depth=1"]
    ref_loss, ref_grads = training_loss_and_grads(["mesh.data=1", *moe], jax.devices()[:1])
    loss, grads = training_loss_and_grads(["mesh.data=1", "mesh.expert=8", *moe], jax.devices())
    assert np.abs(ref_grads["mtp"][0]["block"]["mlp"]["gate"]).max() > 0  # the module's block is an MoE
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    for (path, r), g in zip(jax.tree_util.tree_leaves_with_path(ref_grads), jax.tree.leaves(grads)):
        np.testing.assert_allclose(g, r, rtol=2e-4, atol=2e-6, err_msg=jax.tree_util.keystr(path))


def test_an_mtp_moe_blocks_load_moves_its_routing_bias():
    """A module's MoE block balances its load as the stack's layers do: with its router at zero
    every token ties and goes to experts 0 and 1 (shares 1/2, 1/2, 0, ...), so its routing bias's
    gradient is a positive multiple of share - 1/8, and the optimizer's first update moves the
    two loaded experts' bias down by the rate and the others' up."""
    sigmoid = ["model.moe.num_experts=8", "model.moe.experts_per_token=2", "model.moe.d_ff=32",
               "model.moe.router=sigmoid", "model.moe.n_group=4", "model.moe.topk_group=2"]
    cfg = load_config(TINY, ["data.source=synthetic", "mesh.data=1", "train.global_batch=2", "model.num_layers=2",
                             "model.mtp_depth=1", *sigmoid])
    program = abstract_program(cfg, jax.devices()[:1])
    params = initial_params(program)
    block = params["mtp"][0]["block"]["mlp"]
    block["router"] = jnp.zeros_like(block["router"])
    loss_fn = make_loss_fn(program.spec.model.graphdef, program.compute, model_terms=True)
    _, grads, _ = jax.jit(lambda p, b: accumulate_stats(loss_fn, p, b, 1))(params, batch())
    g = np.asarray(grads["mtp"][0]["block"]["mlp"]["router_bias"], np.float64)
    over = np.array([0.5, 0.5, 0, 0, 0, 0, 0, 0]) - 1 / 8
    assert g[0] > 0, g
    np.testing.assert_allclose(g, g[0] / over[0] * over, rtol=1e-5)
    assert np.abs(np.asarray(grads["layers"]["mlp"]["router_bias"])).max() > 0  # the stack's biases still move
    tx, _ = make_optimizer(cfg.optim, 10, program.spec.model.axes, router_bias_rate=0.01)
    # One program: eager dispatch would compile each of the optimizer's operations on each shape alone.
    updates = jax.jit(lambda g, p: tx.update(g, tx.init(p), p)[0])(grads, params)
    np.testing.assert_allclose(np.asarray(updates["mtp"][0]["block"]["mlp"]["router_bias"]),
                               -0.01 * np.sign(over), rtol=1e-6)

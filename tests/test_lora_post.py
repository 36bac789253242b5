"""LoRA with train.objective=sft and =dpo, and SFT and DPO under expert parallelism.

Under LoRA, DPO's reference is the frozen base itself (the adapters' B zeroed): its log-probs
equal a full model's on the same weights and a float64 NumPy computation; the state and the
checkpoints hold no copy of the weights; runs on 1 device and on 8-device layouts agree step by
step and resume bitwise. Anchors: DPO's first loss log 2 with rewards 0, NumPy log-probs, the
base weights bit for bit.
"""

from __future__ import annotations

import math
import os

import jax
import numpy as np
import pytest
from flax import nnx

import trainer
from data import open_source, process_dataset
from model import Transformer, lora
from trainer.objectives.dpo import make_dpo_loss_fn, make_reference_fn
from trainer.program import abstract_program
from trainer.state import init_state, tree_bytes
from test_post_training import STEPS, column, corpora  # noqa: F401  (corpora: a fixture)
from test_post_training import config as post_config

LORA = ["model.lora.rank=4", "model.lora.alpha=8", "model.lora.targets=[q,k,v,o,gate,up,down]"]
LAYOUT = ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"]
DPO_KEYS = ("loss", "reward_margin", "reward_chosen", "reward_rejected", "reward_accuracy")


def config(objective: str, corpora: dict[str, str], run_dir, *extra: str):
    """test_post_training's short runs, without held-out eval."""
    return post_config(objective, corpora, run_dir, "eval.every=0", *extra)


def _log_softmax64(logits) -> np.ndarray:
    z = np.asarray(logits, np.float64)
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def test_the_lora_reference_is_the_base_model_and_the_loss_matches_numpy(corpora, tmp_path):
    cfg = config("dpo", corpora, tmp_path / "run", "mesh.data=1", *LORA)
    full_cfg = config("dpo", corpora, tmp_path / "run", "mesh.data=1")
    source = open_source(cfg, cfg.train.objective)
    batch = {k: np.stack([source.train[0][0][i][k] for i in range(8)]) for k in source.fields}
    program, full = abstract_program(cfg, jax.devices()[:1]), abstract_program(full_cfg, jax.devices()[:1])
    graphdef, full_graphdef = program.spec.model.graphdef, full.spec.model.graphdef
    params = nnx.to_pure_dict(nnx.state(Transformer(cfg.model, rngs=nnx.Rngs(0))))
    rng = np.random.default_rng(0)  # trained adapters: a policy that has left its reference
    params = jax.tree_util.tree_map_with_path(
        lambda p, a: a + 0.3 * rng.standard_normal(a.shape).astype(a.dtype) if str(p[-1].key).endswith("_lora_b")
        else a,
        params)
    base = lora.split(params)[1]
    ref = jax.jit(make_reference_fn(graphdef, program.compute, cfg.dpo))(lora.switched_off(params), batch)
    full_ref = jax.jit(make_reference_fn(full_graphdef, full.compute, cfg.dpo))(base, batch)
    total, (pairs, stats) = jax.jit(make_dpo_loss_fn(graphdef, program.compute, cfg.dpo))(
        params, {**batch, "ref_logps": ref})

    def logps64(m: nnx.Module) -> np.ndarray:
        t, w = batch["tokens"].reshape(16, -1), batch["loss_mask"].reshape(16, -1)[:, 1:]
        picked = np.take_along_axis(_log_softmax64(m.logits(m.features(t[:, :-1]))), t[:, 1:, None], -1)[..., 0]
        return (picked * w).sum(-1).reshape(8, 2)

    ref64, policy64 = logps64(nnx.merge(full_graphdef, base)), logps64(nnx.merge(graphdef, params))
    np.testing.assert_allclose(ref, ref64, rtol=1e-5)
    np.testing.assert_allclose(full_ref, ref64, rtol=1e-5)
    np.testing.assert_allclose(ref, full_ref, rtol=1e-6)  # the full model's reference on the same weights
    margin = (policy64 - ref64)[:, 0] - (policy64 - ref64)[:, 1]
    assert np.abs(margin).max() > 0.01  # the adapters count in the policy and not in the reference
    losses = np.logaddexp(0, -cfg.dpo.beta * margin)
    assert float(pairs) == 8
    np.testing.assert_allclose(float(total) / 8, losses.mean(), rtol=1e-4)
    expect = [cfg.dpo.beta * (policy64 - ref64)[:, 0].mean(), cfg.dpo.beta * (policy64 - ref64)[:, 1].mean(),
              cfg.dpo.beta * margin.mean(), (margin > 0).mean()]
    np.testing.assert_allclose(np.asarray(stats) / 8, expect, rtol=1e-4, atol=1e-5)


def test_a_lora_dpo_state_holds_no_copy_of_the_weights(corpora, tmp_path):
    lora_state = abstract_program(config("dpo", corpora, tmp_path / "a", *LAYOUT, *LORA)).abstract_state()
    full_state = abstract_program(config("dpo", corpora, tmp_path / "b", *LAYOUT)).abstract_state()
    assert lora_state.ref_params is None and full_state.ref_params is not None
    weights = tree_bytes(lora.split(lora_state.params)[1])
    assert weights == tree_bytes(full_state.params)  # the same base
    # step, parameters (base and adapters), moments: nothing else; the full run holds its weights twice
    assert tree_bytes(lora_state) == 4 + tree_bytes(lora_state.params) + tree_bytes(lora_state.opt_state)
    assert tree_bytes(full_state) == 4 + 2 * weights + tree_bytes(full_state.opt_state)


@pytest.fixture(scope="module")
def dpo_runs(corpora, tmp_path_factory) -> dict[str, tuple]:
    """LoRA DPO on one device and on LAYOUT (a learning rate that moves the rewards in 3 steps)."""
    out = {}
    for name, layout in (("one", ["mesh.data=1"]), ("eight", LAYOUT)):
        cfg = config("dpo", corpora, tmp_path_factory.mktemp("dpo") / "run", "optim.lr=3e-2",
                     f"optim.decay_steps={STEPS}", *LORA, *layout)
        out[name] = cfg, trainer.run(cfg, devices=jax.devices()[:1] if name == "one" else None)
    return out


def test_lora_dpo_starts_at_log_2_and_8_devices_give_the_one_device_run(dpo_runs):
    one, eight = dpo_runs["one"][1], dpo_runs["eight"][1]
    assert column(one, "loss")[0] == pytest.approx(math.log(2), abs=1e-6)
    assert column(one, "reward_margin")[0] == 0 and column(one, "reward_chosen")[0] == 0
    assert abs(column(one, "reward_margin")[-1]) > 1e-3  # the adapters have moved the policy
    for key in DPO_KEYS:
        np.testing.assert_allclose(column(eight, key), column(one, key), rtol=2e-5, atol=1e-6, err_msg=key)


@pytest.mark.parametrize("layout", [["mesh.data=2", "mesh.context=2", "mesh.tensor=2"],
                                    ["mesh.data=1", "mesh.pipeline=2", "mesh.tensor=4", "pipeline.schedule=gpipe",
                                     "train.grad_accum=2"]],
                         ids=["context", "gpipe+accumulation"])
def test_lora_dpo_on_other_layouts_gives_the_one_device_run(corpora, tmp_path, dpo_runs, layout):
    one = dpo_runs["one"][1]
    cfg = config("dpo", corpora, tmp_path / "run", "optim.lr=3e-2", f"optim.decay_steps={STEPS}", *LORA, *layout)
    history = trainer.run(cfg)
    for key in DPO_KEYS:
        np.testing.assert_allclose(column(history, key), column(one, key), rtol=2e-5, atol=1e-6, err_msg=key)


def test_lora_dpo_checkpoints_hold_the_adapters_alone_and_resume_bitwise(corpora, tmp_path, capsys, dpo_runs):
    import orbax.checkpoint as ocp

    common = ["optim.lr=3e-2", f"optim.decay_steps={STEPS}", "checkpoint.every=2", *LORA, *LAYOUT]
    first = trainer.run(config("dpo", corpora, tmp_path / "run", *common, "train.steps=2"))
    saved = ocp.StandardCheckpointer().restore(os.path.join(tmp_path / "run", "checkpoints", "2", "state"))
    assert jax.tree.leaves(saved["params"]) and not lora.split(saved["params"])[1]
    assert not jax.tree.leaves(saved.get("ref_params"))
    second = trainer.run(config("dpo", corpora, tmp_path / "run", *common))
    assert "resumed from step 2" in capsys.readouterr().out
    for key in DPO_KEYS:
        np.testing.assert_array_equal(column(first + second, key), column(dpo_runs["eight"][1], key), err_msg=key)


def _sft_steps(cfg, devices: list) -> tuple[list[float], dict, dict]:
    """STEPS steps of the program itself: (losses, base weights before, after)."""
    program = abstract_program(cfg, devices)
    state = init_state(cfg.model, program.tx, cfg.run.seed, program.state_sh)
    before = jax.device_get(lora.split(state.params)[1])
    ds = process_dataset(open_source(cfg, cfg.train.objective), cfg.train.global_batch, cfg.run.seed, 0, 1)
    out = []
    with program.tracing():
        for step in range(STEPS):
            batch = {k: jax.device_put(np.asarray(ds[step][k]), a.sharding)
                     for k, a in program.abstract_batch().items()}
            state, metrics = program.step(state, batch)
            out.append(float(metrics["loss"]))
    adapters, base = lora.split(jax.device_get(state.params))
    assert np.abs(adapters["layers"]["mlp"]["down_lora_b"]).max() > 0
    return out, before, base


def test_lora_sft_on_8_devices_gives_the_one_device_losses_and_keeps_the_base_bitwise(corpora, tmp_path):
    common = ["optim.lr=3e-2", f"optim.decay_steps={STEPS}", *LORA]
    one, before, after = _sft_steps(config("sft", corpora, tmp_path / "a", "mesh.data=1", *common), jax.devices()[:1])
    eight, before8, after8 = _sft_steps(config("sft", corpora, tmp_path / "b", *LAYOUT, *common), jax.devices())
    assert one[-1] < one[0] - 0.05, one
    np.testing.assert_allclose(eight, one, rtol=2e-5)
    for b, a in ((before, after), (before8, after8), (before, before8)):
        jax.tree.map(np.testing.assert_array_equal, a, b)


MOE = ["model.moe.num_experts=4", "model.moe.experts_per_token=2", "model.moe.d_ff=64", "model.moe.router=softmax_topk",
       "model.moe.capacity_factor=0.0"]


def _moe_run(corpora, run_dir, devices: int, *layout: str) -> list[dict]:
    cfg = config("sft", corpora, run_dir, "optim.lr=1e-2", f"optim.decay_steps={STEPS}", *MOE, *layout)
    return trainer.run(cfg, devices=jax.devices()[:devices])


@pytest.fixture(scope="module")
def moe_one(corpora, tmp_path_factory) -> list[dict]:
    return _moe_run(corpora, tmp_path_factory.mktemp("moe") / "run", 1, "mesh.data=1")


@pytest.mark.parametrize("expert", [2, 4])
def test_sft_on_an_expert_parallel_moe_gives_the_one_device_losses(corpora, tmp_path, moe_one, expert):
    other = _moe_run(corpora, tmp_path / "run", 8, f"mesh.data={8 // expert // 2}", f"mesh.expert={expert}",
                     "mesh.fsdp=2")
    assert np.ptp(column(moe_one, "loss")) > 0.05, column(moe_one, "loss")
    np.testing.assert_allclose(column(other, "loss"), column(moe_one, "loss"), rtol=2e-5)
    np.testing.assert_array_equal(column(other, "trained_tokens"), column(moe_one, "trained_tokens"))


def test_dpo_on_an_expert_parallel_moe_gives_the_one_device_run(corpora, tmp_path):
    """The policy's router losses join the DPO loss (so the first loss is above log 2 by them, the
    rewards still 0); expert=2 x fsdp=2 x data=2 against one device."""
    def run(name: str, devices: int, *layout: str) -> list[dict]:
        cfg = config("dpo", corpora, tmp_path / name, "optim.lr=3e-2", f"optim.decay_steps={STEPS}", *MOE,
                     "model.moe.aux_loss_coef=0.01", "model.moe.router_z_loss_coef=0.001", *layout)
        return trainer.run(cfg, devices=jax.devices()[:devices])

    one = run("one", 1, "mesh.data=1")
    other = run("ep", 8, "mesh.data=2", "mesh.expert=2", "mesh.fsdp=2")
    assert column(one, "reward_margin")[0] == 0 and column(one, "reward_chosen")[0] == 0
    # log 2 plus 0.01 x the balance loss (about 1) plus 0.001 x the z-loss: well above float32's log 2
    assert 0.005 < column(one, "loss")[0] - math.log(2) < 0.05
    assert abs(column(one, "reward_margin")[-1]) > 1e-3
    for key in DPO_KEYS:
        np.testing.assert_allclose(column(other, key), column(one, key), rtol=2e-5, atol=1e-6, err_msg=key)

"""Post-training combinations: LoRA (with dropout) DPO on a mixture of experts, multi-token
prediction under SFT, DPO with MTP refused, and DPO's held-out eval.

Anchors: DPO's first step, where the LoRA policy is its reference (B = 0) and the rewards are 0
exactly; the depth-1 MTP weights of a real SFT batch against the NumPy product of the
assistant-token weights; the held-out DPO metrics against a float64 NumPy computation from the
checkpoint's weights; the one-device run for the 8-device layouts.
"""

from __future__ import annotations

import os

import jax
import numpy as np
import pytest

import trainer
from conftest import ROOT
from data import eval_batches, open_source, process_dataset
from data.examples import dpo_rows, write
from data.prepare import prepare
from model import lora
from model.loss import model_inputs
from model.mtp import mtp_targets
from model.transformer import transformer_from_params
from trainer.checkpoint import restore_params
from trainer.program import abstract_program
from test_post_training import STEPS, column, corpora  # noqa: F401  (corpora: a fixture)
from test_post_training import config as post_config

MOE = ["model.moe.num_experts=4", "model.moe.experts_per_token=2", "model.moe.d_ff=64", "model.moe.router=softmax_topk",
       "model.moe.capacity_factor=0.0"]
LORA = ["model.lora.rank=4", "model.lora.alpha=8", "model.lora.targets=[q,k,v,o]", "model.lora.dropout=0.1"]
DPO_KEYS = ("loss", "reward_margin", "reward_chosen", "reward_rejected", "reward_accuracy")


def config(objective: str, corpora: dict[str, str], run_dir, *extra: str):
    return post_config(objective, corpora, run_dir, "eval.every=0", *extra)


def test_dpo_refuses_multi_token_prediction_with_exit_2(corpora, tmp_path, capsys):
    import train

    run_dir = tmp_path / "run"
    assert train.main(["--config", os.path.join(ROOT, "configs", "dpo-tiny.yaml"), f"run.dir={run_dir}",
                       f"data.path={corpora['dpo']}", "model.mtp_depth=1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: model.mtp_depth: 1 with train.objective=dpo"), err
    assert not run_dir.exists()


def test_mtp_under_sft_predicts_assistant_tokens_ahead(corpora):
    """Depth k's target at position i weighs 1 only where the main targets i .. i + k are all
    assistant tokens of one conversation (the main weights, loss mask included)."""
    cfg = config("sft", corpora, "unused")
    batch = process_dataset(open_source(cfg, cfg.train.objective), cfg.train.global_batch, cfg.run.seed, 0, 1)[0]
    b = model_inputs({k: np.asarray(v) for k, v in batch.items()})
    w = np.asarray(b["weights"], np.float64)
    extra = mtp_targets(b["inputs"], b["targets"], b["weights"], 2)
    ahead1 = np.concatenate([w[:, 1:], np.zeros_like(w[:, :1])], axis=1)
    ahead2 = np.concatenate([w[:, 2:], np.zeros_like(w[:, :2])], axis=1)
    np.testing.assert_array_equal(np.asarray(extra["mtp_weights"][0]), w * ahead1)
    np.testing.assert_array_equal(np.asarray(extra["mtp_weights"][1]), w * ahead1 * ahead2)
    assert 0 < np.sum(w * ahead1) < np.sum(w) < w.size  # the loss mask leaves out the prompts


def test_sft_with_mtp_on_8_devices_gives_the_one_device_run(corpora, tmp_path):
    def run(name: str, devices: int, *layout: str) -> list[dict]:
        cfg = config("sft", corpora, tmp_path / name, "optim.lr=1e-2", f"optim.decay_steps={STEPS}",
                     "model.mtp_depth=1", "model.mtp_loss_coef=0.3", *layout)
        return trainer.run(cfg, devices=jax.devices()[:devices])

    one = run("one", 1, "mesh.data=1")
    other = run("eight", 8, "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2")
    mtp = column(one, "mtp_loss")
    assert len(mtp) == STEPS and abs(mtp[0] - np.log(264)) < 0.5 and mtp[-1] < mtp[0] - 0.05, mtp
    for key in ("loss", "lm_loss", "mtp_loss", "trained_tokens"):
        np.testing.assert_allclose(column(other, key), column(one, key), rtol=2e-5, err_msg=key)


@pytest.fixture(scope="module")
def held_out_pairs(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A prepared DPO corpus with a held-out split (a quarter of the pairs, by hash)."""
    root = tmp_path_factory.mktemp("dpo-eval")
    write(str(root / "dpo.jsonl"), dpo_rows(64))
    prepare([str(root / "dpo.jsonl")], str(root / "dpo"), progress=False, objective="dpo", eval_fraction=0.25)
    return str(root / "dpo")


def _dpo_numpy(cfg, params: dict, batch: dict) -> dict[str, float]:  # noqa: ANN001 (a Config)
    """The DPO sigmoid loss and rewards of a batch of pairs in float64 NumPy, the policy `params`
    against the base (the adapters switched off), no dropout."""
    width = batch["tokens"].shape[-1]
    tokens, mask = batch["tokens"].reshape(-1, width), batch["loss_mask"].reshape(-1, width)

    def logps(p: dict) -> np.ndarray:
        z = np.asarray(transformer_from_params(cfg.model, p)(tokens[:, :-1]), np.float64)
        z = z - z.max(-1, keepdims=True)
        z = z - np.log(np.exp(z).sum(-1, keepdims=True))
        picked = np.take_along_axis(z, tokens[:, 1:, None], axis=-1)[..., 0]
        return (picked * (mask[:, 1:] != 0)).sum(-1).reshape(-1, 2)

    rewards = cfg.dpo.beta * (logps(params) - logps(lora.switched_off(params)))
    margin = rewards[:, 0] - rewards[:, 1]
    return {"loss": np.mean(np.log1p(np.exp(-margin))), "reward_chosen": rewards[:, 0].mean(),
            "reward_rejected": rewards[:, 1].mean(), "reward_margin": margin.mean(),
            "reward_accuracy": np.mean(rewards[:, 0] > rewards[:, 1])}


def test_lora_dpo_on_an_expert_parallel_moe_evaluates_held_out_pairs(corpora, held_out_pairs, tmp_path):
    """LoRA DPO, adapters under dropout on the attention of a mixture of experts, its reference the
    base itself, with eval.every: the held-out pairs' loss and rewards, logged as eval metrics, are
    NumPy's from the saved weights; expert=2 x fsdp=2 x data=2 gives the one-device run, training
    and eval metrics alike."""
    def run(name: str, devices: int, *layout: str) -> tuple:
        cfg = config("dpo", corpora, tmp_path / name, f"data.path={held_out_pairs}", "optim.lr=3e-2",
                     f"optim.decay_steps={STEPS}", *MOE, *LORA, "eval.every=2", "eval.batches=1", *layout)
        return cfg, trainer.run(cfg, devices=jax.devices()[:devices])

    cfg, one = run("one", 1, "mesh.data=1")
    assert abstract_program(cfg, jax.devices()[:1]).abstract_state().ref_params is None  # no copy: the base, B = 0
    assert column(one, "reward_margin")[0] == 0 and column(one, "reward_chosen")[0] == 0
    assert [r["step"] for r in one if "eval_loss" in r] == [2, STEPS]
    source = open_source(cfg, cfg.train.objective)
    assert source.eval is not None and 0 < len(source.eval) < len(source.train[0][0])
    batch = eval_batches(source, cfg.train.global_batch, 1, cfg.run.seed, 0, 1)[0]
    _, step, params = restore_params(cfg.run.dir, device=jax.devices()[0])
    assert step == STEPS
    theirs = _dpo_numpy(cfg, params, batch)
    assert abs(theirs["reward_margin"]) > 1e-3  # the policy has left its reference
    for key, value in theirs.items():
        np.testing.assert_allclose(column(one, f"eval_{key}")[-1], value, rtol=1e-4, atol=1e-6, err_msg=key)
    _, other = run("ep", 8, "mesh.data=2", "mesh.expert=2", "mesh.fsdp=2")
    for key in (*DPO_KEYS, *(f"eval_{k}" for k in theirs)):
        np.testing.assert_allclose(column(other, key), column(one, key), rtol=2e-5, atol=1e-6, err_msg=key)
